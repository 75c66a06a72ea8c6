"""Every field of OpenAI's chat and completions requests, through the real `openai` SDK on the
live server: each is honoured with an effect one can see, refused with a 400 naming it, or
ignored metadata, as request_schema.FIELDS says. The field names come from the installed
SDK's own request types, so this test follows the SDK. Then logprobs, echo, n, best_of,
the penalties and logit_bias, each shown to do what it says."""

from __future__ import annotations

import asyncio
import json
import logging
import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from websockets.asyncio.client import connect

from panechat.app.server.request_schema import CHAT, COMPLETIONS, FIELDS, HONOURED, INPUTS, REFUSED

USER = [{"role": "user", "content": "Write the word cat ten times."}]
PROMPT = "The capital of France is"


def sdk_fields(module) -> set[str]:
    """Every key of the SDK's request TypedDicts (streaming and not) in `module`."""
    names: set[str] = set()
    for cls in (module.CompletionCreateParamsNonStreaming, module.CompletionCreateParamsStreaming):
        names |= set(typing.get_type_hints(cls))
    return names


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, live, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=live.model, messages=USER, **kw)


def _cmpl(client, live, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=live.model, prompt=PROMPT, **kw)


def _text(r) -> str:
    c = r.choices[0]
    return c.message.content if hasattr(c, "message") else c.text


def _greedy_first_token(client, live, call) -> int:
    r = call(client, live, max_tokens=1, logprobs=True, **({"top_logprobs": 1} if call is _chat else {}))
    tok = live.engine.lm.tokenizer
    lp = r.choices[0].logprobs
    text = lp.content[0].token if call is _chat else lp.tokens[0]
    return tok.encode(text, add_bos=False)[0] if len(tok.encode(text, add_bos=False)) == 1 else -1


# -- an observable effect of each honoured field (route, name) -> check ------------------------
def _effect_stream(client, live, call):
    kw = {"max_tokens": 6}
    whole = _text(call(client, live, **kw))
    parts = [(c.choices[0].delta.content if call is _chat else c.choices[0].text) or ""
             for c in call(client, live, stream=True, **kw) if c.choices]
    assert len(parts) > 2 and "".join(parts) == whole


def _effect_stream_options(client, live, call):
    chunks = list(call(client, live, stream=True, stream_options={"include_usage": True}, max_tokens=3))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def _effect_n(client, live, call):
    r = call(client, live, n=2, temperature=1.0, seed=4)
    assert [c.index for c in r.choices] == [0, 1]


def _effect_best_of(client, live, call):
    best = call(client, live, n=1, best_of=3, temperature=1.0, seed=9, logprobs=0)
    every = call(client, live, n=3, temperature=1.0, seed=9, logprobs=0)
    totals = [sum(c.logprobs.token_logprobs) for c in every.choices]
    assert best.choices[0].text == every.choices[totals.index(max(totals))].text


def _effect_logprobs(client, live, call):
    r = call(client, live, logprobs=True if call is _chat else 0)
    lp = r.choices[0].logprobs
    assert len(lp.content if call is _chat else lp.tokens) == r.usage.completion_tokens


def _effect_top_logprobs(client, live, call):
    r = call(client, live, logprobs=True, top_logprobs=3)
    assert all(len(t.top_logprobs) == 3 for t in r.choices[0].logprobs.content)


def _effect_echo(client, live, call):
    r = call(client, live, echo=True, max_tokens=2)
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)


def _effect_penalty(name):
    def check(client, live, call):
        assert _text(call(client, live, **{name: 2.0}, max_tokens=30)) != _text(call(client, live, max_tokens=30))
    return check


def _effect_logit_bias(client, live, call):
    first = _greedy_first_token(client, live, call)
    assert first >= 0
    r = call(client, live, max_tokens=1, logit_bias={str(first): -100}, logprobs=True)
    lp = r.choices[0].logprobs
    text = lp.content[0].token if call is _chat else lp.tokens[0]
    assert live.engine.lm.tokenizer.encode(text, add_bos=False) != [first]


def _effect_max_tokens(name):
    def check(client, live, call):
        r = call(client, live, **{name: 3}) if name == "max_tokens" else call(client, live, max_tokens=None,
                                                                            max_completion_tokens=3)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    return check


