"""--history-memory: websocket conversations held by the server stay within a byte budget.

The attack it answers (issue 11): sockets that each open a conversation carrying a large
history and leave. Here 40 sockets bring 20 KB each (800 KB) to a server with a 256 KiB
budget: the stored bytes stay under it, the least recently used idle conversations go
first, those a socket still has open last, /metrics says so, and a terminal gets a dropped
conversation back by reopening it with its own copy. A conversation larger than the whole
budget is refused with `history_too_large`.
"""

from __future__ import annotations

import re

import httpx
from websockets.asyncio.client import connect

from .conftest import guarded_server
from .test_websocket import ask, hello

BUDGET = 256 << 10
TURN = 5_000  # characters per message: 4 messages, about 20 KB a conversation


def _history(tag: str) -> list[dict]:
    return [{"role": role, "content": (tag + " ") * (TURN // (len(tag) + 1))}
            for role in ("user", "assistant", "user", "assistant")]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


async def _open_and_leave(url: str, cid: str, messages: list[dict] | None = None) -> dict:
    async with connect(url, max_size=None) as ws:
        await hello(ws)
        frame = {"type": "open", "conversation": cid}
        if messages is not None:
            frame["messages"] = messages
        return await ask(ws, frame)


def _ids(frame: dict) -> list[str]:
    return [c["conversation"] for c in frame["conversations"]]


async def test_many_opens_with_history_stay_within_the_budget(live):
    with guarded_server(live.engine, history_memory=BUDGET) as (srv, _log):
        async with connect(srv.ws_url, max_size=None) as keeper:
            await hello(keeper)  # holds one conversation open all along: dropped last
            opened = await ask(keeper, {"type": "open", "conversation": "kept", "messages": _history("kept")})
            assert opened["type"] == "opened" and len(opened["messages"]) == 4

            order = []  # least recently used first, as the server should see it
            for i in range(40):
                f = await _open_and_leave(srv.ws_url, f"a-{i}", _history(f"a{i}"))
                assert f["type"] == "opened" and f["created"], f
                order.append(f"a-{i}")
                if i == 35:  # a terminal comes back to an older one: used again, so kept longer
                    assert (await _open_and_leave(srv.ws_url, "a-28"))["created"] is False
                    order.remove("a-28")
                    order.append("a-28")

            with httpx.Client(base_url=srv.url, timeout=30) as c:
                text = c.get("/metrics").text
            stored, kept = _metric(text, "panechat_history_bytes"), _metric(text, "panechat_history_conversations")
            evicted = _metric(text, "panechat_history_evictions_total")
            assert _metric(text, "panechat_history_budget_bytes") == BUDGET
            assert 0 < stored <= BUDGET, stored
            assert 5 <= kept <= 13 and evicted == 41 - kept  # 41 opened, about 20 KB each
            assert stored == srv.state.conversations.nbytes  # what /metrics reports is what is held

            ids = set(_ids(await ask(keeper, {"type": "list"})))
            # the oldest of all stays, as a socket has it open; of the others, the most recently used
            assert ids == {"kept", *order[-(int(kept) - 1):]}
            assert "a-28" in ids and "a-29" not in ids  # reopening a-28 kept it past a-29

            # a dropped conversation comes back from the terminal's own copy
            back = await _open_and_leave(srv.ws_url, "a-1", _history("a1"))
            assert back["created"] is True and back["messages"] == _history("a1")
            # and sending to one that is gone says what to do
            f = await ask(keeper, {"type": "send", "conversation": "a-2", "request": "r", "content": "hi"})
            assert f["code"] == "unknown_conversation" and "open" in f["message"], f


async def test_a_conversation_larger_than_the_budget_is_refused(live):
    with guarded_server(live.engine, history_memory=BUDGET) as (srv, _log):
        async with connect(srv.ws_url, max_size=None) as ws:
            await hello(ws)
            huge = [{"role": "user", "content": "x" * 150_000}, {"role": "assistant", "content": "y" * 150_000}]
            f = await ask(ws, {"type": "open", "conversation": "huge", "messages": huge})
            assert f["type"] == "error" and f["code"] == "history_too_large", f
            assert "--history-memory" in f["message"]
            assert "huge" not in _ids(await ask(ws, {"type": "list"}))  # not half made

            f = await ask(ws, {"type": "open", "conversation": "c", "messages": huge[:1]})
            assert f["type"] == "opened"
            # a turn that would take it past the budget is refused before the engine sees it
            f = await ask(ws, {"type": "send", "conversation": "c", "request": "r1", "content": "z" * 150_000})
            assert f["type"] == "error" and f["code"] == "history_too_large" and f["request"] == "r1", f
            f = await ask(ws, {"type": "open", "conversation": "c"})
            assert len(f["messages"]) == 1  # unchanged
            f = await ask(ws, {"type": "open", "conversation": "c", "system": "s" * 150_000})
            assert f["code"] == "history_too_large", f
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert _metric(c.get("/metrics").text, "panechat_history_bytes") <= BUDGET


def test_the_flag_reaches_the_server(live):
    from panechat.app.cli import build_parser
    from panechat.app.server.limits import Limits

    args = build_parser().parse_args(["serve", "--history-memory", "64M"])
    assert Limits.from_args(args).history_memory == 64 << 20
    assert Limits().history_memory == 256 << 20
    with guarded_server(live.engine, history_memory=1 << 20) as (srv, _log):
        assert srv.state.conversations.max_bytes == 1 << 20
