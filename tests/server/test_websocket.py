"""The /ws protocol (docs/protocol.md) with a real `websockets` client."""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from panechat.engine.serving.stats import EngineStats, StreamState

HELLO = {"type": "hello", "protocol": 1, "client": "pytest/0"}


async def recv(ws, timeout: float = 60.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def recv_type(ws, kind: str, timeout: float = 60.0) -> dict:
    """The next frame of type `kind`, skipping stats frames."""
    while True:
        f = await recv(ws, timeout)
        if f["type"] == kind:
            return f
        assert f["type"] == "stats", f


async def ask(ws, frame: dict) -> dict:
    await ws.send(json.dumps(frame))
    return await recv(ws)


async def hello(ws, **extra) -> dict:
    w = await ask(ws, {**HELLO, **extra})
    assert w["type"] == "welcome", w
    return w


async def generation(ws, rid: str) -> tuple[list[dict], dict]:
    """All frames of request `rid` up to and including `finished`."""
    frames = []
    while True:
        f = await recv(ws)
        if f.get("request") != rid:
            continue
        frames.append(f)
        if f["type"] == "finished":
            return frames, f


async def test_handshake(live):
    async with connect(live.ws_url) as ws:
        f = await ask(ws, {"type": "open"})
        assert f["type"] == "error" and f["code"] == "hello_required"
        f = await ask(ws, {**HELLO, "protocol": 2})
        assert f["type"] == "error" and f["code"] == "protocol"
        w = await hello(ws)
        assert w["protocol"] == 1 and w["model"] == live.model.removesuffix(".gguf") and w["ctx"] == live.engine.ctx
        assert w["max_concurrent"] == 4 and w["batching"] is live.engine.batching and w["terminal"].startswith("t-")
        assert isinstance(w["backend"], str) and w["server"].startswith("panechat/")


async def test_token(live_token):
    async with connect(live_token.ws_url) as ws:
        f = await ask(ws, {**HELLO, "token": "wrong"})
        assert f["type"] == "error" and f["code"] == "unauthorized"
        with pytest.raises(ConnectionClosed) as e:
            await recv(ws)
        assert e.value.rcvd.code == 4401
    async with connect(live_token.ws_url) as ws:
        await hello(ws, token="sekrit")


async def test_open_send_resume(live):
    async with connect(live.ws_url) as ws:
        await hello(ws)
        opened = await ask(ws, {"type": "open", "system": "You are a helpful assistant."})
        assert opened["type"] == "opened" and opened["messages"] == [
            {"role": "system", "content": "You are a helpful assistant."}]
        cid = opened["conversation"]
        await ws.send(json.dumps({"type": "send", "conversation": cid, "request": "r-1",
                                  "content": "What is 2+2?", "params": {"max_tokens": 12}}))
        frames, fin = await generation(ws, "r-1")
        kinds = [f["type"] for f in frames]
        assert kinds[0] == "queued" and frames[0]["conversation"] == cid
        assert "prefill" in kinds and kinds.index("prefill") < kinds.index("delta")
        pre = [f for f in frames if f["type"] == "prefill"][-1]
        assert pre["done"] == pre["total"] == fin["usage"]["prompt_tokens"]
        deltas = [f for f in frames if f["type"] == "delta"]
        assert "".join(f["text"] for f in deltas) == fin["text"] and fin["text"]
        assert fin["reason"] in ("stop", "length") and fin["conversation"] == cid
        assert set(fin["usage"]) >= {"prompt_tokens", "completion_tokens", "reused_tokens"}
        assert set(fin["timings"]) >= {"queue_ms", "prompt_ms", "ttft_ms", "decode_tok_s", "total_ms"}
        first_prompt = fin["usage"]["prompt_tokens"]

    async with connect(live.ws_url) as ws2:  # another terminal resumes it
        await hello(ws2)
        opened = await ask(ws2, {"type": "open", "conversation": cid})
        assert [m["role"] for m in opened["messages"]] == ["system", "user", "assistant"]
        assert opened["messages"][2]["content"] == fin["text"]
        lst = await ask(ws2, {"type": "list"})
        assert any(c["conversation"] == cid for c in lst["conversations"])
        await ws2.send(json.dumps({"type": "send", "conversation": cid, "request": "r-1",
                                   "content": "And 3+3?", "params": {"max_tokens": 8}}))
        _, fin2 = await generation(ws2, "r-1")
        assert fin2["usage"]["reused_tokens"] >= first_prompt  # the slot kept the first turn
        opened = await ask(ws2, {"type": "open", "conversation": "my-own-id"})
        assert opened["conversation"] == "my-own-id" and opened["messages"] == []


async def test_open_with_history_restores_a_conversation_the_server_lost(live):
    """A terminal keeps its own copy; after a server restart it opens the conversation with
    that copy, and the next reply is the one the whole history gives (same as over HTTP)."""
    import httpx

    system = "You are a terse assistant."
    turns = [{"role": "user", "content": "My cat is called Miso."},
             {"role": "assistant", "content": "Miso is a lovely name for a cat."}]
    async with connect(live.ws_url) as ws:
        await hello(ws)
        opened = await ask(ws, {"type": "open", "conversation": "kept-by-client", "system": system,
                                "messages": turns})
        assert opened["created"] and opened["messages"] == [{"role": "system", "content": system}, *turns]
        await ws.send(json.dumps({"type": "send", "conversation": "kept-by-client", "request": "r",
                                  "content": "What is my cat called?", "params": {"max_tokens": 16}}))
        _, fin = await generation(ws, "r")
        # a conversation with turns keeps its own copy: a client's stale copy does not replace it
        again = await ask(ws, {"type": "open", "conversation": "kept-by-client",
                               "messages": [{"role": "user", "content": "something else"}]})
        assert [m["content"] for m in again["messages"][1:]] == [t["content"] for t in turns] + [
            "What is my cat called?", fin["text"]]
        bad = await ask(ws, {"type": "open", "conversation": "x", "messages": [{"role": "system", "content": "s"}]})
        assert bad["type"] == "error" and bad["code"] == "bad_frame" and "'system'" in bad["message"]
        bad = await ask(ws, {"type": "open", "conversation": "x", "messages": "hello"})
        assert bad["type"] == "error" and bad["code"] == "bad_frame"
    messages = [{"role": "system", "content": system}, *turns, {"role": "user", "content": "What is my cat called?"}]
    with httpx.Client(base_url=live.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    assert fin["text"] == r.json()["choices"][0]["message"]["content"]
    assert fin["usage"]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]


async def test_cancel_keeps_the_partial_reply(live):
    async with connect(live.ws_url) as ws:
        await hello(ws)
        cid = (await ask(ws, {"type": "open"}))["conversation"]
        await ws.send(json.dumps({"type": "send", "conversation": cid, "request": "long",
                                  "content": "Write a long essay about rivers.", "params": {"max_tokens": 500}}))
        while (await recv(ws))["type"] != "delta":
            pass
        await ws.send(json.dumps({"type": "cancel", "request": "long"}))
        _, fin = await generation(ws, "long")
        assert fin["reason"] == "cancelled" and fin["usage"]["completion_tokens"] < 500
        history = (await ask(ws, {"type": "open", "conversation": cid}))["messages"]
        assert [m["role"] for m in history] == ["user", "assistant"] and history[1]["content"] == fin["text"]
    live.wait_idle()


async def test_stats_subscription(live):
    async with connect(live.ws_url) as ws:
        await hello(ws)
        await ws.send(json.dumps({"type": "subscribe", "interval_ms": 100}))
        stats = [await recv_type(ws, "stats") for _ in range(3)]
        s = stats[-1]
        for key in ("batch_now", "batch_max", "rows_now", "step_hist", "tok_s", "queue_depth", "kv_in_use",
                    "kv_resident", "kv_total", "streams", "requests_total", "generated_tokens"):
            assert key in s, key
        assert s["terminals"] >= 1 and s["model"] == live.model.removesuffix(".gguf") and isinstance(s["backend"], str)
        # a generation shows up in the streams list while it runs
        cid = (await ask_skipping_stats(ws, {"type": "open"}))["conversation"]
        await ws.send(json.dumps({"type": "send", "conversation": cid, "request": "s-1",
                                  "content": "Tell me about clouds.", "params": {"max_tokens": 16}}))
        states = set()
        while True:
            f = await recv(ws)
            if f["type"] == "stats":
                mine = [x for x in EngineStats.from_dict(f).streams if x.conversation == cid]
                states |= {x.state for x in mine}
                assert all(x.prefill_total > 0 and 0 <= x.prefill_done <= x.prefill_total for x in mine), mine
            if f["type"] == "finished":
                break
        assert states and states <= {StreamState.QUEUED, StreamState.PREFILLING, StreamState.DECODING}
        await ws.send(json.dumps({"type": "unsubscribe"}))
        await asyncio.sleep(0.3)  # drain what was already on its way
        while True:
            try:
                await asyncio.wait_for(ws.recv(), 0.05)
            except asyncio.TimeoutError:
                break
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ws.recv(), 0.5)


