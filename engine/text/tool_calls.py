"""Tool calls in a model's text: which format a chat template speaks, how a reply's calls
are read back, and the generic JSON format for templates that know no tools.

References followed: llama.cpp `common/chat.cpp` (the formats it parses: Hermes/Qwen
`<tool_call>{...}</tool_call>`, Llama 3.x `{"name": ..., "parameters": ...}`, Mistral
`[TOOL_CALLS][...]`, and its generic format `{"tool_call": {...}}` / `{"response": ...}`,
which a grammar enforces) and OpenAI's `tool_calls` (arguments as a JSON string).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

HERMES, LLAMA3, MISTRAL, GENERIC = "hermes", "llama3", "mistral", "generic"

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def with_id(self) -> "ToolCall":
        """This call with an id of OpenAI's shape (`call_` + 24 hex digits) when it has none."""
        return self if self.id else ToolCall(self.name, self.arguments, f"call_{uuid.uuid4().hex[:24]}")


def template_format(source: str) -> str:
    """The tool-call format a chat template's source speaks: HERMES, LLAMA3 or MISTRAL when
    it renders `tools` in one of theirs, else GENERIC (it knows no tools: SmolLM2's)."""
    if "tools" not in source:
        return GENERIC
    if "<tool_call>" in source:
        return HERMES
    if "[TOOL_CALLS]" in source or "[AVAILABLE_TOOLS]" in source:
        return MISTRAL
    if "<|python_tag|>" in source or "ipython" in source or '"parameters"' in source:
        return LLAMA3
    return GENERIC


