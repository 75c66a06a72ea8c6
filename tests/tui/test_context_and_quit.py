"""Issue 24 items 2 and 5 in the real TUI, locally and over --connect (a live loopback
server): a conversation that outgrows the context is trimmed with a notice and the pane
shows its tokens against the context; a prompt too long on its own is refused without
joining the history; quitting mid-reply keeps the partial reply, marked cut off."""

from __future__ import annotations

import asyncio
import time

import pytest

from panechat.app.clients.remote_ws import RemoteBackend
from panechat.app.server import start_in_background
from panechat.app.store import Store
from panechat.app.tui.widgets.prompt_input import PromptInput
from panechat.app.tui.widgets.transcript import AssistantMessage, ContextNotice

from .conftest import make_app, running_engine, type_and_send, type_and_send_busy, wait_busy, wait_engine_idle, wait_for

CTX = 256
SIZE = (160, 45)
FILLER = " ".join(["apple banana cherry"] * 20)  # ~60 tokens a turn


@pytest.fixture(scope="module")
def small_engine(loaded_model):
    """A 256-token context, so a few turns outgrow it."""
    with running_engine(loaded_model, ctx_size=CTX, max_concurrent=2, kv_sessions=4) as engine:
        yield engine


@pytest.fixture(scope="module")
def small_server(small_engine):
    srv = start_in_background(small_engine, "127.0.0.1", 0)
    yield srv
    srv.stop()


def _backend(kind: str, engine, srv):
    return engine if kind == "local" else RemoteBackend(srv.ws_url)


async def _ready(pilot):
    await wait_for(pilot, pilot.app.backend_ready.is_set, what="the backend")
    return pilot.app.main.panes[0]


async def _send_and_wait(pilot, pane, text: str):
    """Send `text` (typed when short, else as send() takes a submitted prompt); the Finished."""
    n = len(pane.history)
    if len(text) < 200:
        await type_and_send(pilot, pane, text)
    else:
        assert pane.send(text)
    await wait_for(pilot, lambda: not pane.busy and pane.last_finish is not None and len(pane.history) != n,
                   timeout=120, what="the reply")
    return pane.last_finish


@pytest.mark.parametrize("kind", ["local", "remote"])
async def test_a_conversation_past_the_context_is_trimmed_with_a_notice(kind, small_engine, small_server, store):
    app = make_app(_backend(kind, small_engine, small_server), store)
    async with app.run_test(size=SIZE) as pilot:
        pane = await _ready(pilot)
        for i in range(5):
            fin = await _send_and_wait(pilot, pane, f"{i}: {FILLER}")
            assert fin.reason in ("stop", "length"), fin.error  # never "prompt is N tokens but ..."
            assert fin.usage["prompt_tokens"] < CTX
        notices = list(pane.query(ContextNotice))
        assert notices and "no longer fit the 256-token context" in str(notices[-1].render())
        assert len(pane.history) == 10  # the history keeps every turn; only the prompt lost some
        used = fin.usage["prompt_tokens"] + fin.usage["completion_tokens"]
        assert f"{used:,} / {CTX:,} tok" in str(pane.border_subtitle)
    wait_engine_idle(small_engine)


@pytest.mark.parametrize("kind", ["local", "remote"])
async def test_a_prompt_too_long_alone_is_refused_and_not_kept(kind, small_engine, small_server, store):
    app = make_app(_backend(kind, small_engine, small_server), store)
    async with app.run_test(size=SIZE) as pilot:
        pane = await _ready(pilot)
        fin = await _send_and_wait(pilot, pane, "hello")
        assert fin.reason in ("stop", "length")
        huge = " ".join(["word"] * 600)
        assert pane.send(huge)
        await wait_for(pilot, lambda: not pane.busy and pane.last_finish.reason == "error", timeout=60,
                       what="the refusal")
        assert "context holds 256" in pane.last_finish.error
        assert [m.content for m in pane.history] == ["hello", pane.history[1].content]  # not added
        assert pane.query_one(PromptInput).value == huge  # given back to edit
        await pilot.pause(0.2)
        assert huge not in [m.content for m in store.messages(pane.conversation.id)]
        pane.query_one(PromptInput).clear()
        fin = await _send_and_wait(pilot, pane, "thanks")  # the pane still works
        assert fin.reason in ("stop", "length"), fin.error
        if kind == "remote":
            server_copy = small_server.state.conversations.get(pane.conversation.id).messages
            assert huge not in [m["content"] for m in server_copy]
    wait_engine_idle(small_engine)


@pytest.mark.parametrize("kind", ["local", "remote"])
async def test_quitting_mid_reply_keeps_the_partial_reply_marked(kind, tui_engine, server, store):
    store.set_setting("default_max_tokens", "800")
    cancelled = tui_engine.metrics.requests_finished["cancelled"]
    app = make_app(_backend(kind, tui_engine, server), store)
    async with app.run_test(size=SIZE) as pilot:
        pane = await _ready(pilot)
        cid = pane.conversation.id
        await type_and_send_busy(pilot, pane, "Write a very long story about three dragons")
        await wait_busy(lambda: len(pane._received) >= 2, timeout=120, what="the reply to start")
        await pilot.press("ctrl+q")
    if kind == "remote":  # the server keeps what it generated for the terminal that left, marked
        t0 = time.monotonic()
        while not server.state.conversations.get(cid).messages[-1].get("cut_off"):
            assert time.monotonic() - t0 < 30, server.state.conversations.get(cid).messages
            await asyncio.sleep(0.05)
    wait_engine_idle(tui_engine)
    # quitting cancelled the reply (an engine the app was given must not go on generating for it)
    assert tui_engine.metrics.requests_finished["cancelled"] == cancelled + 1
    reopened = Store.open()  # the same data folder, as a new process would find it
    try:
        kept = reopened.messages(cid)
        assert [m.role for m in kept] == ["user", "assistant"] and kept[1].meta.get("cut_off") is True
        assert kept[1].content.strip()
        app = make_app(_backend(kind, tui_engine, server), reopened)
        async with app.run_test(size=SIZE) as pilot:
            pane = await _ready(pilot)
            assert pane.conversation.id == cid
            await pilot.pause(0.5)  # a remote pane syncs with the server's copy
            reply = pane.query(AssistantMessage).last()
            assert reply.source.endswith("*[cut off]*") and pane.history[-1].meta.get("cut_off")
    finally:
        reopened.close()
    wait_engine_idle(tui_engine)
