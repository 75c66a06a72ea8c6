"""`panechat run --connect URL` against a real `panechat serve` subprocess (issue 24 item 12):
the option before or after the subcommand, the token, a piped prompt; the reply is the one
the local engine gives, and the server's request log shows it answered it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from .test_cli import cli

TOKEN = "s3cret"
PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def served(model_path):
    """(ws URL, the server's stderr lines so far) of one `panechat serve` for the module."""
    p = subprocess.Popen([str(Path(sys.executable).parent / "panechat"), "serve", "--port", "0", "--ctx-size", "512",
                          "--max-concurrent", "2", "--token", TOKEN, "--state-dir", "none", "--model", str(model_path)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    first = p.stderr.readline()
    lines.append(first)
    threading.Thread(target=lambda: lines.extend(iter(p.stderr.readline, "")), daemon=True).start()
    try:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", first)
        assert m, first
        port = m.group(1)
        t0 = time.monotonic()
        while httpx.get(f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {TOKEN}"}).status_code != 200:
            assert time.monotonic() - t0 < 120 and p.poll() is None, "".join(lines)
            time.sleep(0.2)
        yield f"ws://127.0.0.1:{port}", lines
    finally:
        p.terminate()
        p.wait(timeout=30)


def _answered(lines: list[str], before: int) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:  # the log line is written when the response completes
        if any('"POST /v1/chat/completions" 200' in ln for ln in lines[before:]):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("argv", [
    ["--connect", "{url}", "--token", TOKEN, "run", "-n", "6", "--json", PROMPT],
    ["run", "--connect", "{url}", "--token", TOKEN, "-n", "6", "--json", PROMPT],
], ids=["before", "after"])
def test_run_uses_the_server_connect_names(served, argv):
    url, lines = served
    before = len(lines)
    remote = cli(*[a.replace("{url}", url) for a in argv])
    assert remote.returncode == 0, remote.stderr
    out = json.loads(remote.stdout)
    assert _answered(lines, before), "the server did not answer the run"
    local = json.loads(cli("run", "-n", "6", "--json", PROMPT).stdout)
    assert out["text"] == local["text"] and out["completion_tokens"] == local["completion_tokens"]
    assert out["model"] == Path(local_model_name()).stem


def local_model_name() -> str:
    from panechat.engine.default_model import resolve_model_path

    return resolve_model_path(None).name


def test_run_connect_reads_a_piped_prompt_and_streams_text(served):
    url, lines = served
    before = len(lines)
    p = cli("run", "--connect", url, "--token", TOKEN, "-n", "4", stdin=PROMPT + "\n")
    assert p.returncode == 0 and p.stdout.strip(), p.stderr
    assert f"at http://127.0.0.1:{url.rsplit(':', 1)[1]}/v1" in p.stderr  # the start-up line names the server
    assert _answered(lines, before)


def test_run_connect_without_the_token_is_one_line(served):
    url, _ = served
    p = cli("run", "--connect", url, "hi")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "--token" in lines[0] and "Traceback" not in p.stderr, p.stderr