def parse_reply(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply in format `fmt`; text that holds no well-formed
    call is all content, so a reply is never lost."""
    parse = {HERMES: _hermes, LLAMA3: _llama3, MISTRAL: _mistral, GENERIC: _generic}[fmt]
    try:
        got = parse(text)
    except (ValueError, TypeError, KeyError, AttributeError):
        got = None
    return got if got is not None else (text, [])


def _call(obj: dict, args_key: str = "arguments") -> ToolCall:
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(obj.get("name"), str):
        raise ValueError("a tool call without a name")
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _hermes(text: str):
    found = _HERMES_CALL.findall(text)
    if not found:
        return None
    calls = [_call(json.loads(body)) for body in found]
    return _HERMES_CALL.sub("", text).strip(), calls


def _llama3(text: str):
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith(("{", "[")):
        return None
    objs = json.loads(body)
    objs = objs if isinstance(objs, list) else [objs]
    return "", [_call(o, "parameters") for o in objs]


def _mistral(text: str):
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return None
    objs = json.loads(text[at + len("[TOOL_CALLS]"):].strip())
    return text[:at].strip(), [_call(o) for o in (objs if isinstance(objs, list) else [objs])]


def _generic(text: str):
    obj = json.loads(text)
    if "tool_call" in obj:
        return "", [_call(obj["tool_call"])]
    if "tool_calls" in obj:
        return "", [_call(o) for o in obj["tool_calls"]]
    if isinstance(obj.get("response"), str):
        return obj["response"], []
    return None


# -- the generic format -------------------------------------------------------------------------
# compact JSON: the grammar allows no free whitespace
_GENERIC_NAMED = re.compile(r'\{"tool_call":\{"name":"((?:[^"\\]|\\.)*)","arguments":')


class GenericCallStream:
    """A generic reply's call as its text arrives: its name once known, then its arguments
    text piece by piece, the two braces that close the call and the reply held back (a
    reply that is no call, `{"response": ...}`, yields nothing)."""

    HOLD = 2

    def __init__(self):
        self.text = ""
        self.name: str | None = None
        self._sent = 0  # text[:_sent] is accounted for

    def push(self, piece: str) -> tuple[str | None, str]:
        """(the call's name when this piece makes it known, else None; new arguments text)."""
        self.text += piece
        new_name = None
        if self.name is None:
            m = _GENERIC_NAMED.match(self.text)
            if m is None:
                return None, ""
            self.name = new_name = json.loads(f'"{m.group(1)}"')
            self._sent = m.end()
        end = max(self._sent, len(self.text) - self.HOLD)
        chunk, self._sent = self.text[self._sent:end], end
        return new_name, chunk

    def finish(self) -> str:
        """The arguments text still held back (without the closing braces when complete)."""
        rest = self.text[self._sent:]
        return rest[:-self.HOLD] if rest.endswith("}" * self.HOLD) else rest


_GENERIC_RESPONSE = '{"response":"'


class GenericResponseStream:
    """A generic reply's `{"response": text}` as its text arrives: the text, unescaped,
    piece by piece (an escape cut between pieces and the closing `"}` held back; a reply
    that is a call yields nothing)."""

    HOLD = 2

    def __init__(self):
        self.text = ""
        self.started = False
        self._sent = 0  # text[:_sent] is accounted for

    def push(self, piece: str) -> str:
        """The reply text this piece lets through."""
        self.text += piece
        if not self.started:
            if not self.text.startswith(_GENERIC_RESPONSE):
                return ""
            self.started, self._sent = True, len(_GENERIC_RESPONSE)
        return self._take(len(self.text) - self.HOLD)

    def finish(self) -> str:
        """The text still held back (all that decodes of a reply cut short)."""
        if not self.started:
            return ""
        return self._take(len(self.text) - self.HOLD if self.text.endswith('"}') else len(self.text))

    def _take(self, end: int) -> str:
        raw, i = self.text, self._sent
        while i < end:
            need = 1
            if raw[i] == "\\":
                need = 2 if raw[i + 1:i + 2] != "u" else 6
                if need == 6 and i + 6 <= len(raw) and 0xD800 <= int(raw[i + 2:i + 6], 16) <= 0xDBFF:
                    need = 12  # a surrogate pair decodes only whole
            if i + need > end:
                break
            i += need
        out = json.loads(f'"{raw[self._sent:i]}"') if i > self._sent else ""
        self._sent = i
        return out


def generic_schema(tools: list[dict], choice: str | None) -> dict:
    """The JSON schema of a generic reply: one call of one of `tools` (only the one named
    `choice`, when it names one); with `choice` "auto" also `{"response": text}`. `tools` are
    OpenAI function tools. One call per reply: a small model offered a list repeats its call
    until its token limit."""
    fns = [t["function"] for t in tools]
    if choice not in (None, "auto", "required"):
        fns = [f for f in fns if f["name"] == choice]
    one = {"anyOf": [_call_schema(f) for f in fns]} if len(fns) > 1 else _call_schema(fns[0])
    calls = _object({"tool_call": one})
    if choice == "auto":
        return {"anyOf": [calls, _object({"response": {"type": "string"}})]}
    return calls


def _call_schema(fn: dict) -> dict:
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if "properties" in params and "additionalProperties" not in params:  # as OpenAI's strict tools
        params = {**params, "additionalProperties": False}  # (a small model invents keys otherwise)
    return _object({"name": {"const": fn["name"]}, "arguments": params})


def _object(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def generic_instructions(tools: list[dict], choice: str | None) -> str:
    """The system-prompt text that tells a model without tool support about `tools` and the
    reply format (the grammar then holds it to that format)."""
    fns = [t["function"] for t in tools]
    listing = "\n".join(json.dumps({k: f[k] for k in ("name", "description", "parameters") if k in f},
                                   ensure_ascii=False) for f in fns)
    call = '{"tool_call": {"name": <function name>, "arguments": <arguments object>}}'
    how = (f"To call a function, reply with JSON {call}; otherwise reply with JSON {{\"response\": <your answer>}}."
           if choice == "auto" else f"Reply with JSON {call}.")
    return f"You can call these functions:\n{listing}\n{how}"


def generic_history(message: dict) -> dict:
    """A history message of the OpenAI tools protocol as plain text the generic format reads:
    an assistant's `tool_calls` as the JSON it would have written, a `tool` result as a user
    message `{"tool_response": ...}`; other messages as they are."""
    if message.get("role") == "tool":
        body = {"tool_call_id": message.get("tool_call_id", ""), "content": message.get("content", "")}
        if message.get("name"):
            body["name"] = message["name"]
        return {"role": "user", "content": json.dumps({"tool_response": body}, ensure_ascii=False)}
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls:
        objs = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
                for c in calls]
        body = {"tool_calls": objs} if len(objs) > 1 else {"tool_call": objs[0]}
        return {"role": "assistant", "content": json.dumps(body, ensure_ascii=False)}
    return message


def _arguments(text) -> object:
    """A call's arguments as an object (OpenAI sends them as JSON text)."""
    if isinstance(text, str):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text if text is not None else {}


def native_history(message: dict) -> dict:
    """A history message for a template that renders tools itself: an assistant's
    `tool_calls` with their arguments as objects (what such templates `tojson`), content
    "" where it was null."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = dict(message, content=message.get("content") or "")
    out["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                          "function": {"name": c["function"]["name"],
                                       "arguments": _arguments(c["function"].get("arguments"))}}
                         for c in calls]
    return out
