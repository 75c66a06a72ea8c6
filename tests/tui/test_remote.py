"""Remote modes against a live `panechat serve` on loopback (in-process, real engine):
the websocket protocol (--connect ws://) and the OpenAI API (--connect http://.../v1)."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets
from textual import events

from panechat.app.clients.openai_http import OpenAIBackend
from panechat.app.clients.remote_ws import RemoteBackend
from panechat.app.server import start_in_background
from panechat.app.store import Store
from panechat.app.tui.widgets.dashboard import Dashboard
from panechat.app.tui.widgets.prompt_input import PromptInput
from panechat.engine.serving.stats import EngineStats

from .conftest import MAX_TOKENS, make_app, type_and_send, type_and_send_busy, type_into, wait_busy, wait_for

SIZE = (160, 45)


@pytest.fixture(scope="module")
def token_server(tui_engine):
    srv = start_in_background(tui_engine, "127.0.0.1", 0, token="s3cret")
    yield srv
    srv.stop()


async def other_terminal(ws_url: str, started: asyncio.Event, release: asyncio.Event,
                         max_tokens: int = 64) -> dict:
    """A second terminal speaking the protocol directly: one generation, then it stays
    connected until `release`; returns its `finished` frame."""
    async with websockets.connect(ws_url) as ws:
        await ws.send(json.dumps({"type": "hello", "protocol": 1, "client": "test"}))
        assert json.loads(await ws.recv())["type"] == "welcome"
        await ws.send(json.dumps({"type": "open", "conversation": "c-other"}))
        assert json.loads(await ws.recv())["type"] == "opened"
        await ws.send(json.dumps({"type": "send", "conversation": "c-other", "request": "r-1",
                                  "content": "Describe the moon", "params": {"max_tokens": max_tokens}}))
        started.set()
        while True:
            frame = json.loads(await ws.recv())
            if frame["type"] == "finished":
                await release.wait()
                return frame


async def test_ws_panes_join_the_servers_batch(server, store, tui_engine):
    app = make_app(RemoteBackend(server.ws_url), store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the connection")
        # the name the local engine goes by too (the file's name without .gguf)
        assert app.backend.info.model == tui_engine.lm.name.removesuffix(".gguf")
        assert app.backend.info.max_concurrent == 4
        await pilot.press("ctrl+n")
        a, b = app.main.panes
        dash = app.main.query_one(Dashboard)
        await type_into(pilot, a, "Name a fruit")
        await type_into(pilot, b, "Name a tree")
        started, release = asyncio.Event(), asyncio.Event()
        other = asyncio.create_task(other_terminal(server.ws_url, started, release))
        seen_other = seen_terminals = 0

        async def sample() -> None:  # what the dashboard got from the stats subscription
            nonlocal seen_other, seen_terminals
            while True:
                s = dash.stats or EngineStats()
                seen_terminals = max(seen_terminals, s.terminals or 0)
                seen_other |= any(x.conversation == "c-other" for x in s.streams)
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        await started.wait()
        for p in (a, b):  # Enter in both inputs, back to back (see test_app)
            p.query_one(PromptInput).post_message(events.Key("enter", None))
        await wait_for(pilot, lambda: all(p.last_finish is not None and not p.busy for p in (a, b)),
                       timeout=90, what="two replies")
        release.set()
        fin = await asyncio.wait_for(other, 60)
        sampler.cancel()
        assert fin["reason"] in ("stop", "length")
        for p in (a, b):
            assert p.last_finish.reason in ("stop", "length"), p.last_finish
            assert p.last_finish.text and "tok/s" in p.border_subtitle
            assert p.last_finish.usage["completion_tokens"] <= MAX_TOKENS
        assert seen_terminals >= 2, "the stats subscription should count both terminals"
        assert seen_other, "the dashboard should list the other terminal's stream"
        assert dash.peak_batch >= 2
        assert "panechat server" in str(dash.query_one("#dash-backend").render())
        conv_id, reply = a.conversation.id, a.last_finish.text

    # the server keeps the conversation: another terminal (its own empty store) resumes it
    other_store = Store(store.path.parent / "other.db")
    other_store.new_conversation("resumed", conv_id=conv_id)
    other_store.save_layout(server.ws_url, [conv_id])
    app2 = make_app(RemoteBackend(server.ws_url), other_store)
    async with app2.run_test(size=SIZE) as pilot:
        pane = app2.main.panes[0]
        await wait_for(pilot, lambda: len(pane.history) == 2, timeout=30, what="the server's copy")
        assert [m.content for m in pane.history] == ["Name a fruit", reply]
        await wait_for(pilot, lambda: len(other_store.messages(conv_id)) == 2, what="the copy stored")
        assert [m.content for m in other_store.messages(conv_id)] == ["Name a fruit", reply]
    other_store.close()


async def test_a_restarted_server_gets_the_history_back_from_the_terminal(server, tui_engine, store):
    """The server keeps conversations in memory only; after a restart the terminal's own
    copy (SQLite) seeds them again, so the next reply still sees the earlier turns."""
    app = make_app(RemoteBackend(server.ws_url), store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the connection")
        pane = app.main.panes[0]
        await type_and_send(pilot, pane, "My cat is called Miso")
        await wait_for(pilot, lambda: pane.last_finish is not None, timeout=60, what="the reply")
        conv_id, first = pane.conversation.id, [m.content for m in pane.history]
    restarted = start_in_background(tui_engine, "127.0.0.1", 0)  # empty conversation store
    try:
        store.save_layout(restarted.ws_url, [conv_id])
        app = make_app(RemoteBackend(restarted.ws_url), store)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, app.backend_ready.is_set, what="the connection")
            pane = app.main.panes[0]
            assert pane.conversation.id == conv_id
            await type_and_send(pilot, pane, "What is my cat called?")
            await wait_for(pilot, lambda: pane.last_finish is not None, timeout=60, what="the reply")
            assert pane.last_finish.reason in ("stop", "length"), pane.last_finish
            assert [m.content for m in pane.history][:2] == first
        async with websockets.connect(restarted.ws_url) as ws:
            await ws.send(json.dumps({"type": "hello", "protocol": 1, "client": "test"}))
            assert json.loads(await ws.recv())["type"] == "welcome"
            await ws.send(json.dumps({"type": "open", "conversation": conv_id}))
            copy = json.loads(await ws.recv())["messages"]
        assert [m["content"] for m in copy if m["role"] != "system"] == [m.content for m in pane.history]
        assert len(copy) >= 4
    finally:
        restarted.stop()


async def test_ws_cancel_reaches_the_server(server, store):
    store.set_setting("default_max_tokens", "400")
    app = make_app(RemoteBackend(server.ws_url), store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the connection")
        pane = app.main.panes[0]
        await type_and_send_busy(pilot, pane, "Tell me a long story")
        await wait_busy(lambda: pane.meter is not None and pane.meter.tokens >= 2, what="tokens")
        app.post_message(events.Key("ctrl+s", None))  # as the terminal driver delivers it (no idle wait)
        await wait_for(pilot, lambda: not pane.busy, timeout=30, what="the cancel")
        assert pane.last_finish.reason == "cancelled" and pane.meter.tokens < 400


async def test_ws_wrong_token_exits_with_one_line(token_server, store):
    app = make_app(RemoteBackend(token_server.ws_url, token="wrong"), store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.fatal_error is not None, timeout=15, what="the refusal")
    assert "token" in app.fatal_error and "\n" not in app.fatal_error
    app = make_app(RemoteBackend(token_server.ws_url, token="s3cret"), store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, timeout=15, what="the connection")


async def test_openai_http_backend(server, store):
    store.set_setting("default_max_tokens", "48")
    app = make_app(OpenAIBackend(server.url + "/v1"), store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the models list")
        assert app.backend.info.kind == "openai" and app.backend.info.model
        pane = app.main.panes[0]
        dash = app.main.query_one(Dashboard)
        await type_into(pilot, pane, "Name a river")
        seen_stream = False

        async def sample() -> None:
            nonlocal seen_stream
            while True:
                seen_stream |= bool(dash.stats and dash.stats.streams)
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        pane.query_one(PromptInput).post_message(events.Key("enter", None))
        await wait_for(pilot, lambda: pane.last_finish is not None and not pane.busy, timeout=60, what="the reply")
        sampler.cancel()
        assert pane.last_finish.reason in ("stop", "length"), pane.last_finish
        assert pane.last_finish.text and pane.meter.tokens > 0
        assert "tok/s" in pane.border_subtitle
        assert seen_stream, "the dashboard lists this terminal's own streams"
        await type_and_send(pilot, pane, "And another")  # full history goes with each request
        await wait_for(pilot, lambda: len(pane.history) == 4 and not pane.busy, timeout=60, what="turn 2")


async def test_unreachable_server_exits_with_one_line(store):
    app = make_app(RemoteBackend("ws://127.0.0.1:9"), store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.fatal_error is not None, timeout=15, what="the failure")
    assert "cannot connect" in app.fatal_error


async def test_share_hosts_the_server_in_process(tui_engine, store):
    """--share: teammates connect to this TUI's own engine and batch with its panes."""
    from panechat.app.clients.local import LocalBackend
    from panechat.app.tui.app import PanechatApp
    from panechat.app.tui.launch import ShareServer

    backend = LocalBackend(tui_engine)
    sharing = ShareServer(backend, "127.0.0.1", 0, token="team")
    app = PanechatApp(backend, store, share=sharing.attach, close_share=sharing.close)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.share_line is not None, timeout=30, what="sharing to start")
        assert f":{sharing.srv.port}" in app.share_line
        dash = app.main.query_one(Dashboard)
        await wait_for(pilot, lambda: str(dash.query_one("#dash-share").render()) == app.share_line,
                       timeout=5, what="the dashboard to show the share line")
        pane = app.main.panes[0]
        await type_into(pilot, pane, "Name a bird")
        started, release = asyncio.Event(), asyncio.Event()
        teammate = RemoteBackend(sharing.ws_url, token="team")

        async def teammate_turn():
            await teammate.start()
            from panechat.app.clients.base import Delta, Finished, GenParams

            # a long reply, and the pane's request sent once it is decoding: the two overlap
            # even when a loaded machine delays the pane's keypress
            stream = teammate.stream("c-mate", [{"role": "user", "content": "Describe rain"}], GenParams(max_tokens=256))
            async for ev in stream:
                if isinstance(ev, Delta):
                    started.set()
                if isinstance(ev, Finished):
                    await release.wait()
                    await teammate.close()
                    return ev

        mate = asyncio.create_task(teammate_turn())
        seen_terminals = seen_mate = 0

        async def sample() -> None:
            nonlocal seen_terminals, seen_mate
            while True:
                s = dash.stats or EngineStats()
                seen_terminals = max(seen_terminals, s.terminals or 0)
                seen_mate |= any(x.conversation == "c-mate" for x in s.streams)
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        await started.wait()
        pane.query_one(PromptInput).post_message(events.Key("enter", None))
        await wait_for(pilot, lambda: pane.last_finish is not None and not pane.busy, timeout=60, what="the reply")
        release.set()
        fin = await asyncio.wait_for(mate, 60)
        sampler.cancel()
        assert fin.reason in ("stop", "length") and fin.text
        assert pane.last_finish.reason in ("stop", "length")
        assert seen_terminals == 2, "this terminal and the teammate"
        assert seen_mate, "the teammate's stream shows on the host's dashboard"
        assert dash.peak_batch >= 2, "the teammate's request and the pane's shared a batch"
    assert not sharing.srv.running  # closed with the app


