"""Ollama's API (`/api/*`) on the shared live server, through the official `ollama` Python
client and raw HTTP: the listings, chat and generate (streamed and not) answering what the
OpenAI routes answer for the same request, `options` honoured, Ollama-shaped errors, the
token, the refusals, and the routes oterm and litellm's `ollama/` provider call."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

MSG = [{"role": "user", "content": "Tell me a story about a dragon."}]  # longer than any num_predict here
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture
def name(live) -> str:
    return live.model.removesuffix(".gguf")  # the name `panechat models` lists


@pytest.fixture
def client(live):
    with ollama.Client(host=live.url, timeout=120) as c:
        yield c


def openai_chat(http, messages, **fields) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": messages, **fields})
    assert r.status_code == 200, r.text
    return r.json()


# -- listings ------------------------------------------------------------------------------------
def test_version_and_root(http):
    v = http.get("/api/version")
    assert v.status_code == 200 and v.json()["version"].count(".") == 2
    assert http.get("/").status_code == 200 and http.head("/").status_code == 200  # Ollama's heartbeat


def test_list_names_the_served_model(client, name, http):
    models = client.list().models
    assert models[0].model == name
    d = models[0].details
    assert d.format == "gguf" and d.family == "llama" and d.quantization_level == "Q4_1"
    assert d.parameter_size.endswith("M") and models[0].size > 50_000_000 and len(models[0].digest) == 64
    assert http.get("/api/tags").json()["models"][0]["name"] == name  # oterm's first call


def test_show_gives_the_template_it_renders_with(client, name, live):
    shown = client.show(name)
    assert shown.template == live.engine.lm.template.source and "<|im_start|>" in shown.template
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == live.engine.lm.model.args.context_length  # the file's
    assert "completion" in shown.capabilities and shown.details.family == "llama"
    assert client.show(name + ":latest").template == shown.template  # Ollama's tag is tolerated


def test_ps_shows_the_running_context(client, name, live):
    running = client.ps().models
    assert [m.model for m in running] == [name]
    assert running[0].context_length == live.engine.ctx == 1024 and running[0].size > 0
    assert running[0].size_vram == 0  # the numpy backend


# -- chat and generate ------------------------------------------------------------------------------
def test_chat_answers_what_the_openai_route_answers(client, name, http, live):
    want = openai_chat(http, MSG, max_tokens=8, temperature=0)
    r = client.chat(model=name, messages=MSG, options=GREEDY)
    assert r.message.role == "assistant" and r.message.content == want["choices"][0]["message"]["content"]
    assert r.done and r.done_reason == want["choices"][0]["finish_reason"] == "length" and r.model == name
    assert r.eval_count == want["usage"]["completion_tokens"] == 8
    assert r.prompt_eval_count == want["usage"]["prompt_tokens"]
    assert r.total_duration >= r.eval_duration > 0 and r.prompt_eval_duration >= 0 and r.load_duration >= 0
    assert r.created_at.endswith("Z")
    live.wait_idle()


def test_chat_stream_matches_the_whole_reply(client, name, live):
    whole = client.chat(model=name, messages=MSG, options=GREEDY)
    chunks = list(client.chat(model=name, messages=MSG, options=GREEDY, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done and len(chunks) > 2
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert chunks[-1].eval_count == whole.eval_count == 8 and chunks[-1].done_reason == "length"
    live.wait_idle()


def test_generate_is_a_one_turn_chat_and_raw_a_completion(client, name, http, live):
    prompt = MSG[0]["content"]
    chat_text = openai_chat(http, MSG, max_tokens=8, temperature=0)["choices"][0]["message"]["content"]
    r = client.generate(model=name, prompt=prompt, options=GREEDY)
    assert r.response == chat_text and r.done and r.eval_count == 8
    parts = list(client.generate(model=name, prompt=prompt, options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == chat_text and parts[-1].done
    raw_prompt = "1, 2, 3, 4, 5,"
    want = http.post("/v1/completions", json={"prompt": raw_prompt, "max_tokens": 8, "temperature": 0}).json()
    raw = client.generate(model=name, prompt=raw_prompt, raw=True, options=GREEDY)
    assert raw.response == want["choices"][0]["text"] and raw.prompt_eval_count == want["usage"]["prompt_tokens"]
    system = client.generate(model=name, prompt=prompt, system="Answer in French.", options=GREEDY)
    sys_want = openai_chat(http, [{"role": "system", "content": "Answer in French."}, *MSG], max_tokens=8,
                           temperature=0)
    assert system.response == sys_want["choices"][0]["message"]["content"]
    live.wait_idle()


def test_a_load_request_loads_and_says_so(http, name):
    for route, body in (("/api/generate", {"model": name}), ("/api/chat", {"model": name, "messages": []})):
        r = http.post(route, json=body)
        assert r.status_code == 200 and r.json()["done_reason"] == "load" and r.json()["done"] is True


def test_options_are_honoured(client, name, http, live):
    sampled = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 7, "num_predict": 12}
    a = client.chat(model=name, messages=MSG, options=sampled).message.content
    assert client.chat(model=name, messages=MSG, options=sampled).message.content == a
    want = openai_chat(http, MSG, temperature=0.9, top_p=0.95, top_k=40, seed=7, max_tokens=12)
    assert a == want["choices"][0]["message"]["content"]  # mapped field for field
    short = client.chat(model=name, messages=MSG, options={"temperature": 0, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"
    greedy = client.chat(model=name, messages=MSG, options={"temperature": 0, "num_predict": 12}).message.content
    cut_at = greedy.split()[1]
    stopped = client.chat(model=name, messages=MSG, options={"temperature": 0, "num_predict": 12, "stop": [cut_at]})
    assert stopped.message.content == greedy.split(cut_at)[0] and stopped.done_reason == "stop"
    random = client.chat(model=name, messages=MSG, options={"seed": -1, "num_predict": 3})  # -1: a random seed
    assert random.eval_count <= 3
    live.wait_idle()


def test_num_ctx_caps_prompt_and_reply(client, name, live):
    prompt_n = client.chat(model=name, messages=MSG, options={"num_predict": 1}).prompt_eval_count
    capped = client.chat(model=name, messages=MSG, options={"temperature": 0, "num_ctx": prompt_n + 2})
    assert capped.eval_count == 2 and capped.done_reason == "length"
    big = client.chat(model=name, messages=MSG, options={"temperature": 0, "num_predict": 2, "num_ctx": 32768})
    assert big.eval_count == 2  # above the server's context: the server's context is the cap
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=MSG, options={"num_ctx": prompt_n})
    assert e.value.status_code == 400 and "options.num_ctx" in e.value.error
    live.wait_idle()


def test_penalty_options_are_honoured_or_refused_by_name(http, name, live):
    """repeat_penalty and friends map to the request schema's fields of the same names:
    honoured where the schema has them, else a 400 naming the option (never ignored)."""
    for key, value in (("repeat_penalty", 1.3), ("repeat_last_n", 32), ("presence_penalty", 0.5),
                       ("frequency_penalty", 0.5)):
        r = http.post("/api/chat", json={"model": name, "messages": MSG, "stream": False,
                                         "options": {"num_predict": 2, key: value}})
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert f"options.{key}" in r.json()["error"]
    live.wait_idle()


# -- errors ------------------------------------------------------------------------------------------
def test_unknown_model_is_ollamas_404(client, name):
    for call in (lambda: client.chat(model="nope", messages=MSG), lambda: client.show("nope"),
                 lambda: client.generate(model="nope:7b", prompt="hi")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and e.value.error.startswith("model 'nope")
        assert "not found" in e.value.error and name in e.value.error


@pytest.mark.parametrize("body,named", [
    ({"options": {"temperature": -1}}, "'options.temperature'"),
    ({"options": {"num_predict": 0}}, "'options.num_predict'"),
    ({"options": {"top_p": "high"}}, "'options.top_p'"),
    ({"options": {"mirostat": 2}}, "options.mirostat"),
    ({"options": "hot"}, "'options'"),
    ({"think": True}, "'think'"),
    ({"format": "xml"}, "'format'"),
    ({"stream": "yes"}, "'stream'"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
])
def test_bad_fields_are_400s_naming_them(http, name, body, named):
    r = http.post("/api/chat", json={"model": name, "messages": MSG, "stream": False, **body})
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and named in r.json()["error"]


def test_generate_refuses_what_it_cannot_do(http, name):
    for body, named in (({"suffix": "end"}, "'suffix'"), ({"context": [1, 2, 3]}, "'context'"),
                        ({"template": "{{ .Prompt }}"}, "'template'"), ({"raw": True, "system": "x"}, "'system'"),
                        ({"raw": True, "format": "json"}, "'format'")):
        r = http.post("/api/generate", json={"model": name, "prompt": "hi", "stream": False, **body})
        assert r.status_code == 400 and named in r.json()["error"], r.text


def test_the_token_is_required(live_token, name):
    with ollama.Client(host=live_token.url, timeout=60) as anon:
        with pytest.raises(ollama.ResponseError) as e:
            anon.list()
        assert e.value.status_code == 401 and "Bearer" in e.value.error  # Ollama's shape: a string
    with ollama.Client(host=live_token.url, timeout=60, headers={"Authorization": "Bearer sekrit"}) as c:
        assert c.list().models[0].model == name
        assert c.chat(model=name, messages=MSG, options={"num_predict": 2}).eval_count == 2
    assert httpx.get(live_token.url + "/api/version").status_code == 200  # says nothing: no token


def test_embeddings_and_model_management_are_refused_clearly(client, name):
    for call in (lambda: client.embed(model=name, input="hi"), lambda: client.embeddings(model=name, prompt="hi")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 501 and "embeddings are not supported" in e.value.error
    for call in (lambda: client.pull(name), lambda: client.delete(name), lambda: client.copy(name, "x"),
                 lambda: client.create("x", from_=name)):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 501 and "panechat models" in e.value.error


def test_a_missing_route_is_404_naming_it_whatever_the_body_type(http, live, name):
    """litellm's `ollama/` provider posts JSON with no Content-Type: a route that does not
    exist answers 404 naming it (not 415), and /api/generate takes such a body as Ollama does."""
    body = json.dumps({"model": name, "prompt": "1, 2, 3,", "raw": True, "stream": False,
                       "options": {"num_predict": 2}}).encode()
    for path in ("/api/nothing", "/v1/nothing"):
        for headers in ({}, {"content-type": "text/plain"}):
            r = http.post(path, content=body, headers=headers)
            assert r.status_code == 404 and f"POST {path}" in r.text, r.text
    assert "error" in http.post("/api/nothing", content=body).json()  # Ollama's shape under /api/
    r = http.post("/api/generate", content=body)  # no Content-Type at all
    assert r.status_code == 200 and r.json()["eval_count"] == 2, r.text
    r = http.post("/api/generate", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and set(r.json()) == {"error"}
    r = http.post("/api/generate", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "-H 'Content-Type: application/json'" in r.json()["error"]  # `curl -d`
    r = http.post("/api/generate", content=body, headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and set(r.json()) == {"error"}  # a foreign page, with or without a type
    r = http.post("/v1/completions", content=body)  # the OpenAI routes still want the JSON type
    assert r.status_code == 415
    live.wait_idle()


# -- structured output and tools (the request schema's response_format and tools) --------------------
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
         "additionalProperties": False}


def test_format_json_and_a_schema_constrain_the_reply(client, name, live):
    import jsonschema

    ask = [{"role": "user", "content": "What color is the sky? Answer in JSON."}]
    r = client.chat(model=name, messages=ask, format=COLOR, options={"temperature": 0, "num_predict": 40})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), COLOR)
    j = client.generate(model=name, prompt=ask[0]["content"], format="json",
                        options={"temperature": 0, "num_predict": 40})
    assert j.response.lstrip().startswith("{")
    if j.done_reason == "stop":
        assert isinstance(json.loads(j.response), dict)
    live.wait_idle()


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
      a: The first number
      b: The second number

    Returns:
      int: The sum
    """
    return a + b


def test_tools_round_trip(client, name, live):
    ask = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    r = client.chat(model=name, messages=ask, tools=[add], options={"temperature": 0, "num_predict": 48})
    for call in r.message.tool_calls or []:
        assert call.function.name == "add" and isinstance(call.function.arguments, dict)
    history = [*ask, {"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
               {"role": "tool", "content": "5", "tool_name": "add"}]
    again = client.chat(model=name, messages=history, tools=[add], options={"temperature": 0, "num_predict": 8})
    assert again.done
    streamed = list(client.chat(model=name, messages=history, tools=[add], stream=True,
                                options={"temperature": 0, "num_predict": 8}))
    assert streamed[-1].done
    live.wait_idle()
