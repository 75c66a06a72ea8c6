"""Structured output and tool calling through the live loopback server, driven by the real
clients (the `openai` SDK, langchain-openai) on the real default model (SmolLM2, whose
template knows no tools: the generic JSON format, held to by the grammar)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}

@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", timeout=300, max_retries=0)

class Pet(BaseModel):
    name: str = Field(max_length=20)
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)

def test_the_openai_sdk_parses_a_pydantic_model(client, live):
    r = client.chat.completions.parse(model=live.model, response_format=Pet, max_tokens=60, temperature=0,
                                      messages=[{"role": "user", "content": "Describe a pet."}])
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop"
    free = client.chat.completions.create(model=live.model, max_tokens=30, temperature=0,
                                          messages=[{"role": "user", "content": "Describe a pet."}])
    with pytest.raises(ValueError):  # without the grammar the model writes prose: the constraint did it
        Pet.model_validate_json(free.choices[0].message.content)

def test_json_object_mode_gives_an_object(client, live):
    r = client.chat.completions.create(model=live.model, response_format={"type": "json_object"}, max_tokens=80,
                                       temperature=0, messages=[{"role": "user", "content": "Name three colours."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut at max_tokens: still the start of an object
        assert r.choices[0].message.content.startswith("{")

@pytest.mark.parametrize("fmt,param", [({"type": "bogus"}, "response_format"),
                                       ({"type": "json_schema"}, "response_format"),
                                       ("json", "response_format")])
def test_a_bad_response_format_is_a_400_naming_it(client, live, fmt, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": "hi"}],
                                       response_format=fmt, max_tokens=5)
    assert e.value.body["param"] == param

def test_a_gbnf_grammar_holds_the_reply(client, live):
    r = client.chat.completions.create(model=live.model, max_tokens=10, temperature=0,
                                       messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
    assert r.choices[0].message.content in ("yes.", "no.") and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"grammar": "root ::= ("}, max_tokens=5)
    assert e.value.body["param"] == "grammar"

def test_a_tool_round_trip(client, live):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=live.model, messages=messages, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    params = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
    jsonschema.validate(args, params)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    reply = client.chat.completions.create(model=live.model, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="none", max_tokens=40, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls

PROMPTS = ["What is the weather in Paris?", "Is it cold in Oslo?", "Weather for Tokyo please, in fahrenheit.",
           "hello", "Tell me a joke about weather in Rome."]

def test_a_named_tool_call_matches_its_parameters_every_time(client, live):
    def call(prompt):
        r = client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": prompt}],
                                           tools=[TIME, WEATHER], max_tokens=60, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        return r.choices[0]

    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(call, PROMPTS))
    for c in choices:
        assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == ["get_weather"]
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])

def test_tool_calls_stream_as_deltas(client, live):
    stream = client.chat.completions.create(model=live.model, stream=True, tools=[WEATHER], tool_choice="required",
                                            max_tokens=60, temperature=0,
                                            messages=[{"role": "user", "content": "Weather in Lima?"}])
    calls, finish, pieces = {}, None, 0
    for chunk in stream:
        ch = chunk.choices[0]
        for d in ch.delta.tool_calls or ():
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = c["id"] or d.id
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
            pieces += bool(d.function.arguments)
        finish = ch.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert pieces > 1  # the arguments stream as they are generated
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])

@pytest.mark.parametrize("prompt", ["Weather in Lima?", "Say hello to me."])
def test_an_auto_reply_streams_what_it_returns_whole(client, live, prompt):
    ask = dict(model=live.model, tools=[WEATHER], max_tokens=60, temperature=0,
               messages=[{"role": "user", "content": prompt}])
    whole = client.chat.completions.create(**ask).choices[0]
    content, args, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **ask):
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        args += "".join(d.function.arguments or "" for d in ch.delta.tool_calls or ())
        finish = ch.finish_reason or finish
    assert finish == whole.finish_reason
    if whole.message.tool_calls:
        assert json.loads(args) == json.loads(whole.message.tool_calls[0].function.arguments)
    else:
        assert content == whole.message.content and not args


def test_tool_choice_needs_its_tools(client, live):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": "hi"}], tools=[TIME],
                                       tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=5)
    assert e.value.body["param"] == "tool_choice"

def test_langchain_bind_tools_and_structured_output(live):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=live.url + "/v1", api_key="none", model=live.model, temperature=0, max_tokens=60,
                     timeout=300, max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Berlin?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"] and isinstance(msg.tool_calls[0]["args"]["city"], str)
    pet = llm.with_structured_output(Pet, method="json_schema").invoke("Describe a pet.")
    assert isinstance(pet, Pet)

def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}

S = {"type": "string", "maxLength": 16}
SCHEMAS = [
    _obj({"name": S}),
    _obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"colour": {"enum": ["red", "green", "blue"]}}),
    _obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    _obj({"point": _obj({"x": {"type": "integer"}, "y": {"type": "integer"}})}),
    _obj({"name": S, "nick": S}, required=["name"]),  # an optional field
    _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}, "maxItems": 4}}),
    _obj({"user": _obj({"name": S, "address": _obj({"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})}),
    _obj({"level": {"type": "integer", "enum": [1, 2, 3]}}),
    _obj({"items": {"type": "array", "maxItems": 2, "items": _obj({"id": {"type": "integer"}, "label": S})}}),
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    _obj({"temp": {"type": "number", "exclusiveMinimum": -50, "exclusiveMaximum": 60}}),
    _obj({"answer": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}}),
    _obj({"value": {"type": ["string", "null"], "maxLength": 10}}),
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    _obj({"matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2,
                                                              "items": {"type": "integer"}}}}),
    _obj({"title": S, "pages": {"type": "integer", "minimum": 1, "maximum": 999},
          "genre": {"enum": ["novel", "poem", "essay"]}, "in_print": {"type": "boolean"}}),
    _obj({"const": {"const": "fixed"}, "n": {"type": "integer", "minimum": -5, "maximum": 5}}),
]

def test_twenty_schemas_all_parse_and_validate(client, live):
    assert len(SCHEMAS) == 20

    def ask(i_schema):
        i, schema = i_schema
        r = client.chat.completions.create(
            model=live.model, max_tokens=100, temperature=0,
            messages=[{"role": "user", "content": "Reply with an example JSON value."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        return r.choices[0]

    with ThreadPoolExecutor(8) as pool:  # the server takes 4 at once and queues 8
        choices = list(pool.map(ask, enumerate(SCHEMAS)))
    for schema, c in zip(SCHEMAS, choices):
        assert c.finish_reason == "stop", (schema, c.message.content)
        jsonschema.validate(json.loads(c.message.content), schema)


def test_a_grammar_holds_a_legacy_completion(live):
    import httpx

    r = httpx.post(live.url + "/v1/completions", timeout=300, json={
        "model": live.model, "prompt": "The answer is", "max_tokens": 8, "temperature": 0,
        "grammar": 'start: " " ("yes" | "no")'})  # Lark
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in (" yes", " no")


async def test_websocket_params_take_json_mode(live):
    import asyncio

    from websockets.asyncio.client import connect

    async def recv(ws):
        while True:
            f = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if f["type"] != "stats":
                return f

    async with connect(live.ws_url) as ws:
        await ws.send(json.dumps({"type": "hello", "protocol": 1, "client": "pytest/0"}))
        assert (await recv(ws))["type"] == "welcome"
        await ws.send(json.dumps({"type": "open"}))
        cid = (await recv(ws))["conversation"]
        send = {"type": "send", "conversation": cid, "content": "Describe a pet."}
        await ws.send(json.dumps({**send, "request": "bad", "params": {"response_format": {"type": "bogus"}}}))
        f = await recv(ws)
        assert (f["type"], f["code"]) == ("error", "bad_params") and f["message"].startswith("params.response_format")
        schema = {**Pet.model_json_schema(), "additionalProperties": False}
        fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}
        await ws.send(json.dumps({**send, "request": "r", "params": {"max_tokens": 60, "response_format": fmt}}))
        while (f := await recv(ws))["type"] != "finished":
            pass
        assert f["reason"] == "stop" and isinstance(Pet.model_validate_json(f["text"]), Pet)
