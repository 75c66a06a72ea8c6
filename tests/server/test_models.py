"""Two models served at once by one real server on loopback (engine/serving/model_set.py): every
request names its model, each reply equals the same request run alone on that model,
unknown names are refused naming the served ones, and /v1/models, /health and /metrics
show each model."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from panechat.app.server import ServerThread, create_app
from panechat.engine.serving.sampling import SamplingParams

from .test_websocket import generation, hello, recv_type

SMOL = "SmolLM2-135M-Instruct.Q4_1"
TINY = "tiny-gemma3-Q8_0-True"  # tests/conftest.py two_models
PROMPT = "Name a fruit."


@pytest.fixture(scope="module")
def srv(two_models):
    s = ServerThread(create_app(two_models), "127.0.0.1", 0).start()
    yield s
    s.stop()


def _alone(two_models, model: str, n: int = 6):
    gen = two_models.get(model).submit([{"role": "user", "content": PROMPT}], params=SamplingParams(max_tokens=n))
    return gen.result()


async def test_two_http_clients_on_two_models_reply_as_alone(srv, two_models):
    alone = {m: _alone(two_models, m).text for m in (SMOL, TINY)}
    assert alone[SMOL] != alone[TINY]
    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
        async def ask(model):
            r = await c.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
                "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()
        got = await asyncio.gather(ask(SMOL), ask(TINY), ask(SMOL), ask(TINY))
        assert [g["choices"][0]["message"]["content"] for g in got] == [alone[SMOL], alone[TINY]] * 2
        assert [g["model"] for g in got] == [SMOL, TINY] * 2
        no_field = (await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0})).json()
        assert no_field["model"] == SMOL and no_field["choices"][0]["message"]["content"] == alone[SMOL]


async def test_two_websocket_terminals_on_two_models_reply_as_alone(srv, two_models):
    alone = {m: _alone(two_models, m).token_ids for m in (SMOL, TINY)}

    async def terminal(model):
        async with connect(srv.ws_url) as ws:
            w = await hello(ws)
            assert w["models"] == [SMOL, TINY]
            await ws.send(json.dumps({"type": "open", "model": model}))
            opened = await recv_type(ws, "opened")
            assert opened["model"] == model
            await ws.send(json.dumps({"type": "send", "request": "r1", "conversation": opened["conversation"],
                                      "content": PROMPT, "params": {"max_tokens": 6}}))
            frames, fin = await generation(ws, "r1")
            return [f["token_id"] for f in frames if f["type"] == "delta" and f["token_id"] >= 0]

    got = await asyncio.gather(terminal(SMOL), terminal(TINY))
    assert got == [alone[SMOL], alone[TINY]]


async def test_unknown_model_is_refused_naming_the_served_ones(srv):
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": [{"role": "user",
                                                                                     "content": "hi"}]})
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model"
        assert "gpt-4o" in err["message"] and SMOL in err["message"] and TINY in err["message"]
    async with connect(srv.ws_url) as ws:
        await hello(ws)
        await ws.send(json.dumps({"type": "open", "model": "gpt-4o"}))
        f = await recv_type(ws, "error")
        assert f["code"] == "unknown_model" and SMOL in f["message"] and TINY in f["message"]
        await ws.send(json.dumps({"type": "open"}))
        cid = (await recv_type(ws, "opened"))["conversation"]
        await ws.send(json.dumps({"type": "send", "request": "r", "conversation": cid, "content": "hi",
                                  "model": "gpt-4o"}))
        f = await recv_type(ws, "error")
        assert f["code"] == "unknown_model" and f["request"] == "r"


def test_models_health_and_metrics_show_each_model(srv):
    models = httpx.get(srv.url + "/v1/models").json()["data"]
    loaded = [m for m in models if m["meta"]["loaded"]]
    assert [m["id"] for m in loaded] == [SMOL, TINY] and loaded[0]["meta"]["default"]
    assert all(not m["meta"]["loaded"] and m["id"] not in (SMOL, TINY) for m in models[2:])
    assert httpx.get(f"{srv.url}/v1/models/{TINY}").json()["meta"]["loaded"]
    health = httpx.get(srv.url + "/health").json()
    assert list(health["models"]) == [SMOL, TINY] and health["model"] == SMOL + ".gguf"
    text = httpx.get(srv.url + "/metrics").text
    labelled = {s.labels.get("model") for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "panechat_kv_blocks_total"}
    assert labelled == {SMOL, TINY}


def test_a_listed_model_loads_on_its_first_request_within_the_memory_budget(tiny, monkeypatch):
    """`panechat serve` (a lazy ModelSet): a model `panechat models` lists loads on the
    first request naming it; over --models-memory the idle default is unloaded to make
    room (never the default), and while it is busy the request is refused with 503
    `models_memory`."""
    import os

    from panechat.engine.serving.config import EngineConfig
    from panechat.engine.serving.model_set import ModelSet

    default, first, second = tiny("llama", "Q8_0")[0], tiny("qwen2", "F32")[0], tiny("llama", "F32")[0]
    monkeypatch.setenv("PANECHAT_MODELS", os.pathsep.join(map(str, (default, first, second))))
    models = ModelSet(EngineConfig(max_concurrent=1, ctx_size=64, verify_invariance=False), backend="numpy")
    models.get(default.stem)
    size_default = models.used_bytes()
    models.get(first.stem)
    # the default and one of the two others (about the same size), not all three
    models.memory = models.used_bytes() + (models.used_bytes() - size_default) // 2
    srv = ServerThread(create_app(models), "127.0.0.1", 0).start()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    try:
        listed = {m["id"]: m["meta"]["loaded"] for m in httpx.get(srv.url + "/v1/models").json()["data"]}
        assert listed[first.stem] is True and listed[second.stem] is False
        models.handout_busy_s = 60.0  # `first` was just handed out: it counts as busy
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "model": second.stem}, timeout=120)
        err = r.json()["error"]
        assert r.status_code == 503 and err["code"] == "models_memory" and "--models-memory" in err["message"]
        models.handout_busy_s = 0.0
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "model": second.stem}, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == second.stem
        assert models.names() == [default.stem, second.stem]  # the idle `first` made room
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "model": str(first)}, timeout=120)
        assert r.status_code == 404, r.text  # a request names models, never paths
    finally:
        srv.stop()
        models.stop()