def _effect_seed(client, live, call):
    a, b, c = (_text(call(client, live, temperature=1.0, seed=s, max_tokens=16)) for s in (1, 1, 2))
    assert a == b and a != c


def _effect_temperature(client, live, call):
    hot = [_text(call(client, live, temperature=2.0, seed=s, max_tokens=16)) for s in (1, 2)]
    assert hot[0] != hot[1] and _text(call(client, live, max_tokens=16)) != hot[0]


def _effect_top_p(client, live, call):
    assert _text(call(client, live, temperature=2.0, seed=3, top_p=1e-6, max_tokens=12)) == \
        _text(call(client, live, max_tokens=12))


def _effect_stop(client, live, call):
    whole = _text(call(client, live))
    word = whole.split()[1]
    assert _text(call(client, live, stop=[word])) == whole[:whole.index(word)]


_TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"animal": {"type": "string", "enum": ["cat", "dog"]}}, "required": ["animal"]}}}
    for n in ("count_cats", "count_dogs")]


def _effect_response_format(client, live, call):
    schema = {"type": "object", "properties": {"word": {"enum": ["cat", "dog"]}}, "required": ["word"],
              "additionalProperties": False}
    r = call(client, live, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
             max_tokens=40)
    assert r.choices[0].finish_reason == "stop" and json.loads(_text(r))["word"] in ("cat", "dog")


def _calls(r) -> list[str]:
    return [c.function.name for c in r.choices[0].message.tool_calls or ()]


def _effect_tools(client, live, call):
    r = call(client, live, tools=_TOOLS, tool_choice="required", max_tokens=40)
    assert _calls(r) and set(_calls(r)) <= {"count_cats", "count_dogs"} and r.choices[0].finish_reason == "tool_calls"


def _effect_tool_choice(client, live, call):
    named = {"type": "function", "function": {"name": "count_dogs"}}
    r = call(client, live, tools=_TOOLS, tool_choice=named, max_tokens=40)
    assert _calls(r) == ["count_dogs"]
    assert _calls(call(client, live, tools=_TOOLS, tool_choice="none", max_tokens=12)) == []


def _effect_parallel_tool_calls(client, live, call):
    r = call(client, live, tools=_TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=40)
    assert len(_calls(r)) == 1


EFFECTS = {
    "response_format": _effect_response_format, "tools": _effect_tools, "tool_choice": _effect_tool_choice,
    "parallel_tool_calls": _effect_parallel_tool_calls,
    "stream": _effect_stream, "stream_options": _effect_stream_options, "n": _effect_n, "best_of": _effect_best_of,
    "logprobs": _effect_logprobs, "top_logprobs": _effect_top_logprobs, "echo": _effect_echo,
    "frequency_penalty": _effect_penalty("frequency_penalty"), "presence_penalty": _effect_penalty("presence_penalty"),
    "logit_bias": _effect_logit_bias, "max_tokens": _effect_max_tokens("max_tokens"),
    "max_completion_tokens": _effect_max_tokens("max_completion_tokens"), "seed": _effect_seed,
    "temperature": _effect_temperature, "top_p": _effect_top_p, "stop": _effect_stop,
}

#: For each refused field, a value that asks for something (the refusal must name the field).
ASKS = {
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": {"name": "f"},
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "moderation": {"policy": {"input": {"mode": "block"}}}, "reasoning_effort": "high", "verbosity": "low",
    "web_search_options": {"search_context_size": "low"}, "suffix": " and so on.",
}

#: For each ignored field, a value a client may send.
METADATA = {"user": "u-1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto", "safety_identifier": "s-1",
            "prediction": {"type": "content", "content": "cat"}, "prompt_cache_key": "k",
            "prompt_cache_options": {"ttl": "5m"}, "prompt_cache_retention": "24h"}

ROUTES = {CHAT: ("/v1/chat/completions", {"messages": USER}, _chat, chat_create_params),
          COMPLETIONS: ("/v1/completions", {"prompt": PROMPT}, _cmpl, completion_create_params)}