async def ask_skipping_stats(ws, frame: dict) -> dict:
    await ws.send(json.dumps(frame))
    while True:
        f = await recv(ws)
        if f["type"] != "stats":
            return f


@pytest.mark.parametrize("raw,code", [
    ("not json", "bad_frame"),
    ("[1, 2]", "bad_frame"),
    ('"hello"', "bad_frame"),
    ('{"type": 5}', "bad_frame"),
    ('{"no": "type"}', "bad_frame"),
    ('{"type": "bogus"}', "unknown_type"),
    ('{"type": "send", "conversation": "c", "request": "r"}', "bad_frame"),
    ('{"type": "send", "content": "hi", "request": "r"}', "bad_frame"),
    ('{"type": "send", "conversation": "nope-never", "request": "r", "content": "hi"}', "unknown_conversation"),
    ('{"type": "open", "conversation": 12}', "bad_frame"),
    ('{"type": "subscribe", "interval_ms": "fast"}', "bad_frame"),
    ('{"type": "cancel"}', "bad_frame"),
    ('{"type": "hello", "protocol": "x.y"}', "bad_frame"),
    ('{"type": "send", "conversation": "c", "request": "r", "content": "hi", "params": {"top_p": 7}}',
     "bad_params"),  # the frame is validated before the conversation is looked up
])
async def test_bad_frames_then_a_good_request(live, raw, code):
    async with connect(live.ws_url) as ws:
        await hello(ws)
        await ws.send(raw)
        f = await recv(ws)
        assert f["type"] == "error" and f["code"] == code and f["message"], f
        await _good_request(ws)


