"""Ollama's `/api/chat` and `/api/generate` requests as the OpenAI-shaped bodies the chat and
completions routes read (docs/protocol.md, "Ollama API"), so both APIs share one request
schema (request_schema.py) and one engine path.

`options` map to the schema's fields by name (OPTIONS); an option whose field this server
lacks is refused naming it, never dropped. `format` becomes `response_format`, Ollama's
tool calls OpenAI's. `OllamaBody.names` maps each schema field back to the Ollama key it
came from, so a 400 names what the client sent (`'options.num_predict' must be >= 1`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .errors import APIError, bad_request
from .request_schema import CHAT, COMPLETIONS, FIELDS

#: Ollama option -> the request-schema field it sets.
OPTIONS: dict[str, str] = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
    "num_predict": "max_tokens", "stop": "stop",
    "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
}
#: Options panechat does not implement, taken only at the value that turns them off.
NEUTRAL: dict[str, tuple] = {"mirostat": (0,), "typical_p": (1,), "tfs_z": (1,)}
#: Ollama's "no limit" values of num_predict (-1: infinite, -2: fill the context) and of
#: seed (-1: a random one): the schema's absent field means the same.
UNSET = {"num_predict": (-1, -2), "seed": (-1,)}
# Any other option (num_keep, num_batch, num_gpu, num_thread, use_mmap, mirostat_tau, ...)
# is about how Ollama's runner loads and runs a model: ignored, as Ollama ignores unknown ones.

_TOP_LEVEL = {"stream": "stream", "response_format": "format", "tools": "tools"}


@dataclass
class OllamaBody:
    """An Ollama request as the OpenAI-shaped `body` of `protocol` (CHAT or COMPLETIONS).

    `num_ctx`: the client's context cap (None: the server's). `load_only`: no prompt or
    messages, only the model asked for (Ollama loads it and answers done_reason "load")."""

    body: dict
    protocol: str
    names: dict[str, str] = field(default_factory=dict)
    num_ctx: int | None = None
    load_only: bool = False

    def reworded(self, err: APIError) -> APIError:
        """`err` (a 400 naming a schema field) naming the Ollama key instead."""
        name = self.names.get(err.param or "")
        if name is None:
            return err
        quoted = f"'{err.param}'"
        msg = err.message.replace(quoted, f"'{name}'", 1) if quoted in err.message else f"{name}: {err.message}"
        return APIError(err.status, msg, type=err.type, param=name, code=err.code, headers=err.headers)


def _known(protocol: str) -> set[str]:
    return {f.name for f in FIELDS if protocol in f.defaults}


def _refuse_truthy(body: dict, key: str, why: str) -> None:
    if body.get(key):
        raise bad_request(f"'{key}' {why}", param=key)


def _options(body: dict, protocol: str, out: OllamaBody) -> None:
    """`options` into `out.body` (the fields OPTIONS names) and `out.num_ctx`."""
    opts = body.get("options")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise bad_request("'options' must be an object", param="options", code="invalid_type")
    known = _known(protocol)
    for key, v in opts.items():
        if v is None or v in UNSET.get(key, ()):
            continue
        if key in NEUTRAL:
            if v not in NEUTRAL[key]:
                raise bad_request(f"'options.{key}' is not supported by this server (send {NEUTRAL[key][0]} or "
                                  "leave it out)", param=f"options.{key}")
        elif key == "num_ctx":
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad_request("'options.num_ctx' must be an integer >= 1", param="options.num_ctx",
                                  code="invalid_value")
            out.num_ctx = v
        elif key in OPTIONS:
            name = OPTIONS[key]
            if name not in known:
                raise bad_request(f"'options.{key}' is not supported by this server", param=f"options.{key}")
            out.body[name] = v
            out.names[name] = f"options.{key}"


def _format(body: dict, out: OllamaBody) -> None:
    """`format`: "json" -> json_object, a schema -> json_schema (strict), "" or none -> text."""
    v = body.get("format")
    if v is None or v == "":
        return
    if v == "json":
        out.body["response_format"] = {"type": "json_object"}
    elif isinstance(v, dict):
        out.body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "ollama", "schema": v, "strict": True}}
    else:
        raise bad_request("'format' must be \"json\" or a JSON schema (an object)", param="format",
                          code="invalid_value")


def _common(body: dict, protocol: str) -> OllamaBody:
    """What both routes take: stream (Ollama's default: true), options, format; `think`
    and `logprobs` refused (no reasoning split, no Ollama-shaped logprobs)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _refuse_truthy(body, "think", "is not supported by this server (send false or leave it out)")
    _refuse_truthy(body, "logprobs", "is not supported on this server's Ollama API")
    stream = body.get("stream")
    out = OllamaBody({"stream": True if stream is None else stream}, protocol, names=dict(_TOP_LEVEL))
    _options(body, protocol, out)
    _format(body, out)
    return out


# -- /api/chat ------------------------------------------------------------------------------------
def chat_body(body: dict) -> OllamaBody:
    """An `/api/chat` request as a `/v1/chat/completions` body."""
    out = _common(body, CHAT)
    messages = body.get("messages")
    out.load_only = messages is None or messages == []
    out.body["messages"] = chat_messages(messages) if isinstance(messages, list) else messages
    tools = body.get("tools")
    if tools:
        out.body["tools"] = tools
    return out


def chat_messages(messages: list) -> list:
    """Ollama's messages as OpenAI's: an assistant's `tool_calls` get ids and JSON-string
    arguments, a `tool` message the id of the call it answers (by `tool_name`, else the
    first unanswered one); `thinking` is dropped; `images` are refused. The schema checks
    the rest (roles, content)."""
    out, pending = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        if m.get("images"):
            raise bad_request(f"messages[{i}].images: images are not supported (the models this server "
                              "runs read text only)", param=f"messages[{i}].images")
        msg = {"role": m.get("role"), "content": m.get("content")}
        calls = m.get("tool_calls")
        if calls and isinstance(calls, list):
            msg["content"] = msg["content"] or ""
            msg["tool_calls"] = [_openai_call(c, f"call_{i}_{j}") for j, c in enumerate(calls)]
            pending = [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
        if m.get("role") == "tool":
            name = m.get("tool_name") or m.get("name")
            match = next((p for p in pending if p[1] == name), pending[0] if pending else None)
            if match is not None:
                pending.remove(match)
                msg["tool_call_id"] = match[0]
            if name:
                msg["name"] = name
        out.append(msg)
    return out


def _openai_call(call, call_id: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("tool_calls entries must be {\"function\": {\"name\", \"arguments\"}}",
                          param="messages.tool_calls")
    args = fn.get("arguments", {})
    return {"id": call_id, "type": "function",
            "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


# -- /api/generate --------------------------------------------------------------------------------
def generate_body(body: dict, ctx: int) -> OllamaBody:
    """An `/api/generate` request: `raw` as a `/v1/completions` body (no template; with no
    num_predict it runs to the context `ctx`, as Ollama does), otherwise a chat of `system`
    and the prompt as one user turn (what Ollama's template does with them)."""
    raw = body.get("raw", False) if isinstance(body, dict) else False
    if not isinstance(raw, bool):
        raise bad_request("'raw' must be true or false", param="raw", code="invalid_type")
    out = _common(body, COMPLETIONS if raw else CHAT)
    for key, why in (("suffix", "(fill-in-the-middle) is not supported by this server"),
                     ("template", "is not supported: the model's own chat template is used (raw: true sends "
                                  "the prompt as it is)"),
                     ("context", "is not supported: send the conversation to /api/chat (replies carry no "
                                 "context)"),
                     ("images", "are not supported (the models this server runs read text only)")):
        _refuse_truthy(body, key, why)
    if "format" in body and raw and body["format"]:
        raise bad_request("'format' needs the chat template: leave out raw", param="format")
    prompt, system = body.get("prompt"), body.get("system")
    for key, v in (("prompt", prompt), ("system", system)):
        if v is not None and not isinstance(v, str):
            raise bad_request(f"'{key}' must be a string", param=key, code="invalid_type")
    out.load_only = not prompt
    if raw:
        _refuse_truthy(body, "system", "has no effect with raw: true (put it in the prompt)")
        out.body["prompt"] = prompt
        out.body.setdefault("max_tokens", ctx)
    else:
        out.body["messages"] = [*([{"role": "system", "content": system}] if system else []),
                                {"role": "user", "content": prompt}]
    return out