@pytest.mark.parametrize("protocol", [CHAT, COMPLETIONS])
def test_every_field_of_openais_request_is_honoured_or_refused_by_name(client, live, protocol):
    path, base, call, module = ROUTES[protocol]
    rows = {f.name: f for f in FIELDS if protocol in f.defaults}
    names = sorted(sdk_fields(module) - set(INPUTS[protocol]))
    assert len(names) >= 15, names
    with httpx.Client(base_url=live.url, timeout=120) as http:
        for name in names:
            row = rows.get(name)
            assert row is not None, f"{protocol}: OpenAI's field {name!r} has no row in request_schema.FIELDS"
            if row.status == HONOURED:
                assert name in EFFECTS, f"{protocol}: {name!r} is honoured: add a check of its effect here"
                EFFECTS[name](client, live, call)
            elif row.status == REFUSED:
                r = http.post(path, json={**base, "max_tokens": 2, name: ASKS[name]})
                assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
            else:
                r = http.post(path, json={**base, "max_tokens": 2, name: METADATA[name]})
                assert r.status_code == 200, (name, r.text)
    live.wait_idle()


def test_other_servers_fields_are_ignored_and_named_in_one_log_line(live, caplog):
    with caplog.at_level(logging.INFO, logger="panechat.server"), httpx.Client(base_url=live.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "cache_prompt": True,
                                                    "n_probs": 3})
    assert r.status_code == 200
    lines = [m for m in caplog.messages if "cache_prompt" in m]
    assert len(lines) == 1 and "n_probs" in lines[0]