async def _good_request(ws) -> None:
    cid = (await ask(ws, {"type": "open"}))["conversation"]
    await ws.send(json.dumps({"type": "send", "conversation": cid, "request": "ok",
                              "content": "Say yes.", "params": {"max_tokens": 3}}))
    _, fin = await generation(ws, "ok")
    assert fin["reason"] in ("stop", "length")


async def test_oversized_and_binary_frames(live):
    async with connect(live.ws_url, max_size=None) as ws:
        await hello(ws)
        await ws.send(json.dumps({"type": "open", "system": "x" * (1 << 20)}))
        f = await recv(ws)
        assert f["type"] == "error" and f["code"] == "too_large"
        await ws.send(b"\x00\x01binary")
        f = await recv(ws)
        assert f["type"] == "error" and f["code"] == "bad_frame"
        await _good_request(ws)


async def test_request_level_errors(live):
    async with connect(live.ws_url) as ws:
        await hello(ws)
        cid = (await ask(ws, {"type": "open"}))["conversation"]
        send = {"type": "send", "conversation": cid, "content": "Hi"}
        f = await ask(ws, {**send, "request": "p", "params": {"temperature": "hot"}})
        assert (f["type"], f["code"], f["request"]) == ("error", "bad_params", "p")
        assert f["message"] == "params.temperature must be a number"
        f = await ask(ws, {**send, "request": "p", "params": {"stop": ["x" * 300]}})  # same limits as HTTP
        assert f["code"] == "bad_params" and f["message"].startswith("params.stop takes at most 16 strings")
        f = await ask(ws, {**send, "request": "p", "params": {"max_tokens": 0}})
        assert f["code"] == "bad_params"
        f = await ask(ws, {**send, "request": "p", "params": [1]})
        assert f["code"] == "bad_params"
        f = await ask(ws, {**send, "request": "p", "params": {"temprature": 0.5}})  # a typo is no setting
        assert f["code"] == "bad_params" and f["message"].startswith("params.temprature is not a field")
        f = await ask(ws, {**send, "request": "big", "content": "word " * (live.engine.ctx + 10)})
        assert f["code"] == "prompt_too_long" and f["request"] == "big"
        # one generation per conversation; request ids unique while in flight
        await ws.send(json.dumps({**send, "request": "a", "params": {"max_tokens": 200}}))
        assert (await recv(ws))["type"] == "queued"
        cid2 = (await ask_for(ws, {"type": "open"}, "opened"))["conversation"]
        f = await ask_for(ws, {**send, "request": "b"}, "error")
        assert f["code"] == "conversation_busy" and f["request"] == "b"
        f = await ask_for(ws, {**send, "conversation": cid2, "request": "a"}, "error")
        assert f["code"] == "duplicate_request"
        await ws.send(json.dumps({"type": "cancel", "request": "a"}))
        _, fin = await generation(ws, "a")
        assert fin["reason"] in ("cancelled", "length", "stop")
        # the history has no dangling user message from the refused sends
        history = (await ask(ws, {"type": "open", "conversation": cid}))["messages"]
        assert [m["role"] for m in history][:1] == ["user"] and len(history) <= 2
        await _good_request(ws)
    live.wait_idle()


