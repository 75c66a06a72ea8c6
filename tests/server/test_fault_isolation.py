"""Black box: one request whose sampling goes wrong never costs its neighbours their reply.

Issue 11's repro: four greedy requests decoding, then `temperature: 1e-320`; all five used
to get HTTP 500 "Probabilities contain NaN". And a request that fails mid-generation gets
its protocol's per-request error (HTTP 500, an SSE error event, a ws `finished` with reason
`error`) while the others finish as if alone. These tests run their own server, so the
errors they cause do not count on the shared one (test_fuzz checks it saw none)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from websockets.asyncio.client import connect

from panechat.app.server import ServerThread, create_app
from panechat.engine.serving import engine as engine_mod
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.sampling import make_sampler
from panechat.engine.serving.stats import StreamState

from .conftest import Live
from .test_websocket import generation, hello

INNOCENT = ["Why is the sky blue?", "Write a haiku about the sea.", "Tell me a story about a dragon.",
            "What do plants need to grow?"]
HI = [{"role": "user", "content": "hi"}]
FAILING_SEED = 4242  # the injected sampler fails the request that asks for this seed


def _body(q: str) -> dict:
    return {"messages": [{"role": "user", "content": q}], "max_tokens": 32, "temperature": 0}


def _post(url: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=300) as c:
        return c.post("/v1/chat/completions", json=body)


def _reply(r: httpx.Response) -> tuple[str, str, int]:
    assert r.status_code == 200, r.text
    j = r.json()
    return j["choices"][0]["message"]["content"], j["choices"][0]["finish_reason"], j["usage"]["completion_tokens"]


@pytest.fixture(scope="module")
def live(loaded_model):
    """A server of its own, five generations at once (as in the issue: the fifth request
    joins four that are decoding)."""
    engine = Engine(loaded_model, EngineConfig(max_concurrent=5, kv_sessions=10, ctx_size=1024)).start()
    assert engine.batching, engine.invariance_problem
    srv = ServerThread(create_app(engine), "127.0.0.1", 0).start()
    yield Live(engine, srv)
    srv.stop()
    engine.stop()


@pytest.fixture(scope="module")
def solo(live):
    """Each innocent request's reply when it runs alone."""
    return [_reply(_post(live.url, _body(q))) for q in INNOCENT]


class Innocents:
    """The innocent requests, running in threads; `done_at` is when each one finished."""

    def __init__(self, live):
        self.live = live
        self.replies: list = [None] * len(INNOCENT)
        self.done_at = [0.0] * len(INNOCENT)
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(len(INNOCENT))]

    def _run(self, i: int) -> None:
        self.replies[i] = _post(self.live.url, _body(INNOCENT[i]))
        self.done_at[i] = time.monotonic()

    def start(self) -> "Innocents":
        """Start them and wait until all are decoding."""
        for t in self.threads:
            t.start()
        t0 = time.monotonic()
        while sum(s.state == StreamState.DECODING for s in self.live.engine.stats().streams) < len(INNOCENT):
            assert time.monotonic() - t0 < 60, self.live.engine.stats()
            time.sleep(0.005)
        return self

    def check(self, solo, bad_done_at: float) -> None:
        """Each got its solo reply, and the bad request ended while they still ran (so it
        shared their decode steps)."""
        for t in self.threads:
            t.join()
        assert [_reply(r) for r in self.replies] == solo
        assert bad_done_at < min(self.done_at)


def test_the_repro_tiny_temperature_is_greedy_and_the_batch_is_untouched(live, solo):
    want = _reply(_post(live.url, {"messages": HI, "max_tokens": 8, "temperature": 0}))
    innocents = Innocents(live).start()
    bad = _post(live.url, {"messages": HI, "max_tokens": 8, "temperature": 1e-320})
    bad_done_at = time.monotonic()
    assert _reply(bad) == want  # 200, and the greedy reply
    innocents.check(solo, bad_done_at)
    live.wait_idle()


@pytest.fixture
def failing_sampler(monkeypatch):
    """Requests with seed FAILING_SEED get a sampler that raises on its third token."""

    def make(params):
        real = make_sampler(params)
        if params.seed != FAILING_SEED:
            return real
        calls = [0]

        def sampler(logits):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected sampler failure")
            return real(logits)
        return sampler

    monkeypatch.setattr(engine_mod, "make_sampler", make)


FAILING = {"messages": HI, "max_tokens": 8, "temperature": 0.7, "seed": FAILING_SEED}


def test_a_row_failure_is_a_500_for_that_request_only(live, solo, failing_sampler):
    innocents = Innocents(live).start()
    r = _post(live.url, FAILING)
    bad_done_at = time.monotonic()
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "generation_error" and "injected sampler failure" in err["message"]
    innocents.check(solo, bad_done_at)
    live.wait_idle()


def test_a_row_failure_is_an_sse_error_event_for_that_request_only(live, solo, failing_sampler):
    innocents = Innocents(live).start()
    with httpx.Client(base_url=live.url, timeout=300) as c:
        with c.stream("POST", "/v1/chat/completions", json={**FAILING, "stream": True}) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln]
    bad_done_at = time.monotonic()
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert err["code"] == "generation_error" and "injected sampler failure" in err["message"]
    deltas = [json.loads(ln.removeprefix("data: ")) for ln in lines[1:-2]]
    assert 1 <= len(deltas) <= 2  # the text of its two tokens (a token may carry no text)
    innocents.check(solo, bad_done_at)
    live.wait_idle()


async def test_a_row_failure_is_a_ws_error_finish_for_that_request_only(live, solo, failing_sampler):
    innocents = Innocents(live).start()
    async with connect(live.ws_url) as ws:
        await hello(ws)
        await ws.send(json.dumps({"type": "open"}))
        conv = None
        while conv is None:
            f = json.loads(await ws.recv())
            conv = f.get("conversation") if f["type"] == "opened" else None
        await ws.send(json.dumps({"type": "send", "conversation": conv, "request": "bad", "content": "hi",
                                  "params": {"temperature": 0.7, "seed": FAILING_SEED, "max_tokens": 8}}))
        frames, fin = await generation(ws, "bad")
    bad_done_at = time.monotonic()
    assert fin["reason"] == "error" and "injected sampler failure" in fin["error"]
    assert sum(f["type"] == "delta" for f in frames) == 2 and fin["usage"]["completion_tokens"] == 2
    innocents.check(solo, bad_done_at)
    live.wait_idle()