@pytest.mark.parametrize("body,param", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"logit_bias": {"12": 100.5}}, "logit_bias"), ({"logit_bias": {"12": -101}}, "logit_bias"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"n": 17}, "n"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
])
def test_out_of_range_values_are_400s(live, body, param):
    with httpx.Client(base_url=live.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_logprobs_stream_as_they_come_and_match_the_whole_reply(client, live):
    whole = _chat(client, live, logprobs=True, top_logprobs=2, max_tokens=10)
    streamed = [t for c in _chat(client, live, logprobs=True, top_logprobs=2, max_tokens=10, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole.choices[0].logprobs.content]
    first = whole.choices[0].logprobs.content[0]
    assert first.top_logprobs[0].logprob == first.logprob  # greedy: the best token


def test_echo_gives_the_prompts_logprobs_as_a_loglikelihood_evaluation_asks(client, live):
    """lm-evaluation-harness's local-completions: echo, max_tokens 0, logprobs 1 -> the
    prompt's tokens with their logprobs (the first null); with token ids as the prompt too."""
    r = client.completions.create(model=live.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                  temperature=0)
    lp = r.choices[0].logprobs
    ids = live.engine.completion_ids(PROMPT)
    assert r.choices[0].text == PROMPT and len(lp.tokens) == len(ids) and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == live.engine.lm.tokenizer.decode(ids) and lp.text_offset[0] == 0
    by_ids = client.completions.create(model=live.model, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert by_ids.choices[0].logprobs.token_logprobs == lp.token_logprobs
    # the last prompt token's logprob is the one a generation of it gets
    head = client.completions.create(model=live.model, prompt=ids[:-1], max_tokens=1, logprobs=0, temperature=0,
                                     logit_bias={str(t): 100 for t in ids[-1:]})
    assert abs(head.choices[0].logprobs.token_logprobs[0] - lp.token_logprobs[-1]) < 0.05 or \
        head.choices[0].logprobs.tokens[0] == lp.tokens[-1]


def test_n_2_shares_the_prefill_and_each_choice_is_its_seeds_reply(client, live):
    both = _chat(client, live, n=2, temperature=1.0, seed=21, max_tokens=12)
    singles = [_chat(client, live, temperature=1.0, seed=s, max_tokens=12) for s in (21, 22)]
    one = [_text(r) for r in singles]
    assert [c.message.content for c in both.choices] == one and one[0] != one[1]
    assert both.usage.completion_tokens == sum(r.usage.completion_tokens for r in singles)
    assert both.usage.prompt_tokens == singles[0].usage.prompt_tokens  # one prompt
    streamed = {0: "", 1: ""}
    for c in _chat(client, live, n=2, temperature=1.0, seed=21, max_tokens=12, stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[0], streamed[1]] == one
    live.wait_idle()


def test_a_high_frequency_penalty_repeats_less_on_greedy(client, live):
    tok = live.engine.lm.tokenizer
    plain = tok.encode(_text(_chat(client, live, max_tokens=30)), add_bos=False)
    pen = tok.encode(_text(_chat(client, live, max_tokens=30, frequency_penalty=2.0)), add_bos=False)
    most = max(plain.count(t) for t in set(plain))
    assert most >= 3, "the plain greedy reply should repeat for this test to show"
    assert max(pen.count(t) for t in set(pen)) < most


def test_logit_bias_minus_100_on_the_greedy_first_token_changes_it(client, live):
    first = _chat(client, live, max_tokens=1, logprobs=True).choices[0].logprobs.content[0]
    ids = live.engine.lm.tokenizer.encode(first.token, add_bos=False)
    assert len(ids) == 1
    other = _chat(client, live, max_tokens=1, logprobs=True, logit_bias={str(ids[0]): -100})
    assert other.choices[0].logprobs.content[0].token != first.token


async def _ws_reply(ws, params: dict) -> dict:
    """The `finished` frame of one `send` in a fresh conversation with `params`, with the
    token ids of its deltas added as `ids`."""
    await ws.send(json.dumps({"type": "open"}))
    opened = json.loads(await asyncio.wait_for(ws.recv(), 60))
    cid = opened["conversation"]
    await ws.send(json.dumps({"type": "send", "conversation": cid, "request": "r", "content": USER[0]["content"],
                              "params": params}))
    ids = []
    while True:
        f = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if f.get("type") == "delta" and f["token_id"] >= 0:
            ids.append(f["token_id"])
        if f.get("type") in ("error", "finished"):
            return {**f, "ids": ids}


async def test_the_websocket_takes_the_penalties_and_logit_bias(live):
    async with connect(live.ws_url) as ws:
        await ws.send(json.dumps({"type": "hello", "protocol": 1, "client": "pytest/0"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 60))["type"] == "welcome"
        plain = await _ws_reply(ws, {"max_tokens": 30})
        pen = await _ws_reply(ws, {"max_tokens": 30, "frequency_penalty": 2.0})
        assert pen["type"] == "finished" and pen["text"] != plain["text"]
        rep = await _ws_reply(ws, {"max_tokens": 30, "repeat_penalty": 1.5, "repeat_last_n": -1})
        assert rep["type"] == "finished" and rep["text"] != plain["text"]
        first = plain["ids"][0]
        biased = await _ws_reply(ws, {"max_tokens": 3, "logit_bias": {str(first): -100}})
        assert biased["ids"] and biased["ids"][0] != first
        bad = await _ws_reply(ws, {"presence_penalty": 3})
        assert (bad["type"], bad["code"]) == ("error", "bad_params") and "presence_penalty" in bad["message"]
    live.wait_idle()


@pytest.mark.parametrize("seed", [None, 8], ids=["greedy", "seeded"])
def test_on_the_real_model_an_asking_row_is_the_same_alone_and_beside_3_others(live, seed):
    """Penalized, logit-biased rows with logprobs: tokens and logprobs bit for bit alone and
    batched beside 3 other rows (the served engine, 4 rows a step)."""
    from panechat.engine.serving.sampling import SamplingParams

    eng = live.engine
    prompts = [eng.prompt_ids([{"role": "user", "content": c}]) for c in
               ("Write the word cat ten times.", "Name three rivers.", "What is 2+2?", "Say hello.")]
    asks = SamplingParams(max_tokens=16, seed=seed, temperature=0.0 if seed is None else 0.9, frequency_penalty=1.2,
                          presence_penalty=0.4, repeat_penalty=1.3, logit_bias={198: -100.0, 28: 2.5}, logprobs=2)
    others = [SamplingParams(max_tokens=16), SamplingParams(max_tokens=16, temperature=1.0, seed=2),
              SamplingParams(max_tokens=16, presence_penalty=1.0)]
    alone = eng.submit(prompt_ids=prompts[0], params=asks).result()
    gens = [eng.submit(prompt_ids=p, params=o) for p, o in zip(prompts[1:], others)]
    beside = eng.submit(prompt_ids=prompts[0], params=asks)
    gens.insert(2, beside)
    fins = [g.result() for g in gens]
    assert all(f.reason in ("stop", "length") for f in fins)
    assert beside.finish.token_ids == alone.token_ids and beside.finish.logprobs == alone.logprobs
    assert 198 not in alone.token_ids
    live.wait_idle()
