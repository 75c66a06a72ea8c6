"""The TUI keeps a conversation's KV across a restart (issue 25, item 1): `panechat` in a
real terminal (tmux) answers a long message and quits; opened again, its pane holds the
conversation and the next turn's prompt comes from the snapshot the quit wrote, not a
re-prefill. The TUI runs with --share so its own engine's /metrics can be read: the
second session restores one snapshot and computes only the new turn's tokens."""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from panechat.app.store import Store

PANECHAT = Path(sys.executable).with_name("panechat")
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None or not PANECHAT.exists(),
                                reason="needs tmux and the panechat script")

LONG = "Remember these notes. " + " ".join(
    f"Note {k}: the {['red', 'green', 'blue', 'amber'][k % 4]} box holds {k * 7 % 31} pearls." for k in range(40))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for name, value in re.findall(r"^(panechat_\w+)(?:\{[^}]*\})? (\S+)$", text, re.M):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def _messages(data: Path) -> list:
    st = Store.open(data)
    try:
        (conv,) = st.list_conversations()
        return st.messages(conv.id)
    finally:
        st.close()


def _session(tmux, tmp_path: Path, name: str, port: int) -> str:
    env = " ".join(f"{k}={tmp_path / v}" for k, v in (("PANECHAT_DATA_DIR", "data"), ("PANECHAT_EXPORT_DIR", "x"),
                                                       ("XDG_CACHE_HOME", "cache"), ("XDG_STATE_HOME", "state")))
    cmd = f"env {env} {PANECHAT} --ctx-size 1024 --share --port {port}; echo PANECHAT-EXIT $?; sleep 60"
    tmux.new_session(name, (160, 45), cmd)
    tmux.poll(name, lambda s: "Message" in s and "sharing" in s, 180, "the TUI to start")
    return name


def _ask(tmux, session: str, data: Path, text: str, n_messages: int) -> None:
    tmux.send(session, text)
    t0 = time.monotonic()
    while len(_messages(data)) < n_messages or "tok/s" not in tmux.capture(session):
        assert time.monotonic() - t0 < 300, tmux.capture(session)
        time.sleep(0.5)


def _quit(tmux, session: str) -> None:
    tmux("send-keys", "-t", session, "C-q")
    tmux.poll(session, lambda s: "PANECHAT-EXIT 0" in s, 90, "a clean exit")
    tmux("kill-session", "-t", session)


def test_the_tui_reopened_continues_a_long_conversation_from_its_snapshot(tmp_path, tmux):
    data = tmp_path / "data"
    st = Store.open(data)
    st.set_setting("default_max_tokens", "16")
    st.close()
    port = _free_port()
    first = _session(tmux, tmp_path, f"panechat-kv1-{os.getpid()}", port)
    _ask(tmux, first, data, LONG, 2)
    _quit(tmux, first)  # the engine's stop writes the conversation's KV
    snaps = list((tmp_path / "cache" / "panechat" / "kv").glob("*/*.kvsnap"))
    assert len(snaps) == 1, snaps

    second = _session(tmux, tmp_path, f"panechat-kv2-{os.getpid()}", port)
    assert "Note 39" in tmux.capture(second) or "pearls" in tmux.capture(second)  # the pane holds it
    before = _metrics(port)
    _ask(tmux, second, data, "Which box holds the most pearls?", 4)
    after = _metrics(port)
    _quit(tmux, second)
    prompt = after["panechat_prompt_tokens_total"] - before["panechat_prompt_tokens_total"]
    reused = after["panechat_reused_prefix_tokens_total"] - before["panechat_reused_prefix_tokens_total"]
    assert after["panechat_kv_snapshots_restored_total"] == 1
    assert prompt > 400 and prompt - reused < 48, (prompt, reused)  # only the new turn was prefilled
