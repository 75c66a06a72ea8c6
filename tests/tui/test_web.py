"""`panechat web` as a subprocess (issue 24, "In the browser"): one server per module.

- A websocket client speaking textual-serve's protocol (JSON text frames in, the terminal's
  bytes out, read as a screen by pyte) sees the TUI, chats through the engine, and is
  refused without the token or past --max-sessions.
- A real headless Chromium (Debian's chromium-headless-shell or chromium; skipped where
  neither is installed) opens the page, types into two panes, and a screenshot is taken
  while both replies stream (both prompts stored before it, both replies only after)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pyte = pytest.importorskip("pyte")
from websockets.exceptions import InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from panechat.app.store import Store  # noqa: E402

PANECHAT = Path(sys.executable).with_name("panechat")
pytestmark = pytest.mark.skipif(not PANECHAT.exists(), reason="needs the panechat script")
TOKEN = "web-test-token"
SIZE = (120, 32)
IDLE = re.compile(r"idle · \d+\.\d tok/s")
SCREENSHOT_DIR_ENV = "PANECHAT_SCREENSHOT_DIR"  # where to keep the browser's screenshot (default tmp)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WebProcess:
    """`panechat web` on a free loopback port with a token, its data folder under `root`."""

    def __init__(self, root: Path):
        self.root, self.port = root, _free_port()
        self.data = root / "data"
        st = Store.open(self.data)
        st.set_setting("default_max_tokens", "96")  # replies that stream for a few seconds
        st.close()
        env = {**os.environ, "PANECHAT_DATA_DIR": str(self.data), "PANECHAT_EXPORT_DIR": str(root),
               "XDG_CACHE_HOME": str(root / "cache")}
        self.p = subprocess.Popen([str(PANECHAT), "web", "--port", str(self.port), "--token", TOKEN,
                                   "--ctx-size", "1024", "--max-sessions", "1"],
                                  env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stderr:
            self.lines.append(line.rstrip())

    def wait_ready(self, timeout: float = 90) -> "WebProcess":
        t0 = time.monotonic()
        while not any("model ready" in line for line in self.lines):
            assert self.p.poll() is None, "\n".join(self.lines)
            assert time.monotonic() - t0 < timeout, "\n".join(self.lines)
            time.sleep(0.1)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def sessions_running(self) -> int:
        """TUI processes the server runs now (its children)."""
        n = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == self.p.pid:
                    n += 1
            except (OSError, IndexError, ValueError):
                pass
        return n

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.p.kill()


@pytest.fixture(scope="module")
def web(tmp_path_factory, model_path):
    proc = WebProcess(tmp_path_factory.mktemp("web"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _wait_sessions_gone(web: WebProcess, timeout: float = 20) -> None:
    t0 = time.monotonic()
    while web.sessions_running():
        assert time.monotonic() - t0 < timeout, "a browser session's TUI did not exit"
        time.sleep(0.1)


def _rows(data: Path) -> list[tuple[str, str, str, float]]:
    """(conversation, role, content, created) of every stored message, read-only (the TUIs write it)."""
    db = sqlite3.connect(f"file:{data / 'panechat.db'}?mode=ro", uri=True, timeout=5)
    try:
        return db.execute("SELECT conversation_id, role, content, created FROM messages ORDER BY id").fetchall()
    finally:
        db.close()


def _messages(data: Path) -> list[tuple[str, str, float]]:
    return [(role, content, created) for _, role, content, created in _rows(data)]


def _turn(data: Path, prompt: str) -> tuple[float, str, float] | None:
    """The last turn sent with `prompt`: (prompt stored at, its reply, reply stored at), the
    reply ('', 0.0) while none is stored; None before the prompt is."""
    rows, turn = _rows(data), None
    for i, (conv, role, content, created) in enumerate(rows):
        if role == "user" and content == prompt:
            reply = next(((c, t) for cv, r, c, t in rows[i + 1:] if cv == conv and r == "assistant"), ("", 0.0))
            turn = (created, *reply)
    return turn


def _wait(predicate, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)


class TerminalClient:
    """A browser tab without the browser: textual-serve's websocket, its bytes fed to pyte."""

    def __init__(self, web: WebProcess):
        self.screen = pyte.Screen(*SIZE)
        self.stream = pyte.ByteStream(self.screen)
        self._socket = connect(f"ws://127.0.0.1:{web.port}/ws?width={SIZE[0]}&height={SIZE[1]}",
                               additional_headers={"Cookie": f"panechat_token={TOKEN}"}, open_timeout=10)
        self.ws = self._socket.__enter__()

    def text(self) -> str:
        return "\n".join(self.screen.display)

    def type(self, text: str) -> None:
        self.ws.send(json.dumps(["stdin", text]))

    def wait(self, predicate, timeout: float, what: str) -> str:
        t0 = time.monotonic()
        while not predicate(self.text()):
            left = timeout - (time.monotonic() - t0)
            assert left > 0, f"timed out waiting for {what}; the screen was:\n{self.text()}"
            try:
                frame = self.ws.recv(timeout=min(left, 0.5))
            except TimeoutError:
                continue
            if isinstance(frame, bytes):
                self.stream.feed(frame)
        return self.text()

    def close(self) -> None:
        self._socket.__exit__(None, None, None)


