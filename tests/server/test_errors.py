"""Every error code in OpenAI's shape, over raw HTTP; the server stays healthy."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from websockets.asyncio.client import connect

from panechat.app.server import ServerThread, create_app
from panechat.engine.serving.engine import Engine, EngineConfig

from .conftest import guarded_server, wait_idle

OK = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
JSON = {"content-type": "application/json"}  # raw bodies say what they are (else 415)


def _is_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize("raw", [b"{", b"not json", b"", b"\xff\xfe\x00", b'{"a": NaN}', b"[" * 100000])
def test_400_bad_json(http, raw):
    err = _is_error(http.post("/v1/chat/completions", content=raw,
                              headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ([], None),
    ("hello", None),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({**OK, "temperature": "hot"}, "temperature"),
    ({**OK, "temperature": -0.5}, "temperature"),
    ({**OK, "top_p": 0}, "top_p"),
    ({**OK, "top_p": 1.5}, "top_p"),
    ({**OK, "max_tokens": 0}, "max_tokens"),
    ({**OK, "max_tokens": 2.5}, "max_tokens"),
    ({**OK, "max_tokens": True}, "max_tokens"),
    ({**OK, "max_completion_tokens": -3}, "max_tokens"),
    ({**OK, "seed": "x"}, "seed"),
    ({**OK, "stop": 3}, "stop"),
    ({**OK, "stop": ["a", None]}, "stop"),
    ({**OK, "stop": ["s"] * 40}, "stop"),
    ({**OK, "stream": "yes"}, "stream"),
    ({**OK, "n": 17}, "n"),
    ({**OK, "presence_penalty": -2.5}, "presence_penalty"),
    ({**OK, "top_logprobs": 3}, "top_logprobs"),
    ({**OK, "logit_bias": {"x": 1}}, "logit_bias"),
    ({**OK, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({**OK, "model": 7}, "model"),
])
def test_400_bad_params(http, body, param):
    err = _is_error(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param


def test_400_infinite_number(http):
    raw = b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": 1e999}'
    err = _is_error(http.post("/v1/chat/completions", content=raw, headers=JSON), 400)
    assert err["param"] == "temperature"


def test_400_prompt_too_long(http, live):
    long = "word " * (live.engine.ctx + 50)
    err = _is_error(http.post("/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": long}], "max_tokens": 2}), 400)
    assert err["code"] == "context_length_exceeded"


def test_404_route_and_model(http):
    err = _is_error(http.get("/v2/whatever"), 404)
    assert err["type"] == "not_found_error"
    _is_error(http.post("/v1/completions/nope", json=OK), 404)
    err = _is_error(http.post("/v1/chat/completions", json={**OK, "model": "gpt-4o"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    _is_error(http.get("/v1/models/gpt-4o"), 404)
    _is_error(http.get("/v1/chat/completions"), 405)


def test_413_body_too_large(http):
    big = {"messages": [{"role": "user", "content": "x" * (1 << 20)}], "max_tokens": 2}
    err = _is_error(http.post("/v1/chat/completions", json=big), 413)
    assert err["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds while streaming the body in
        for _ in range(40):
            yield b" " * 65536
    _is_error(http.post("/v1/chat/completions", content=chunks(), headers=JSON), 413)
    assert http.post("/v1/chat/completions", json=OK).status_code == 200


@pytest.fixture
def busy_server(loaded_model, live):
    """max-concurrent 1, max-queue 0: a second request while one runs is refused."""
    live.wait_idle()  # the shared engine is idle while this one computes
    engine = Engine(loaded_model, EngineConfig(max_concurrent=1, kv_sessions=1, max_queue=0,
                                               ctx_size=512)).start()
    srv = ServerThread(create_app(engine), "127.0.0.1", 0).start()
    yield engine, srv
    srv.stop()
    engine.stop()


def test_429_with_retry_after_when_the_queue_is_full(busy_server):
    engine, srv = busy_server
    started = threading.Event()
    got: dict = {}

    def long_stream():
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400,
                    "stream": True}
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                got["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"content": "' in line:
                        started.set()
                    if got.get("stop"):
                        break  # leaving the block closes the connection

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert started.wait(60), "the long generation never started"
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json=OK)
            err = _is_error(r, 429)
            assert err["type"] == "rate_limit_error"
            assert int(r.headers["retry-after"]) >= 1
            assert c.get("/health").status_code == 200
    finally:
        got["stop"] = True
        t.join(60)
    assert got["status"] == 200
    s = wait_idle(engine)  # the abandoned stream was cancelled and its slot freed
    assert s.refused == 1 and s.requests_finished["cancelled"] == 1
    with httpx.Client(base_url=srv.url, timeout=60) as c:  # and the server takes work again
        assert c.post("/v1/chat/completions", json=OK).status_code == 200


def test_503_while_loading():
    app = create_app(None)
    with ServerThread(app, "127.0.0.1", 0) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        err = _is_error(c.post("/v1/chat/completions", json=OK), 503)
        assert err["code"] == "model_loading" and r.headers["retry-after"]
        m = c.get("/metrics")
        assert m.status_code == 200 and "panechat_ready 0.0" in m.text


BREAK = "please BREAK the tokenizer"


@pytest.fixture
def broken_tokenizer(live, monkeypatch):
    """A bug inside panechat's engine path: the tokenizer trips over a ValueError of its own
    (as an unpacking slip would) on any text holding BREAK, and works on the rest."""
    tok = live.engine.lm.tokenizer
    real = tok.encode

    def encode(text, *args, **kwargs):
        if BREAK in text:
            raise ValueError("not enough values to unpack (expected 2, got 1)")
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)


async def _ws_send(url: str, content: str) -> dict:
    async with connect(url) as ws:
        await ws.send(json.dumps({"type": "hello", "protocol": 1}))
        assert json.loads(await ws.recv())["type"] == "welcome"
        await ws.send(json.dumps({"type": "open", "conversation": "c-broken"}))
        assert json.loads(await ws.recv())["type"] == "opened"
        await ws.send(json.dumps({"type": "send", "conversation": "c-broken", "request": "r", "content": content,
                                  "params": {"max_tokens": 2}}))
        while True:
            f = json.loads(await ws.recv())
            if f["type"] in ("error", "finished"):
                return f


def test_a_bug_in_the_engine_path_is_a_500_logged_once(live, broken_tokenizer):
    """A ValueError that is no refusal is panechat's bug: 500 `internal_error` (websocket
    `internal`), one log record with its traceback, not the client's 400. The refusals
    around it stay what they are and log no error; the server serves on."""
    with guarded_server(live.engine) as (srv, log), httpx.Client(base_url=srv.url, timeout=120) as c:
        broken = {"messages": [{"role": "user", "content": BREAK}], "max_tokens": 2}
        err = _is_error(c.post("/v1/chat/completions", json=broken), 500)
        assert (err["type"], err["code"], err["message"]) == ("server_error", "internal_error",
                                                              "internal server error: ValueError")
        assert len(log.bad()) == 1 and "internal error" in log.bad()[0] and "unpack" in log.bad()[0]
        assert _is_error(c.post("/v1/completions", json={"prompt": BREAK, "max_tokens": 2}), 500)["code"] == \
            "internal_error"
        frame = asyncio.run(_ws_send(srv.ws_url, BREAK))
        assert (frame["type"], frame["code"]) == ("error", "internal") and "unpack" not in frame["message"]
        assert len(log.bad()) == 3
        # panechat's own refusals: the 4xx they always were, without an error line
        assert _is_error(c.post("/v1/chat/completions", json={**OK, "temperature": "hot"}), 400)["param"] == \
            "temperature"
        long = {"messages": [{"role": "user", "content": "word " * (live.engine.ctx + 50)}], "max_tokens": 2}
        assert _is_error(c.post("/v1/chat/completions", json=long), 400)["code"] == "context_length_exceeded"
        assert _is_error(c.post("/v1/chat/completions", json={**OK, "model": "gpt-4o"}), 404)["code"] == \
            "model_not_found"
        assert _is_error(c.post("/v1/completions", json={"prompt": "hi", "suffix": "!"}), 400)["param"] == "suffix"
        assert asyncio.run(_ws_send(srv.ws_url, "word " * (live.engine.ctx + 50)))["code"] == "prompt_too_long"
        assert len(log.bad()) == 3
        assert c.post("/v1/chat/completions", json=OK).status_code == 200
        assert asyncio.run(_ws_send(srv.ws_url, "Hi"))["type"] == "finished"
    live.wait_idle()


def test_server_still_healthy_after_errors(http, live):
    t0 = time.monotonic()
    assert http.get("/health").json()["status"] == "ok"
    assert http.post("/v1/chat/completions", json=OK).status_code == 200
    s = live.wait_idle()
    assert s.kv_in_use == 0 and time.monotonic() - t0 < 60
