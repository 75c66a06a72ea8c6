"""Tool calls read back from a reply in each family's format (engine/text/tool_calls.py),
the generic format's schema, and tools reaching a template that renders them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from panechat.engine.text.chat_template import ChatTemplate
from panechat.engine.text.tool_calls import (GENERIC, HERMES, LLAMA3, MISTRAL, GenericCallStream,
                                             GenericResponseStream, ToolCall,
                                             generic_history,
                                             generic_schema, native_history, parse_reply, template_format)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


@pytest.mark.parametrize("fmt,text,content,calls", [
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Oslo"})]),
    (HERMES, '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}'
             '</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Rome"}}', "", [("get_weather", {"city": "Rome"})]),
    (LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', "", [("get_time", {"zone": "UTC"})]),
    (MISTRAL, 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}}]', "Sure.",
     [("get_weather", {"city": "Lima"})]),
    (GENERIC, '{"tool_call": {"name": "get_time", "arguments": {"zone": "CET"}}}', "", [("get_time", {"zone": "CET"})]),
    (GENERIC, '{"response": "Hello there"}', "Hello there", []),
])
def test_each_format_reads_its_calls(fmt, text, content, calls):
    got_content, got = parse_reply(text, fmt)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL, GENERIC])
def test_text_without_a_well_formed_call_is_all_content(fmt):
    for text in ("Just prose.", '<tool_call>{"name": broken', '[TOOL_CALLS] not json', '{"tool_call": 3'):
        assert parse_reply(text, fmt) == (text, [])


def test_a_call_gets_an_openai_id_once():
    c = ToolCall("f", "{}").with_id()
    assert c.id.startswith("call_") and len(c.id) == 29 and c.with_id() is c


def test_the_generic_schema_admits_exactly_the_asked_calls():
    required = generic_schema([WEATHER, TIME], "required")
    jsonschema.validate({"tool_call": {"name": "get_time", "arguments": {"zone": "UTC"}}}, required)
    for bad in ({"tool_call": {"name": "get_time", "arguments": {}}},  # a required argument missing
                {"tool_call": {"name": "get_weather", "arguments": {"city": "x", "extra": 1}}},  # closed
                {"response": "text"}):  # "required" means a call
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    named = generic_schema([WEATHER, TIME], "get_weather")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_call": {"name": "get_time", "arguments": {"zone": "UTC"}}}, named)
    jsonschema.validate({"response": "hi"}, generic_schema([WEATHER], "auto"))


def test_history_in_the_generic_and_the_native_shape():
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "5 C"}
    assert json.loads(generic_history(call)["content"]) == {"tool_call": {"name": "get_weather",
                                                                           "arguments": {"city": "Oslo"}}}
    assert generic_history(result)["role"] == "user"
    assert json.loads(generic_history(result)["content"]) == {"tool_response": {"tool_call_id": "call_1",
                                                                                  "content": "5 C"}}
    native = native_history(call)
    assert native["content"] == "" and native["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endfor %}"
)


def test_a_template_that_knows_tools_renders_them():
    assert template_format(HERMES_TEMPLATE) == HERMES
    t = ChatTemplate(HERMES_TEMPLATE)
    text = t.render([native_history({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]})],
        add_generation_prompt=False, tools=[WEATHER, TIME])
    assert text.startswith("<tools>get_weather;get_time;</tools>")
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>' in text
    assert template_format("{% for m in messages %}{{ m.content }}{% endfor %}") == GENERIC


def test_a_generic_call_streams_its_arguments_and_holds_the_closing_braces():
    s = GenericCallStream()
    got = [s.push(p) for p in ['{"tool', '_call":{"name":"get_', 'weather","argu', 'ments":{"ci', 'ty":"Par', 'is"}}', '}']]
    assert [n for n, _ in got if n] == ["get_weather"]
    assert "".join(a for _, a in got) + s.finish() == '{"city":"Paris"}'
    assert sum(bool(a) for _, a in got) > 1
    reply = GenericCallStream()
    assert reply.push('{"response":"hi"}') == (None, "") and reply.name is None


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_a_generic_text_reply_streams_unescaped(step):
    text = "Hi \"you\"\nok \u00e9 \U0001F600 end\\"
    raw = json.dumps({"response": text}, separators=(",", ":"))  # escapes, a surrogate pair
    s = GenericResponseStream()
    pieces = [s.push(raw[i:i + step]) for i in range(0, len(raw), step)]
    assert "".join(pieces) + s.finish() == text
    assert sum(bool(p) for p in pieces) > 1
    call = GenericResponseStream()
    assert call.push('{"tool_call":{"name":"f","arguments":{}}}') == "" and not call.started
