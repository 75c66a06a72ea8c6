"""`POST /v1/completions` (OpenAI legacy completions) on the live server with the default
model, through the `openai` SDK and raw HTTP; and a base model (gemma-3-270m, no chat
template) served: the ChatML fallback named in `/v1/models`, raw completions that follow
llama.cpp."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

PROMPT = "1, 2, 3, 4, 5,"


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def engine_greedy(engine, prompt: str, n: int) -> tuple[list[int], str]:
    """The engine's own greedy completion of the raw prompt: what the route must return."""
    from panechat.engine.serving.sampling import SamplingParams

    fin = engine.submit(prompt_ids=engine.completion_ids(prompt), params=SamplingParams(max_tokens=n)).result()
    return fin.token_ids, fin.text


def test_sdk_non_streaming_is_the_raw_prompts_greedy_completion(client, live):
    r = client.completions.create(model=live.model, prompt=PROMPT, max_tokens=8, temperature=0)
    ids, text = engine_greedy(live.engine, PROMPT, 8)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == text and text.startswith(" 6, 7")
    assert r.choices[0].finish_reason == "length"
    tok = live.engine.lm.tokenizer
    assert r.usage.prompt_tokens == len(tok.encode(PROMPT, add_bos=None, parse_special=True))  # no template
    assert r.usage.completion_tokens == len(ids) == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["timings"]["predicted_n"] == 8
    live.wait_idle()


def test_sdk_streaming_matches_non_streaming(client, live):
    whole = client.completions.create(model=live.model, prompt=[PROMPT], max_tokens=10, temperature=0)
    stream = client.completions.create(model=live.model, prompt=PROMPT, max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        assert chunk.object == "text_completion"
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason == "length"
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 10
    live.wait_idle()


def test_seeded_sampling_repeats_and_stop_cuts(http):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    a, b = (http.post("/v1/completions", json=body).json() for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    greedy = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
    cut = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                             "stop": [" 7"]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == greedy["choices"][0]["text"].split(" 7")[0]


def test_default_max_tokens_is_openais_16(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] <= 16
    if r["choices"][0]["finish_reason"] == "length":
        assert r["usage"]["completion_tokens"] == 16


def test_raw_sse_ends_with_done(http):
    with http.stream("POST", "/v1/completions",
                     json={"prompt": PROMPT, "max_tokens": 4, "stream": True, "temperature": 0}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and "delta" not in c["choices"][0] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("body,status,param", [
    ({}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ({"prompt": "hi", "seed": "x"}, 400, "seed"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": 17}, 400, "n"),
    ({"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ({"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ({"prompt": "hi", "best_of": 1, "n": 2}, 400, "best_of"),
    ({"prompt": "hi", "best_of": 3, "stream": True}, 400, "best_of"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "frequency_penalty": 5}, 400, "frequency_penalty"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"10000000": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
])
def test_bad_requests_get_openai_errors(http, live, body, status, param):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"]
    live.wait_idle()


def test_prompt_over_the_context_and_bad_json(http, live):
    r = http.post("/v1/completions", json={"prompt": "word " * 3000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"  # this route has no `messages`
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = http.post("/v1/completions", content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert live.wait_idle().kv_in_use == 0


def test_token_is_required_like_chat(live_token):
    with httpx.Client(base_url=live_token.url, timeout=60) as c:
        assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 401
        ok = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                    headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_the_default_models_template_is_its_own(http):
    assert http.get("/v1/models").json()["data"][0]["chat_template"] == "gguf"


# -- a base model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_server(gemma):
    from panechat.app.server import ServerThread, create_app
    from panechat.engine.serving.engine import Engine, EngineConfig

    engine = Engine(gemma, EngineConfig(max_concurrent=2, kv_sessions=2, ctx_size=256,
                                        verify_invariance=False)).start()
    srv = ServerThread(create_app(engine), "127.0.0.1", 0).start()
    yield srv, engine
    srv.stop()
    engine.stop()


def test_base_model_chats_with_the_named_chatml_fallback(base_server, gemma_golden):
    """gemma-3-270m has no chat template: /v1/models says "chatml-fallback", a chat
    request is rendered in ChatML and answered, and /v1/completions gives llama.cpp's
    greedy tokens for a raw prompt (BOS from the file's flags)."""
    srv, engine = base_server
    with httpx.Client(base_url=srv.url, timeout=300) as c:
        assert c.get("/v1/models").json()["data"][0]["chat_template"] == "chatml-fallback"
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello"}],
                                                    "max_tokens": 4, "temperature": 0})
        assert chat.status_code == 200, chat.text
        rendered = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
        want = len(engine.lm.tokenizer.encode(rendered, add_bos=None, parse_special=True))
        assert chat.json()["usage"]["prompt_tokens"] == want
        case = next(x for x in gemma_golden["completion"] if x["prompt"] == PROMPT)
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens"] == len(case["prompt_ids"])
    assert r["choices"][0]["text"] == engine.lm.tokenizer.decode(case["tokens"][:8])


def test_base_model_reply_ends_at_the_fallbacks_turn_marker(base_server):
    """gemma-3-270m writes ChatML's markers as plain text: the chat reply stops where the
    raw completion of the same ChatML prompt writes `<|im_end|>` (a stop string of the
    fallback), instead of running on through invented turns."""
    srv, _ = base_server
    question = "What is the capital of France?"
    rendered = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    with httpx.Client(base_url=srv.url, timeout=300) as c:
        raw = c.post("/v1/completions", json={"prompt": rendered, "max_tokens": 24, "temperature": 0}).json()
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": question}],
                                                    "max_tokens": 24, "temperature": 0}).json()
    text = raw["choices"][0]["text"]
    assert "<|im_end|>" in text  # what the model does: the test is about something
    assert chat["choices"][0]["message"]["content"] == text.split("<|im_end|>")[0]
    assert chat["choices"][0]["finish_reason"] == "stop"
