"""TUI fixtures: one real engine on the default model for the session, a store per test."""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager

import pytest

from panechat.app.clients.local import LocalBackend
from panechat.app.store import Store
from panechat.engine.serving.engine import Engine, EngineConfig

MAX_TOKENS = 16  # replies stay short so the suite runs in a few minutes on 2 cores


@contextmanager
def running_engine(loaded_model, **config):
    """A started Engine on the default model (4 at once, 8 KV slots unless `config` says
    otherwise; no start-up self-check, tests/engine/test_batch_invariance.py covers it)."""
    settings = {"max_concurrent": 4, "kv_sessions": 8, "max_queue": 16, "ctx_size": 1024,
                "verify_invariance": False, **config}
    engine = Engine(loaded_model, EngineConfig(**settings)).start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def tui_engine(loaded_model):
    """The engine shared by every TUI test."""
    with running_engine(loaded_model) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(tui_engine):
    """A panechat server on loopback (websocket and HTTP) over the shared engine, per module."""
    from panechat.app.server import start_in_background

    srv = start_in_background(tui_engine, "127.0.0.1", 0)
    yield srv
    srv.stop()


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """PANECHAT_DATA_DIR and PANECHAT_EXPORT_DIR pointed at a temporary folder."""
    folder = tmp_path / "data"
    monkeypatch.setenv("PANECHAT_DATA_DIR", str(folder))
    monkeypatch.setenv("PANECHAT_EXPORT_DIR", str(tmp_path / "exports"))
    return folder


@pytest.fixture
def store(data_dir):
    """The store in the test's data dir, with short replies by default."""
    st = Store.open()
    st.set_setting("default_max_tokens", str(MAX_TOKENS))
    yield st
    st.close()


def make_app(backend_or_engine, store):
    from panechat.app.tui.app import PanechatApp

    backend = LocalBackend(backend_or_engine) if isinstance(backend_or_engine, Engine) else backend_or_engine
    return PanechatApp(backend, store)


async def wait_for(pilot, predicate, timeout: float = 60.0, step: float = 0.05, what: str = "condition"):
    """Pause the pilot until predicate() is true; fail after `timeout` seconds."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await pilot.pause(step)


async def wait_busy(predicate, timeout: float = 60.0, what: str = "condition"):
    """`wait_for` without waiting for the app to be idle (`pilot.pause` does): a fast reply
    keeps the app busy with its deltas until it ends, so a test that must act in the middle
    of a reply polls between them (the app's messages run while this sleeps)."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.005)


def wait_engine_idle(engine, timeout: float = 30.0) -> None:
    """Block until the engine has no streams and its 1 s tok/s window is empty."""
    t0 = time.monotonic()
    while True:
        s = engine.stats()
        if not s.streams and s.tok_s == 0 and s.batch_now == 0:
            return
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"engine still busy: {s.streams}")
        time.sleep(0.05)


async def type_into(pilot, pane, text: str) -> None:
    """Focus the pane's input and type `text` key by key (no Enter)."""
    pane.focus_input()
    await pilot.pause()
    await pilot.press(*text)


async def type_and_send(pilot, pane, text: str) -> None:
    """Focus the pane's input, type `text` key by key, press Enter."""
    await type_into(pilot, pane, text)
    await pilot.press("enter")


async def type_and_send_busy(pilot, pane, text: str) -> None:
    """`type_and_send` whose Enter is posted as the terminal driver delivers it, without
    `pilot.press`'s wait for an idle app (which lasts until a fast reply has ended): for a
    test that acts in the middle of the reply (with `wait_busy`)."""
    from textual import events

    await type_into(pilot, pane, text)
    pilot.app.post_message(events.Key("enter", "\r"))


__all__ = ["MAX_TOKENS", "make_app", "wait_for", "wait_busy", "wait_engine_idle", "type_and_send", "type_and_send_busy",
           "type_into", "asyncio"]


@pytest.fixture
def tmux(request):
    """A tmux server of this test's own (tests/tui/tmux_server.py), killed after it."""
    from .tmux_server import TmuxServer

    label = "".join(c for c in request.node.originalname if c.isalnum())[:24]
    server = TmuxServer(label)
    try:
        yield server
    finally:
        server.kill()