async def ask_for(ws, frame: dict, kind: str) -> dict:
    await ws.send(json.dumps(frame))
    while True:
        f = await recv(ws)
        if f["type"] == kind:
            return f


async def test_closing_the_socket_cancels_its_generations(live):
    live.wait_idle()
    before = live.engine.stats().requests_finished["cancelled"]
    async with connect(live.ws_url) as ws:
        await hello(ws)
        cid = (await ask(ws, {"type": "open"}))["conversation"]
        await ws.send(json.dumps({"type": "send", "conversation": cid, "request": "r",
                                  "content": "Write a long poem.", "params": {"max_tokens": 500}}))
        while (await recv(ws))["type"] != "delta":
            pass
    s = live.wait_idle(timeout=20)
    assert s.requests_finished["cancelled"] == before + 1
    async with connect(live.ws_url) as ws:  # the partial reply was kept
        await hello(ws)
        history = (await ask(ws, {"type": "open", "conversation": cid}))["messages"]
        assert [m["role"] for m in history] == ["user", "assistant"]


async def test_foreign_web_origins_are_refused(live):
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus) as e:
        async with connect(live.ws_url, origin="https://evil.example"):
            pass
    assert e.value.response.status_code == 403
    async with connect(live.ws_url, origin="http://localhost:5173") as ws:  # a local page may
        await hello(ws)


async def test_one_terminal_holds_a_conversation_the_others_follow_it(live):
    """The first socket to open a conversation holds it; another one that opens it follows
    it read-only (its sends are refused, it gets `follow` frames) until it takes it over
    (`take`) or the holder closes it (`close`, or the socket goes)."""
    async with connect(live.ws_url) as a, connect(live.ws_url) as b:
        ta, tb = (await hello(a))["terminal"], (await hello(b))["terminal"]
        assert (await ask(a, {"type": "open", "conversation": "held"}))["holder"] == ta
        opened = await ask(b, {"type": "open", "conversation": "held"})
        assert opened["holder"] == ta
        f = await ask(b, {"type": "send", "conversation": "held", "request": "r", "content": "Hi"})
        assert (f["type"], f["code"], f["request"]) == ("error", "conversation_held", "r") and ta in f["message"]
        await a.send(json.dumps({"type": "send", "conversation": "held", "request": "r-1", "content": "Say hi",
                                 "params": {"max_tokens": 8}}))
        _, fin = await generation(a, "r-1")
        followed = []
        while not followed or followed[-1]["event"] != "finished":
            followed.append(await recv_type(b, "follow"))
        assert followed[0] == {"type": "follow", "conversation": "held", "event": "user", "content": "Say hi",
                               "replaces": False}
        assert "".join(f.get("text", "") for f in followed[1:-1]) == fin["text"]
        assert followed[-1]["text"] == fin["text"] and followed[-1]["reason"] == fin["reason"]
        taken = await ask(b, {"type": "open", "conversation": "held", "take": True})
        assert taken["holder"] == tb and [m["content"] for m in taken["messages"]] == ["Say hi", fin["text"]]
        assert await recv_type(a, "holder") == {"type": "holder", "conversation": "held", "holder": tb}
        assert (await ask(a, {"type": "send", "conversation": "held", "request": "x", "content": "?"}))[
            "code"] == "conversation_held"
        await b.send(json.dumps({"type": "close", "conversation": "held"}))
        assert await recv_type(a, "holder") == {"type": "holder", "conversation": "held", "holder": ta}
        lst = await ask(a, {"type": "list"})
        assert next(c for c in lst["conversations"] if c["conversation"] == "held")["holder"] == ta