def test_the_page_and_the_socket_need_the_token(web):
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(web.url + "/", timeout=10)
    assert refused.value.code == 401 and b"token is required" in refused.value.read()
    with urllib.request.urlopen(f"{web.url}/?token={TOKEN}", timeout=10) as page:
        assert page.status == 200 and "panechat_token=" in page.headers.get("Set-Cookie", "")
        assert b"/ws" in page.read()  # the page's websocket address
    with pytest.raises(InvalidStatus) as ws_refused:
        connect(f"ws://127.0.0.1:{web.port}/ws?width=80&height=24", open_timeout=10)
    assert ws_refused.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as cross_site:  # another site's page, with the cookie its browser holds
        connect(f"ws://127.0.0.1:{web.port}/ws", origin="http://attacker.example",
                additional_headers={"Cookie": f"panechat_token={TOKEN}"}, open_timeout=10)
    assert cross_site.value.response.status_code == 403


def test_a_browser_session_is_a_terminal_of_the_engine(web):
    """The socket shows the TUI, a typed prompt gets a reply through the engine's server
    (the reply lands in the store), and a second session past --max-sessions 1 is refused."""
    client = TerminalClient(web)
    try:
        client.wait(lambda s: "Message" in s and "batch" in s and "connecting" not in s, 60, "the TUI")
        with pytest.raises(InvalidStatus) as full:
            connect(f"ws://127.0.0.1:{web.port}/ws", additional_headers={"Cookie": f"panechat_token={TOKEN}"},
                    open_timeout=10)
        assert full.value.response.status_code == 503
        client.type("Name three colors\r")
        screen = client.wait(lambda s: IDLE.search(s) is not None or "error:" in s, 120, "the reply")
        assert "error:" not in screen and "1 · Name three colors" in screen, screen  # in order (the pane's name)
    finally:
        client.close()
    _wait_sessions_gone(web)
    roles = [(r, c) for r, c, _ in _messages(web.data)]
    assert roles[0] == ("user", "Name three colors") and roles[1][0] == "assistant" and roles[1][1].strip()


def _browser() -> str | None:
    return shutil.which("chromium-headless-shell") or shutil.which("chromium")


class DevTools:
    """A headless Chromium driven over the DevTools protocol (one page)."""

    def __init__(self, profile: Path, url: str):
        self.p = subprocess.Popen([_browser(), "--headless", "--no-sandbox", "--disable-gpu",
                                   "--remote-debugging-port=0", f"--user-data-dir={profile}",
                                   "--window-size=1280,800", url], start_new_session=True,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = None
        t0 = time.monotonic()
        while port is None:
            line = self.p.stderr.readline()
            assert line or self.p.poll() is None, "chromium exited"
            assert time.monotonic() - t0 < 30, "chromium did not start"
            if m := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                port = int(m.group(1))
        threading.Thread(target=self.p.stderr.read, daemon=True).start()  # keep the pipe drained
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        self._socket = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        self.ws = self._socket.__enter__()
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=30))
            if reply.get("id") == self.next_id:
                assert "error" not in reply, reply
                return reply.get("result", {})

    def key(self, key: str, code: str, vk: int, text: str = "", modifiers: int = 0) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=code, windowsVirtualKeyCode=vk,
                      modifiers=modifiers, **({"text": text} if kind == "keyDown" and text else {}))

    def click(self, x: int, y: int) -> None:
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type(self, text: str) -> None:
        self.call("Input.insertText", text=text)
        self.key("Enter", "Enter", 13, "\r")

    def close(self) -> None:
        self._socket.__exit__(None, None, None)
        os.killpg(self.p.pid, signal.SIGKILL)  # its renderer and network processes too (they hold the socket)
        self.p.wait(timeout=10)


@pytest.mark.skipif(_browser() is None, reason="needs Debian's chromium-headless-shell (or chromium)")
def test_two_panes_streaming_in_headless_chromium(web, tmp_path):
    _wait_sessions_gone(web)  # --max-sessions 1: the other test's session has ended
    prompts = ("Write a poem about the sea", "Write a poem about the mountains")
    connected = sum(" connected (panechat-tui" in line for line in web.lines)
    browser = DevTools(tmp_path / "profile", f"{web.url}/?token={TOKEN}")
    try:
        _wait(lambda: sum(" connected (panechat-tui" in line for line in web.lines) > connected, 60,
              "the page's session to connect to the engine's server (the server logs it)")
        time.sleep(1.5)  # its panes mount and the prompt box takes the focus
        browser.click(400, 400)  # the page gets the keyboard, as a user's first click gives it
        browser.type(prompts[0])
        browser.key("n", "KeyN", 78, modifiers=2)  # ctrl+n: a second pane
        time.sleep(0.5)
        browser.type(prompts[1])
        _wait(lambda: all(_turn(web.data, p) for p in prompts), 30, "both prompts to reach the store")
        time.sleep(1.5)  # some of both replies on screen
        shot_at = time.time()
        png = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
        folder = Path(os.environ.get(SCREENSHOT_DIR_ENV) or tmp_path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "panechat-web-two-panes.png").write_bytes(png)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a picture, not a blank page
        _wait(lambda: all(_turn(web.data, p)[1] for p in prompts), 120, "both replies")
        # both prompts stored before the screenshot, both replies only after it: both streaming then
        for p in prompts:
            sent_at, reply, replied_at = _turn(web.data, p)
            assert sent_at < shot_at < replied_at and reply.strip(), (p, sent_at, shot_at, replied_at)
    finally:
        browser.close()
