"""Speculative drafts per pane (issue 27, "per pane"): F2's Drafts field (on/off) is stored
with the conversation and turns drafts off for that pane's requests on the local engine,
the websocket server and the OpenAI-compatible API (the reply is the same either way)."""

from __future__ import annotations

import pytest
from textual.app import App
from textual.widgets import Input, Label

from panechat.app.clients.base import GenParams
from panechat.app.clients.openai_http import OpenAIBackend
from panechat.app.clients.remote_ws import RemoteBackend
from panechat.app.server import start_in_background
from panechat.app.store import Conversation
from panechat.app.tui.screens.pane_settings import PaneSettingsScreen

from .conftest import make_app, type_and_send, wait_for

SIZE = (160, 45)


async def test_a_word_other_than_on_or_off_is_refused_in_one_line():
    app = App()
    async with app.run_test(size=(80, 24)) as pilot:
        await app.push_screen(PaneSettingsScreen(Conversation("c-1", "New chat")))
        await pilot.pause()
        app.screen.query_one("#spec", Input).value = "maybe"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, PaneSettingsScreen)  # not saved
        error = str(app.screen.query_one("#error", Label).content)
        assert error.startswith("drafts must be on or off") and "\n" not in error


async def test_f2_turns_drafts_off_for_the_panes_requests(tui_engine, store, monkeypatch):
    asked = []  # each request's speculate flag, as the engine receives it
    real = tui_engine.submit

    def submit(*args, **kwargs):
        asked.append(kwargs["params"].speculate)
        return real(*args, **kwargs)

    monkeypatch.setattr(tui_engine, "submit", submit)
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        pane = app.main.panes[0]
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, PaneSettingsScreen), what="settings")
        assert app.screen.query_one("#spec", Input).value == "on"
        app.screen.query_one("#spec", Input).value = "off"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.main, what="the dialog to close")
        assert store.get_conversation(pane.conversation.id).sampling == {"spec": False}
        await type_and_send(pilot, pane, "Say hi")
        await wait_for(pilot, lambda: pane.last_finish is not None and not pane.busy, timeout=90, what="a reply")
        await pilot.press("f2")  # the dialog shows it again
        await wait_for(pilot, lambda: isinstance(app.screen, PaneSettingsScreen), what="settings")
        assert app.screen.query_one("#spec", Input).value == "off"
        await pilot.press("escape")
    assert asked == [False]


@pytest.fixture(scope="module")
def server(tui_engine):
    srv = start_in_background(tui_engine, "127.0.0.1", 0)
    yield srv
    srv.stop()


@pytest.mark.parametrize("kind", ["websocket", "openai"])
async def test_the_remote_backends_send_drafts_off(server, tui_engine, monkeypatch, kind):
    """The server takes the field under its schema name (a wrong one would be refused) and
    its engine decodes that request without drafts."""
    asked = []
    real = tui_engine.submit

    def submit(*args, **kwargs):
        asked.append(kwargs["params"].speculate)
        return real(*args, **kwargs)

    monkeypatch.setattr(tui_engine, "submit", submit)
    backend = RemoteBackend(server.ws_url) if kind == "websocket" else OpenAIBackend(server.url + "/v1")
    await backend.start()
    try:
        for spec in (False, True):
            events = [ev async for ev in backend.stream(f"c-spec-{kind}", [{"role": "user", "content": "Say hi"}],
                                                        GenParams(max_tokens=4, spec=spec))]
            assert events[-1].reason in ("stop", "length"), events[-1]
    finally:
        await backend.close()
    assert asked == [False, True]
