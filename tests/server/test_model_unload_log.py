"""`panechat serve` with models loaded on first use under --models-memory: a model unloaded
to make room for another is logged in one line naming it, why, and the budget
(engine/serving/model_set.py). Tiny synthetic models (tests/tiny_gguf.py), found through
$PANECHAT_MODELS as a user's own files are."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import httpx

from panechat.engine.serving.config import EngineConfig
from panechat.engine.serving.model_set import ModelSet

FLAGS = ["--backend", "numpy", "--max-concurrent", "1", "--ctx-size", "64", "--kv-sessions", "2"]


def _sizes(paths) -> list[int]:
    """Bytes each model holds once loaded with FLAGS' engine settings."""
    probe = ModelSet(EngineConfig(max_concurrent=1, ctx_size=64, kv_sessions=2), backend="numpy")
    sizes = []
    try:
        for p in paths:
            before = probe.used_bytes()
            probe.get(str(p))
            sizes.append(probe.used_bytes() - before)
    finally:
        probe.stop()
    return sizes


def _ask(url: str, model: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "a b", "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text


def test_a_model_unloaded_to_make_room_is_logged(tiny):
    d, a, b = tiny("llama", "Q8_0")[0], tiny("llama", "F32")[0], tiny("qwen2", "F32")[0]
    size_d, size_a, size_b = _sizes((d, a, b))
    budget = size_d + max(size_a, size_b) + min(size_a, size_b) // 2  # the default and one of a, b
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PANECHAT_MODELS": os.pathsep.join(map(str, (a, b)))}
    p = subprocess.Popen([sys.executable, "-c", "import sys; from panechat.app.cli import main; sys.exit(main())",
                          "serve", "--port", "0", "--model", str(d), "--models-memory", str(budget), *FLAGS],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    try:
        first = p.stderr.readline()
        url = re.search(r"listening on (http://127\.0\.0\.1:\d+)", first).group(1)
        reader = threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True)
        reader.start()
        t0 = time.monotonic()
        while not any(ln.startswith("ready in ") for ln in lines):
            assert p.poll() is None and time.monotonic() - t0 < 120, "".join(lines)
            time.sleep(0.1)
        _ask(url, a.stem)
        time.sleep(5.5)  # a model handed out counts as busy for 5 s (model_set.HANDOUT_BUSY_S)
        _ask(url, b.stem)  # `a` is idle: unloaded to make room
        t0 = time.monotonic()
        while not any("unloaded" in ln for ln in lines) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
    unloads = [ln.strip() for ln in lines if "unloaded" in ln]
    assert len(unloads) == 1, "".join(lines)
    assert re.fullmatch(rf"\d\d:\d\d:\d\d model {re.escape(a.stem)} unloaded \(idle, to make room for '{re.escape(b.stem)}' "
                        r"within --models-memory [\d.]+ [KMG]iB\)", unloads[0]), unloads
