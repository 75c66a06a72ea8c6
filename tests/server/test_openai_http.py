"""The OpenAI-compatible HTTP API through the `openai` SDK and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_health_and_models(http, live):
    h = http.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    models = http.get("/v1/models").json()
    name = live.model.removesuffix(".gguf")  # models go by the names `panechat models` lists
    assert models["object"] == "list" and models["data"][0]["id"] == name
    assert models["data"][0]["meta"]["loaded"] and models["data"][0]["meta"]["file"] == live.model
    assert len(models["data"]) == 1  # an Engine served as is loads no other model, so lists none
    assert http.get(f"/v1/models/{live.model}").json()["id"] == name  # the file name finds it too


def test_sdk_non_streaming(client, live):
    r = client.chat.completions.create(model=live.model, messages=MSG, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    timings = r.model_extra["timings"]  # llama.cpp-style extra field
    for key in ("prompt_ms", "prompt_n", "cache_n", "predicted_n", "predicted_ms", "predicted_per_second"):
        assert key in timings
    assert timings["predicted_n"] == r.usage.completion_tokens


def test_sdk_streaming_matches_non_streaming(client, live):
    whole = client.chat.completions.create(model=live.model, messages=MSG, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model=live.model, messages=MSG, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_raw_sse_ends_with_done(http):
    with http.stream("POST", "/v1/chat/completions",
                     json={"messages": MSG, "max_tokens": 6, "stream": True, "temperature": 0}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert "usage" in last and "timings" in last


def test_resent_history_reuses_the_cached_prefix(http, live):
    live.wait_idle()
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colors of the rainbow, please."}]
    r1 = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 10, "temperature": 0}).json()
    msgs += [r1["choices"][0]["message"], {"role": "user", "content": "And two more?"}]
    r2 = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 10, "temperature": 0}).json()
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= r1["usage"]["prompt_tokens"]  # the whole first turn came from the slot
    assert r2["timings"]["cache_n"] == cached


def test_stop_strings_and_params(http):
    base = {"messages": [{"role": "user", "content": "Count from 1 to 10 separated by commas."}],
            "max_tokens": 24, "temperature": 0}
    full = http.post("/v1/chat/completions", json=base).json()["choices"][0]["message"]["content"]
    assert "3" in full
    cut = http.post("/v1/chat/completions", json={**base, "stop": "3"}).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == full[: full.index("3")]
    cut2 = http.post("/v1/chat/completions", json={**base, "stop": ["zzz", "3"], "max_tokens": None,
                                                   "max_completion_tokens": 24}).json()
    assert cut2["choices"][0]["message"]["content"] == full[: full.index("3")]
    # seeded sampling is reproducible; content parts are accepted
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me a word."}]}],
            "max_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": 42}
    a = http.post("/v1/chat/completions", json=body).json()
    b = http.post("/v1/chat/completions", json=body).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_unversioned_aliases(http):
    assert http.get("/models").status_code == 200
    r = http.post("/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert r.status_code == 200


def test_sdk_raises_typed_errors(client, live):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=live.model, messages=MSG, max_tokens=2, temperature=-1)
    assert "temperature" in str(e.value)


def test_token_required(live_token):
    with httpx.Client(base_url=live_token.url, timeout=60) as c:
        body = {"messages": MSG, "max_tokens": 2}
        assert c.get("/health").status_code == 200  # health stays open
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sekrit"}):
            r = c.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["type"] == "authentication_error"
        assert c.get("/metrics").status_code == 401
        assert c.get("/v1/models").status_code == 401
        ok = c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
    sdk = openai.OpenAI(base_url=live_token.url + "/v1", api_key="sekrit", max_retries=0)
    assert sdk.chat.completions.create(model=live_token.model, messages=MSG, max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live_token.url + "/v1", api_key="bad", max_retries=0).models.list()
