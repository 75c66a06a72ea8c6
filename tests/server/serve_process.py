"""`panechat serve` as a user runs it, in a subprocess with an environment of its own (the
XDG folders a test picks): its stderr collected, its /metrics read, stopped with SIGTERM
(the graceful path) or SIGKILL (a crash)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PANECHAT = [sys.executable, "-c", "import sys; from panechat.app.cli import main; sys.exit(main())"]


def private_env(root: Path) -> dict[str, str]:
    """os.environ with the cache, state and data folders under `root` (KV snapshots in
    root/cache/panechat/kv, their key in root/state, /ws conversations in root/data)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": str(root / "cache"),
            "XDG_STATE_HOME": str(root / "state"), "PANECHAT_DATA_DIR": str(root / "data")}


def kv_files(root: Path) -> list[Path]:
    """The snapshot files under root's cache (any model)."""
    return sorted((root / "cache" / "panechat" / "kv").glob("*/*.kvsnap"))


class ServeProcess:
    """`panechat serve --port 0 --model MODEL FLAGS` with `env`; `wait_ready()` before use."""

    def __init__(self, model_path, env: dict[str, str], *flags: str):
        self.p = subprocess.Popen([*PANECHAT, "serve", "--port", "0", "--model", str(model_path), *flags],
                                  stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines: list[str] = []
        first = self.p.stderr.readline()
        self.lines.append(first)
        m = re.search(r"listening on (http://127\.0\.0\.1:(\d+))", first)
        assert m, first
        self.url, self.ws_url = m.group(1), f"ws://127.0.0.1:{m.group(2)}/ws"
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.p.stderr:
            self.lines.append(line)

    @property
    def err(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 180) -> "ServeProcess":
        t0 = time.monotonic()
        while not any(line.startswith("ready in ") for line in self.lines):
            assert self.p.poll() is None, self.err
            assert time.monotonic() - t0 < timeout, self.err
            time.sleep(0.1)
        return self

    def metric(self, name: str) -> float:
        """The sum of a /metrics sample over its labels (0 when absent)."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM (drain, snapshots written), then the exit status."""
        self.p.send_signal(signal.SIGTERM)
        rc = self.p.wait(timeout)
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        """SIGKILL: nothing is drained, written or closed."""
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(30)
        self._reader.join(5)

    def close(self) -> None:
        if self.p.poll() is None:
            self.kill()


def stream_chat(url: str, messages: list[dict], max_tokens: int, timeout: float = 300) -> dict:
    """A streamed chat completion (greedy): its text, the seconds to its first content
    chunk as the client sees them, and the usage and timings of its last chunk."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, first, usage, timings = [], None, {}, {}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - t0
                    text.append(piece)
            usage, timings = chunk.get("usage") or usage, chunk.get("timings") or timings
    return {"text": "".join(text), "ttft_s": first, "usage": usage, "timings": timings}
