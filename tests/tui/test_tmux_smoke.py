"""Smoke test in a real terminal: tmux runs `panechat` at 160x45, we type a prompt, and
`capture-pane` must show the streamed reply and a tok/s figure."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from panechat.app.store import Store

PANECHAT = Path(sys.executable).with_name("panechat")
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None or not PANECHAT.exists(),
                                reason="needs tmux and the panechat script")


def test_panechat_in_tmux_streams_a_reply(tmp_path, model_path, tmux):
    data = tmp_path / "data"
    st = Store.open(data)
    st.set_setting("default_max_tokens", "24")  # a short reply
    st.close()
    session = f"panechat-smoke-{os.getpid()}"
    env = f"PANECHAT_DATA_DIR={data} PANECHAT_EXPORT_DIR={tmp_path} XDG_CACHE_HOME={tmp_path / 'cache'}"  # KV snapshots too
    cmd = f"env {env} {PANECHAT} --ctx-size 1024; echo PANECHAT-EXIT $?; sleep 60"
    tmux.new_session(session, (160, 45), cmd)
    assert tmux("display-message", "-p", "-t", session, "#{window_width}x#{window_height}").strip() == "160x45"
    tmux.poll(session, lambda s: "Message" in s and "batch" in s, 60, "the TUI to start")
    tmux.send(session, "Name three colors")
    tok_s = re.compile(r"idle · \d+\.\d tok/s")
    screen = tmux.poll(session, lambda s: tok_s.search(s) is not None, 240, "the reply and its tok/s")
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
    tmux.poll(session, lambda s: "PANECHAT-EXIT 0" in s, 30, "a clean exit")
