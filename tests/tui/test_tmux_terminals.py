"""Two `panechat --connect` terminals in tmux on one `panechat serve` subprocess, with the
same HOME (issue 24, items 1, 6 and 7, in a real terminal): the second does not restore
the first one's live conversation and chats in its own pane; at 80x24 it shows the
dashboard as one line and F2-F5 in the footer; when the server stops it says
`disconnected, retrying` and, once a server is back on the port, reconnects by itself."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from panechat.app.store import Store
from tests.server.serve_process import ServeProcess, private_env


PANECHAT = Path(sys.executable).with_name("panechat")
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None or not PANECHAT.exists(),
                                reason="needs tmux and the panechat script")
IDLE = re.compile(r"idle · \d+\.\d tok/s")


def _terminal(tmux, name: str, root: Path, url: str, size: tuple[int, int]) -> str:
    env = f"PANECHAT_DATA_DIR={root / 'data'} PANECHAT_EXPORT_DIR={root / 'x'}"
    cmd = f"env {env} {PANECHAT} --connect {url}; echo PANECHAT-EXIT $?; sleep 60"
    tmux.new_session(name, size, cmd)
    tmux.poll(name, lambda s: "Message" in s and "batch" in s, 60, f"terminal {name} to start")
    return name


def test_two_terminals_on_one_server_in_tmux(tmp_path, model_path, tmux):
    server = ServeProcess(model_path, private_env(tmp_path / "srv"), "--ctx-size", "1024").wait_ready()
    port = server.ws_url.split(":")[-1].split("/")[0]
    again = None
    try:
        a = _terminal(tmux, f"pc-a-{os.getpid()}", tmp_path, server.ws_url, (160, 45))
        tmux.send(a, "Name a fruit")
        tmux.poll(a, lambda s: IDLE.search(s) is not None, 120, "A's reply")
        b = _terminal(tmux, f"pc-b-{os.getpid()}", tmp_path, server.ws_url, (80, 24))  # same HOME as A
        screen = tmux.poll(b, lambda s: "is open in terminal" in s, 30, "B's notice that A holds its pane")
        tmux.send(b, "Name a tree")
        screen = tmux.poll(b, lambda s: IDLE.search(s) is not None or "error" in s, 120, "B's reply")
        assert "already generating" not in screen, screen
        st = Store.open(tmp_path / "data")  # B's turn went to a conversation of its own, not A's
        try:
            turns = sorted([m.content for m in st.messages(c.id)][:1] for c in st.list_conversations())
        finally:
            st.close()
        assert turns == [["Name a fruit"], ["Name a tree"]], turns
        footer = screen.rstrip().splitlines()[-1]
        assert all(k in footer for k in ("Settings", "Export", "Open", "Model")), footer
        assert re.search(r"batch \d+/\d+ +queue \d+", screen), screen  # the dashboard as one line
        tmux("send-keys", "-t", a, "C-q")
        tmux.poll(a, lambda s: "PANECHAT-EXIT 0" in s, 30, "A's clean exit")

        assert server.stop() == 0
        tmux.poll(b, lambda s: "disconnected, retrying" in s, 10, "B to say it is disconnected")
        again = ServeProcess(model_path, private_env(tmp_path / "srv"), "--ctx-size", "1024",
                             "--port", port).wait_ready()
        tmux.poll(b, lambda s: "disconnected" not in s and re.search(r"batch \d+/\d+", s) is not None, 30,
                  "B to reconnect by itself")
        tmux("send-keys", "-t", b, "C-q")
        tmux.poll(b, lambda s: "PANECHAT-EXIT 0" in s, 30, "B's clean exit")
    finally:
        for srv in (server, again):
            if srv is not None and srv.p.poll() is None:
                srv.kill()
