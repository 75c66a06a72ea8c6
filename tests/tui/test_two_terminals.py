"""Two terminals on one `panechat serve` with the same HOME (one store file), both under
Pilot: neither takes the other's conversation. The second restores none of the first's
live panes; opening one with F4 follows it read-only; F7 takes it over."""

from __future__ import annotations

import pytest

from panechat.app.clients.remote_ws import RemoteBackend
from panechat.app.store import Store
from panechat.app.tui.screens.conversations import ConversationsScreen
from panechat.app.tui.widgets.transcript import AssistantMessage, UserMessage

from .conftest import make_app, type_and_send, wait_for

SIZE = (160, 45)


def _replied(pane) -> bool:
    return pane.last_finish is not None and not pane.busy


async def test_a_second_terminal_never_takes_a_live_terminals_conversation(server, store):
    app_a = make_app(RemoteBackend(server.ws_url), store)
    async with app_a.run_test(size=SIZE) as pa:
        await wait_for(pa, app_a.backend_ready.is_set, what="terminal A's connection")
        a = app_a.main.panes[0]
        await type_and_send(pa, a, "Name a fruit")
        await wait_for(pa, lambda: _replied(a), timeout=90, what="A's first reply")
        cid = a.conversation.id
        assert store.layout(server.ws_url) == [cid]

        store_b = Store(store.path)  # the same HOME: B's layout names A's conversation
        app_b = make_app(RemoteBackend(server.ws_url), store_b)
        try:
            async with app_b.run_test(size=SIZE) as pb:
                await wait_for(pb, app_b.backend_ready.is_set, what="terminal B's connection")
                await wait_for(pb, lambda: cid not in [p.conversation.id for p in app_b.main.panes], timeout=20,
                               what="B to give up A's live conversation at start")
                await pb.pause(0.2)
                (b_own,) = app_b.main.panes
                assert b_own.held_by is None and not b_own.history
                await type_and_send(pb, b_own, "Name a tree")  # B's own pane works alongside A's
                await wait_for(pb, lambda: _replied(b_own), timeout=90, what="B's reply in its own pane")
                assert b_own.last_finish.reason in ("stop", "length"), b_own.last_finish

                # F4 in B: A's conversation opens read-only, following A's replies
                await pb.press("f4")
                await wait_for(pb, lambda: isinstance(app_b.screen, ConversationsScreen), what="the F4 list")
                assert cid in [c.id for c in app_b.screen.conversations]
                app_b.screen.dismiss(cid)
                await wait_for(pb, lambda: len(app_b.main.panes) == 2, what="A's conversation in a pane of B")
                follower = app_b.main.panes[1]
                await wait_for(pb, lambda: follower.held_by is not None, timeout=20, what="the read-only mark")
                assert "read-only" in follower.border_title
                assert not follower.send("Name a river")  # refused here, nothing sent
                assert not follower.busy

                await type_and_send(pa, a, "Name a color")
                await wait_for(pa, lambda: len(a.history) == 4 and _replied(a), timeout=90, what="A's second reply")
                reply = a.history[-1].content
                await wait_for(pb, lambda: [m.content for m in follower.history][-2:] == ["Name a color", reply],
                               timeout=30, what="B following A's turn")
                shown = follower.query(UserMessage)
                assert shown.last().text == "Name a color"
                assert follower.query(AssistantMessage).last().source == reply

                # F7: B takes it over; A's pane turns read-only and follows B
                follower.focus_input()
                await pb.press("f7")
                await wait_for(pb, lambda: follower.held_by is None, timeout=20, what="B holding it")
                await wait_for(pa, lambda: a.held_by is not None, timeout=20, what="A told it was taken")
                assert not a.send("Name a bird")
                await type_and_send(pb, follower, "Name a planet")
                await wait_for(pb, lambda: len(follower.history) == 6 and _replied(follower), timeout=90,
                               what="B's reply in the conversation it took")
                assert follower.last_finish.reason in ("stop", "length"), follower.last_finish
                await wait_for(pa, lambda: a.history[-1].content == follower.history[-1].content, timeout=30,
                               what="A following B's turn")
        finally:
            store_b.close()
