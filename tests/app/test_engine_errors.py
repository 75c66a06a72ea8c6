"""One classification of engine refusals (app/engine_errors.py), seen through all three
protocols: the OpenAI HTTP API, the websocket protocol and the embedded-engine client.

A stand-in engine refuses every submission with a chosen exception, so each protocol's
whole path from request to error runs without a model. Only panechat's own refusals are
4xx; any other exception (a plain ValueError too) is a bug: a 500, logged once."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from panechat.app.clients.base import Finished, GenParams
from panechat.app.clients.local import LocalBackend
from panechat.app.engine_errors import (BAD_INPUT, CLIENT_QUEUE_FULL, ENGINE_STOPPED, PROMPT_TOO_LONG, QUEUE_FULL,
                                        SHUTTING_DOWN, Refusal, ShuttingDown, classify, retry_after)
from panechat.app.server import create_app
from panechat.app.server.request_fields import FieldError
from panechat.engine.serving.engine import ClientQueueFull, EngineStopped, InvalidRequest, PromptTooLong, QueueFull


class RefusingEngine:
    """Just enough of `Engine` for a request to reach `submit`, which raises `error`."""

    ctx = 512
    batching = True
    cfg = SimpleNamespace(max_concurrent=1)
    chat_stops = ()

    def __init__(self, error: Exception):
        self.error = error
        self.lm = SimpleNamespace(name="fake.gguf", prompt_ids=lambda messages: [1, 2, 3],
                                  template=SimpleNamespace(kind="gguf", source="", is_fallback=False),
                                  model=SimpleNamespace(backend=SimpleNamespace(describe=lambda: "fake")))

    def prompt_ids(self, messages, tools=None):
        return [1, 2, 3]

    def submit(self, *args, **kwargs):
        raise self.error


REFUSALS = [
    (InvalidRequest("message 0 content is not valid Unicode (lone surrogate)"), BAD_INPUT),
    (PromptTooLong("prompt is 900 tokens but the context holds 512; shorten the conversation"), PROMPT_TOO_LONG),
    (QueueFull("the queue is full (--max-queue 8); retry shortly"), QUEUE_FULL),
    (EngineStopped("the engine is stopped"), ENGINE_STOPPED),
    (ShuttingDown("the server is shutting down; retry shortly", 2.2), SHUTTING_DOWN),
    (ClientQueueFull("client 'bob' already has 3 requests waiting (max-queue-per-client 3); wait for a reply "
                     "before sending more, or raise --max-queue-per-client", "bob", 3), CLIENT_QUEUE_FULL),
]


def _estimated(seconds: int) -> QueueFull:
    e = QueueFull("server busy: 4 generating and 64 waiting (max-queue 64); retry shortly")
    e.retry_after = seconds  # as Engine.submit sets it
    return e
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("error,refusal", REFUSALS + [
    (FieldError("stop", "must be a string"), BAD_INPUT),  # the request schema's refusals are InvalidRequest...
    (RuntimeError("kernel failed"), None),  # ...and anything else a bug, not a refusal
    (KeyError("slot"), None),
    (ValueError("too many values to unpack (expected 2)"), None),  # a ValueError of our own code too
])
def test_classify(error, refusal):
    assert classify(error) is refusal


def test_the_table_is_the_documented_contract():
    """docs/protocol.md: status, OpenAI type and code, websocket code, Retry-After."""
    assert [(r.http_status, r.http_type, r.http_code, r.http_param, r.ws_code, r.retry_after)
            for _, r in REFUSALS] == [
        (400, "invalid_request_error", None, "messages", "bad_params", None),
        (400, "invalid_request_error", "context_length_exceeded", "messages", "prompt_too_long", None),
        (429, "rate_limit_error", "queue_full", None, "queue_full", 1),
        (503, "server_error", "engine_stopped", None, "unavailable", None),
        (503, "server_error", "shutting_down", None, "shutting_down", 1),
        (429, "rate_limit_error", "client_queue_full", None, "client_queue_full", 1),
    ]
    assert all(isinstance(r, Refusal) for _, r in REFUSALS)


@pytest.mark.parametrize("error,refusal", REFUSALS)
def test_http(error, refusal):
    with TestClient(create_app(RefusingEngine(error))) as client:
        r = client.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == refusal.http_status
    assert r.json()["error"] == {"message": str(error), "type": refusal.http_type, "param": refusal.http_param,
                                 "code": refusal.http_code}
    wait = retry_after(error, refusal)
    assert r.headers.get("retry-after") == (str(wait) if wait else None)


def test_the_estimate_travels_with_the_exception():
    """QueueFull carries the engine's Retry-After estimate; ShuttingDown the drain's end."""
    assert retry_after(_estimated(17), QUEUE_FULL) == 17
    assert retry_after(QueueFull("full"), QUEUE_FULL) == 1  # none made: the table's default
    assert retry_after(ShuttingDown("bye", 2.2), SHUTTING_DOWN) == 3
    with TestClient(create_app(RefusingEngine(_estimated(17)))) as client:
        r = client.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 429 and r.headers["retry-after"] == "17"
    assert _ws_send(_estimated(17))["retry_after"] == 17


def _ws_send(error: Exception) -> dict:
    """The frame a websocket `send` gets back when the engine refuses it."""
    with TestClient(create_app(RefusingEngine(error))) as client, client.websocket_connect("/ws") as ws:
        ws.send_json({"type": "hello", "protocol": 1})
        assert ws.receive_json()["type"] == "welcome"
        ws.send_json({"type": "open", "conversation": "c"})
        assert ws.receive_json()["type"] == "opened"
        ws.send_json({"type": "send", "request": "r", "conversation": "c", "content": "hi"})
        return ws.receive_json()


@pytest.mark.parametrize("error,refusal", REFUSALS)
def test_websocket(error, refusal):
    wait = retry_after(error, refusal)
    assert _ws_send(error) == {"type": "error", "code": refusal.ws_code, "message": str(error), "request": "r",
                               **({"retry_after": wait} if wait else {})}


def _local_finish(error: Exception) -> Finished:
    async def run():
        events = [ev async for ev in LocalBackend(RefusingEngine(error)).stream("c", USER, GenParams())]
        assert len(events) == 1
        return events[0]
    return asyncio.run(run())


@pytest.mark.parametrize("error,refusal", REFUSALS)
def test_local_client(error, refusal):
    fin = _local_finish(error)
    assert fin.reason == "error"
    words = "the engine queue is full; try again when a reply finishes" if refusal is QUEUE_FULL else str(error)
    assert fin.error == words


BUGS = [RuntimeError("kernel failed"), ValueError("too many values to unpack (expected 2)"), KeyError("slot")]


@pytest.mark.parametrize("bug", BUGS, ids=lambda e: type(e).__name__)
def test_a_bug_is_reported_as_internal_everywhere(bug, caplog):
    caplog.set_level(logging.INFO, logger="panechat.server")

    def errors_logged() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno >= logging.ERROR]

    # raise_server_exceptions stays on: the route answers the bug itself, nothing escapes it
    with TestClient(create_app(RefusingEngine(bug))) as client:
        r = client.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert r.json()["error"]["message"] == f"internal server error: {type(bug).__name__}"
    logged = errors_logged()
    assert len(logged) == 1 and logged[0].exc_info[1] is bug  # one record, with the traceback
    frame = _ws_send(bug)
    assert frame["code"] == "internal" and str(bug) not in frame["message"]
    assert len(errors_logged()) == 2
    with pytest.raises(type(bug), match="kernel failed|unpack|slot"):
        _local_finish(bug)


def test_a_refusal_logs_no_error(caplog):
    caplog.set_level(logging.INFO, logger="panechat.server")
    with TestClient(create_app(RefusingEngine(InvalidRequest("empty prompt")))) as client:
        assert client.post("/v1/chat/completions", json={"messages": USER}).status_code == 400
    assert _ws_send(InvalidRequest("empty prompt"))["code"] == "bad_params"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_model_refusals_are_classified():
    """Several models (engine/serving/model_set.py): an unknown model is a 404 naming the param,
    one that does not fit --models-memory a 503, a listed file panechat cannot use a 400."""
    from panechat.app.engine_errors import MODEL_DOES_NOT_FIT, MODEL_UNUSABLE, UNKNOWN_MODEL
    from panechat.engine.gguf.file import ModelFileError
    from panechat.engine.catalog.model_names import ModelDoesNotFit, UnknownModel

    assert classify(UnknownModel("unknown model 'x'")) is UNKNOWN_MODEL
    assert classify(ModelDoesNotFit("model 'x' needs 2 GiB")) is MODEL_DOES_NOT_FIT
    assert classify(ModelFileError("x.gguf: truncated")) is MODEL_UNUSABLE
    assert [(r.http_status, r.http_code, r.http_param, r.ws_code) for r in
            (UNKNOWN_MODEL, MODEL_DOES_NOT_FIT, MODEL_UNUSABLE)] == [
        (404, "model_not_found", "model", "unknown_model"), (503, "models_memory", "model", "models_memory"),
        (400, "model_not_loadable", "model", "model_not_loadable")]


def test_an_http_error_on_the_way_passes_as_it_is(caplog):
    """An APIError raised beside the engine (503 while a model loads) is no bug to log."""
    from panechat.app.server import errors

    loading = errors.loading()
    assert errors.from_engine(loading, logging.getLogger("panechat.server"), "loading a model") is loading
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
