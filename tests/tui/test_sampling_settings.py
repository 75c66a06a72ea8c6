"""F2's request fields beyond temperature, max tokens and seed (top p/k, min p, stop,
penalties): validated with the engine's bounds, stored per conversation, and honoured by
the local engine, the websocket server and the OpenAI-compatible API."""

from __future__ import annotations

import pytest
from textual.app import App
from textual.widgets import Input, Label

from panechat.app.clients.base import GenParams
from panechat.app.clients.openai_http import OpenAIBackend
from panechat.app.clients.remote_ws import RemoteBackend
from panechat.app.server import start_in_background
from panechat.app.server.request_fields import MAX_STOP, MAX_STOP_LEN
from panechat.app.server.request_schema import FIELDS, WS
from panechat.app.store import Conversation
from panechat.app.tui import sampling_fields
from panechat.app.tui.screens.pane_settings import PaneSettingsScreen

from .conftest import make_app, type_and_send, wait_for

SIZE = (160, 45)


@pytest.fixture(scope="module")
def server(tui_engine):
    srv = start_in_background(tui_engine, "127.0.0.1", 0)
    yield srv
    srv.stop()


def test_the_fields_and_defaults_are_the_request_schemas():
    ws = {f.name: f.defaults[WS] for f in FIELDS if WS in f.defaults}
    assert {n: ws[n] for n in sampling_fields.DEFAULTS} == sampling_fields.DEFAULTS
    assert (sampling_fields.MAX_STOP, sampling_fields.MAX_STOP_LEN) == (MAX_STOP, MAX_STOP_LEN)


@pytest.mark.parametrize("field, value, message", [
    ("top_p", "0", "top_p must be in (0, 1]"),
    ("top_k", "1.5", "top_k must be an integer >= 0"),
    ("min_p", "1", "min_p must be in [0, 1)"),
    ("presence_penalty", "3", "presence_penalty must be in [-2, 2]"),
    ("repeat_penalty", "0", "repeat_penalty must be in (0,"),
    ("stop", '["a", 1]', "stop must be a JSON list of strings"),
])
async def test_out_of_bounds_values_are_refused_in_one_line_at_80x24(field, value, message):
    app = App()
    async with app.run_test(size=(80, 24)) as pilot:
        await app.push_screen(PaneSettingsScreen(Conversation("c-1", "New chat")))
        await pilot.pause()
        app.screen.query_one(f"#{field}", Input).value = value
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, PaneSettingsScreen)  # not saved
        error = str(app.screen.query_one("#error", Label).content)
        assert error.startswith(message) and "\n" not in error


async def test_f2_stores_the_fields_and_the_local_engine_honours_stop(tui_engine, store):
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        pane = app.main.panes[0]
        await type_and_send(pilot, pane, "Count from one to ten")
        await wait_for(pilot, lambda: pane.last_finish is not None and not pane.busy, timeout=90, what="a reply")
        full = pane.history[-1].content
        words = full.split()
        assert len(words) >= 3, full
        stop = words[2]
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, PaneSettingsScreen), what="settings")
        for field, value in (("stop", stop), ("top_k", "40"), ("top_p", "0.9"), ("min_p", "0.05"),
                             ("presence_penalty", "0.5"), ("frequency_penalty", "0.25"),
                             ("repeat_penalty", "1.1"), ("repeat_last_n", "32")):
            app.screen.query_one(f"#{field}", Input).value = value
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.main, what="the dialog to close")
        stored = store.get_conversation(pane.conversation.id).sampling
        assert stored == {"stop": [stop], "top_k": 40, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5,
                          "frequency_penalty": 0.25, "repeat_penalty": 1.1, "repeat_last_n": 32}
        await pilot.press("f2")  # the dialog shows them again
        await wait_for(pilot, lambda: isinstance(app.screen, PaneSettingsScreen), what="settings")
        assert app.screen.query_one("#stop", Input).value == stop
        assert app.screen.query_one("#top_k", Input).value == "40"
        await pilot.press("escape")
        # greedy again with the stop string: the regenerated reply ends before it
        pane.conversation.sampling = {"stop": [stop]}
        before = pane.last_finish
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.last_finish is not before and not pane.busy, timeout=90, what="the reply")
        assert stop not in pane.history[-1].content and full.startswith(pane.history[-1].content.rstrip())


async def _reply(backend, params: GenParams) -> str:
    await backend.start()
    try:
        events = [ev async for ev in backend.stream("c-sampling", [{"role": "user", "content": "Count from one "
                                                                                    "to ten"}], params)]
    finally:
        await backend.close()
    fin = events[-1]
    assert fin.reason in ("stop", "length"), fin
    return fin.text


@pytest.mark.parametrize("kind", ["websocket", "openai"])
async def test_the_remote_backends_send_the_fields(server, kind):
    """Each field reaches the server under its schema name (a wrong name or value would be
    refused); the stop string takes effect."""
    make = (lambda: RemoteBackend(server.ws_url)) if kind == "websocket" else (
        lambda: OpenAIBackend(server.url + "/v1"))
    full = await _reply(make(), GenParams(max_tokens=16))
    stop = full.split()[2]
    cut = await _reply(make(), GenParams(max_tokens=16, stop=(stop,), presence_penalty=0.0001,
                                         frequency_penalty=0.0001, repeat_penalty=1.0001, repeat_last_n=8,
                                         top_k=40, min_p=0.0))
    assert stop not in cut and full.startswith(cut.rstrip())
    with pytest.raises(AssertionError, match="repeat_penalty"):  # the server checks what it gets
        await _reply(make(), GenParams(max_tokens=4, repeat_penalty=-1.0))