async def test_a_follower_opening_mid_reply_gets_the_text_so_far(live):
    async with connect(live.ws_url) as a, connect(live.ws_url) as b:
        await hello(a), await hello(b)
        await ask(a, {"type": "open", "conversation": "mid"})
        f = await ask(b, {"type": "open", "conversation": "mid", "take": "yes"})
        assert (f["type"], f["code"]) == ("error", "bad_frame")
        await a.send(json.dumps({"type": "send", "conversation": "mid", "request": "long",
                                 "content": "Write a long essay about rivers.", "params": {"max_tokens": 300}}))
        text = ""
        while len(text) < 10:
            f = await recv(a)
            text += f.get("text", "") if f["type"] == "delta" else ""
        opened = await ask_for(b, {"type": "open", "conversation": "mid"}, "opened")
        assert opened["replying"].startswith(text) and opened["messages"][-1]["role"] == "user"
        await a.send(json.dumps({"type": "cancel", "request": "long"}))
        _, fin = await generation(a, "long")
        follow = await recv_type(b, "follow")
        while follow["event"] != "finished":
            follow = await recv_type(b, "follow")
        assert follow["text"] == fin["text"] and fin["text"].startswith(opened["replying"])
    live.wait_idle()

async def test_send_keep_and_messages_rewrite_the_turns_before_it(live):
    """`keep` cuts the conversation to its first turns before the new one (an edit or a
    regenerate on the terminal), `messages` replaces them; a bad `keep` changes nothing."""
    async with connect(live.ws_url) as ws:
        await hello(ws)
        seed = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
        opened = await ask(ws, {"type": "open", "conversation": "c-keep", "messages": seed})
        assert len(opened["messages"]) == 4
        send = {"type": "send", "conversation": "c-keep", "params": {"max_tokens": 4}}
        for bad in (5, -1, "2", True):
            f = await ask(ws, {**send, "request": f"r-bad-{bad}", "content": "x", "keep": bad})
            assert f["type"] == "error" and f["code"] == "bad_frame" and "keep" in f["message"], f
        f = await ask(ws, {**send, "request": "r-both", "content": "x", "keep": 1, "messages": []})
        assert f["code"] == "bad_frame"
        await ws.send(json.dumps({**send, "request": "r-1", "content": "e", "keep": 2}))
        frames, fin = await generation(ws, "r-1")
        assert frames[0]["type"] == "queued" and fin["reason"] in ("stop", "length")
        opened = await ask(ws, {"type": "open", "conversation": "c-keep"})
        assert [m["content"] for m in opened["messages"]] == ["a", "b", "e", fin["text"]]
        await ws.send(json.dumps({**send, "request": "r-2", "keep": 3}))  # regenerate: answers "e" again
        _, fin = await generation(ws, "r-2")
        opened = await ask(ws, {"type": "open", "conversation": "c-keep"})
        assert [m["content"] for m in opened["messages"]] == ["a", "b", "e", fin["text"]]
        await ws.send(json.dumps({**send, "request": "r-3", "content": "f",
                                  "messages": [{"role": "user", "content": "a"}]}))
        _, fin = await generation(ws, "r-3")  # two user turns in a row, as the terminal has them
        opened = await ask(ws, {"type": "open", "conversation": "c-keep"})
        assert [m["content"] for m in opened["messages"]] == ["a", "f", fin["text"]]
