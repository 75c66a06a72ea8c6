"""Smoke test in a real terminal: tmux runs `panechat` at 160x45, we type a prompt, and
`capture-pane` must show the streamed reply and a tok/s figure."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from panechat.app.store import Store

PANECHAT = Path(sys.executable).with_name("panechat")
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None or not PANECHAT.exists(),
                                reason="needs tmux and the panechat script")


SOCKET = f"panechat-test-{os.getpid()}"  # a private tmux server: no other sessions, no user config


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", SOCKET, "-f", "/dev/null", *args], check=True, capture_output=True,
                          text=True).stdout


def capture(session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session)


def poll(session: str, predicate, timeout: float, what: str) -> str:
    t0 = time.monotonic()
    while True:
        screen = capture(session)
        if predicate(screen):
            return screen
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}; the screen was:\n{screen}")
        time.sleep(0.5)


def test_panechat_in_tmux_streams_a_reply(tmp_path, model_path):
    data = tmp_path / "data"
    st = Store.open(data)
    st.set_setting("default_max_tokens", "24")  # a short reply
    st.close()
    session = f"panechat-smoke-{os.getpid()}"
    env = f"PANECHAT_DATA_DIR={data} PANECHAT_EXPORT_DIR={tmp_path} XDG_CACHE_HOME={tmp_path / 'cache'}"  # KV snapshots too
    cmd = f"env {env} {PANECHAT} --ctx-size 1024; echo PANECHAT-EXIT $?; sleep 60"
    tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "45", cmd)
    try:
        assert tmux("display-message", "-p", "-t", session, "#{window_width}x#{window_height}").strip() == "160x45"
        poll(session, lambda s: "Message" in s and "batch" in s, 60, "the TUI to start")
        tmux("send-keys", "-t", session, "-l", "Name three colors")
        tmux("send-keys", "-t", session, "Enter")
        tok_s = re.compile(r"idle · \d+\.\d tok/s")
        screen = poll(session, lambda s: tok_s.search(s) is not None, 240, "the reply and its tok/s")
        st = Store.open(data)
        (conv,) = st.list_conversations()
        reply = st.messages(conv.id)[-1]
        st.close()
        assert reply.role == "assistant" and reply.content.strip()
        words = reply.content.split()[:3]
        flat = " ".join(screen.split())  # the pane wraps lines; compare word by word
        assert " ".join(words) in flat.replace("│", " ").replace("  ", " ") or all(w in flat for w in words), screen
        assert "Name three colors" in screen
        assert "SmolLM2" in screen  # the dashboard names the model
        tmux("send-keys", "-t", session, "C-q")
        poll(session, lambda s: "PANECHAT-EXIT 0" in s, 30, "a clean exit")
    finally:
        subprocess.run(["tmux", "-L", SOCKET, "kill-server"], capture_output=True)