async def test_a_refused_request_shows_as_an_error_in_its_pane(server, store):
    app = make_app(OpenAIBackend(server.url + "/v1", model="no-such-model"), store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the models list")
        pane = app.main.panes[0]
        await type_and_send(pilot, pane, "Hello")
        await wait_for(pilot, lambda: pane.last_finish is not None and not pane.busy, timeout=30, what="the error")
        assert pane.last_finish.reason == "error" and "HTTP 4" in pane.last_finish.error
        assert pane.state.startswith("error: HTTP 4")
        assert [m.role for m in pane.history] == ["user"]  # nothing stored for the failed reply


async def test_a_conversation_the_server_dropped_is_reopened_with_the_terminals_copy(server):
    """--history-memory lets the server drop idle conversations, even one a terminal has
    open; the terminal's next send gets unknown_conversation, reopens it with its own copy
    and sends again: the reply still sees the earlier turns."""
    from panechat.app.clients.base import GenParams

    backend = RemoteBackend(server.ws_url)
    await backend.start()
    try:
        params = GenParams(temperature=0.0, max_tokens=MAX_TOKENS)
        history = [{"role": "user", "content": "My cat is called Miso."}]
        events = [ev async for ev in backend.stream("c-dropped", history, params)]
        first = events[-1]
        assert first.reason in ("stop", "length"), first
        history.append({"role": "assistant", "content": first.text})
        store = server.state.conversations
        store.discard(store.get("c-dropped"))  # what eviction does
        history.append({"role": "user", "content": "What is my cat called?"})
        events = [ev async for ev in backend.stream("c-dropped", history, params)]
        assert events[-1].reason in ("stop", "length"), events[-1]
        kept = [m["content"] for m in store.get("c-dropped").messages if m["role"] != "system"]
        assert kept[:3] == [m["content"] for m in history]  # restored, then the new turn
    finally:
        await backend.close()


async def test_ws_regenerate_edit_and_delete_send_the_right_history(server, store):
    """With --connect the server keeps the history: a regenerate, an edit and a delete in
    the pane rewrite the server's copy too (`keep`, `messages` in the send frame), so each
    prompt is the pane's history, and the server ends with exactly the pane's turns."""
    app = make_app(RemoteBackend(server.ws_url), store)
    served = server.state.conversations

    def server_turns(pane):
        return [(m["role"], m["content"]) for m in served.get(pane.conversation.id).turns()]

    def pane_turns(pane):
        return [(m.role, m.content) for m in pane.history]

    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the connection")
        pane = app.main.panes[0]
        replies = lambda n: lambda: not pane.busy and sum(m.role == "assistant" for m in pane.history) == n  # noqa: E731

        async def answered(*keys):  # press the keys, then wait for the reply they start to end
            before = pane.last_finish
            await pilot.press(*keys)
            await wait_for(pilot, lambda: pane.last_finish is not before and not pane.busy, timeout=90,
                           what=f"the reply after {keys}")
            await wait_for(pilot, lambda: server_turns(pane) == pane_turns(pane), timeout=10,
                           what=f"the server copy {server_turns(pane)} vs {pane_turns(pane)}")
        await type_and_send(pilot, pane, "Name a color")
        await wait_for(pilot, replies(1), timeout=90, what="reply 1")
        await type_and_send(pilot, pane, "Name a fruit")
        await wait_for(pilot, replies(2), timeout=90, what="reply 2")
        await answered("ctrl+r")  # regenerate: the server drops its reply 2 first
        assert len(server_turns(pane)) == 4
        await pilot.press("ctrl+up", "ctrl+up", "ctrl+g")  # edit prompt 2
        await pilot.pause()
        pane.query_one(PromptInput).clear()
        await answered(*"Name a tree", "enter")
        assert server_turns(pane)[2] == ("user", "Name a tree") and len(server_turns(pane)) == 4
        for _ in range(4):
            await pilot.press("ctrl+up")  # select reply 1 (from the end: 3, 2, 1, 0 -> back to 1)
        await pilot.press("ctrl+down", "f8")
        await pilot.pause()
        assert [r for r, _ in pane_turns(pane)] == ["user", "user", "assistant"]
        await pilot.press("f8")  # and the last reply: the pane ends on two prompts
        await pilot.pause()
        await answered("ctrl+r")  # answers the last prompt; the server gets the pane's turns (`messages`)
        assert [c for _, c in server_turns(pane)][:2] == ["Name a color", "Name a tree"]
