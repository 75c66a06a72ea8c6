"""The generation fields of every protocol, in one table (docs/protocol.md, "Request fields").

Each `Field` row names a field, how it is read (its type), its range (for the sampling
fields, the engine's own `BOUNDS`, engine/serving/sampling.py) and the value an absent
field means in each protocol that takes it: HTTP chat (`/v1/chat/completions`), HTTP
completions (`/v1/completions`) and the websocket `send` frame's `params`. A field is
honoured, refused unless it asks for nothing (`n` other than 1), or ignored metadata
(`user`); one that a protocol's column lacks is unknown there, ignored like any unknown key.

`read_fields(body, protocol)` reads a request's fields in table order; a bad or refused one
raises FieldError naming it, which each protocol words as its own error (request_fields.py).
The input itself (`messages`, `prompt`, a frame's `content`) has a shape per protocol and
is read by that protocol. Adding a field: one row here, plus its handling where the value
is used; docs/protocol.md shows `markdown_table()`, which a test keeps current.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from panechat.engine.serving.sampling import BOUNDS, LOGPROBS_BOUND, Bound, SamplingParams
from .request_fields import FieldError, boolean, integer, json_object, logprobs_flag, number, stop_strings, token_bias
from .structured_fields import grammar_text, response_format, tool_choice, tool_list

CHAT, COMPLETIONS, WS = "chat", "completions", "ws"
PROTOCOLS = (CHAT, COMPLETIONS, WS)
HONOURED, REFUSED, IGNORED = "honoured", "refused", "ignored"


class _Context:
    """The default of `max_tokens` over HTTP chat: run to the context limit."""

    def __repr__(self) -> str:
        return "the context"


CONTEXT = _Context()

_TYPE_WORDS = {number: "a number", integer: "an integer", boolean: "true or false", json_object: "an object",
               stop_strings: "a string or a list of strings",
               token_bias: "an object: token id -> a number in [-100, 100]",
               logprobs_flag: "true, false or an integer in [0, 20]",
               response_format: 'an object, `type` "text", "json_object" or "json_schema"',
               grammar_text: "a GBNF or Lark grammar (a string)",
               tool_list: "a list of function tools", tool_choice: '"none", "auto", "required" or a function'}

MAX_N = 16  # samples per request (n, best_of): each is a generation of its own
N_BOUND = Bound(True, 1, MAX_N)


@dataclass(frozen=True)
class Field:
    """One request field: how each protocol that takes it reads it, and its default there."""

    name: str
    defaults: Mapping[str, Any]  # protocol -> what an absent field means; only the protocols taking it
    status: str = HONOURED
    read: Callable[[str, Any], Any] | None = None  # honoured: the typed read (request_fields.py)
    bound: Bound | None = None  # honoured: the range (the engine's own)
    convert: Callable[[Any], Any] | None = None  # honoured: applied after the read
    alias_of: str | None = None  # honoured: the field this one is another name of (this one wins)
    accepts: Callable[[Any], bool] | None = None  # refused: the values that ask for nothing, taken
    unless: str = ""  # refused: those values in words
    refusal: str = ""  # refused: the one-line message
    note: str = ""  # said after the type in the docs

    def value(self, v):
        """The value of a present honoured field; FieldError when it is wrong."""
        key = self.alias_of or self.name
        x = self.read(self.name, v)
        if self.convert is not None:
            x = self.convert(x)
        why = self.bound.problem(x) if self.bound is not None else None
        if why is not None:
            raise FieldError(key, why, code="invalid_value")
        return x

    def check_refused(self, v) -> None:
        """FieldError unless `v` (present) asks for nothing."""
        if not self.accepts(v):
            raise FieldError(self.name, f"is refused unless {self.unless}", code=None, sentence=self.refusal)


def _on(*protocols: str, default=None) -> dict[str, Any]:
    """A `defaults` column set: `protocols` take the field, absent it means `default`."""
    return dict.fromkeys(protocols, default)


def _falsy(v) -> bool:
    return not v


HTTP = (CHAT, COMPLETIONS)

#: Every field, in the order they are checked.
FIELDS: tuple[Field, ...] = (
    Field("stream", _on(*HTTP, default=False), read=boolean),
    Field("stream_options", _on(*HTTP), read=json_object, note="; `include_usage`: true adds a usage-only chunk"),
    Field("n", _on(*HTTP, default=1), read=integer, bound=N_BOUND,
          note="; the choices share one prefill, choice i has seed `seed` + i"),
    Field("best_of", _on(COMPLETIONS), read=integer, bound=N_BOUND,
          note="; default `n`: the `n` of `best_of` samples with the highest total logprob, not with `stream`"),
    Field("logprobs", _on(*HTTP, default=False), read=logprobs_flag,
          note="; chat: true adds each token's logprob (`top_logprobs` alternatives), completions: an integer, "
               "that many alternatives"),
    Field("top_logprobs", _on(CHAT), read=integer, bound=LOGPROBS_BOUND, note="; needs `logprobs`: true"),
    Field("echo", _on(COMPLETIONS, default=False), read=boolean,
          note="; the prompt before the reply (with `logprobs`: the prompt's too; `max_tokens` 0: the prompt alone)"),
    Field("tools", _on(CHAT), read=tool_list, note="; the reply may call them (`tool_calls`)"),
    Field("tool_choice", _on(CHAT, default="auto"), read=tool_choice,
          note='; "required" and a named function are held to the call by a grammar'),
    Field("response_format", _on(CHAT, WS), read=response_format,
          note="; json_object and json_schema are held to it by a grammar"),
    Field("grammar", _on(*PROTOCOLS), read=grammar_text, note="; the reply is held to it, as llama.cpp's `grammar`"),
    Field("functions", _on(CHAT), REFUSED, accepts=_falsy, unless="empty",
          refusal="functions (the deprecated form of tools) are not supported by this server"),
    Field("function_call", _on(CHAT), REFUSED, accepts=lambda v: v in ("none", "auto"), unless='"none" or "auto"',
          refusal="function_call needs functions, which this server does not support"),
    Field("audio", _on(CHAT), REFUSED, accepts=_falsy, unless="empty",
          refusal="audio output is not supported by this server"),
    Field("modalities", _on(CHAT), REFUSED, accepts=lambda v: v == ["text"], unless='["text"]',
          refusal='only modalities ["text"] are supported'),
    Field("moderation", _on(CHAT), REFUSED, accepts=_falsy, unless="empty",
          refusal="moderation is not run by this server"),
    Field("reasoning_effort", _on(CHAT), REFUSED, accepts=lambda v: v == "none", unless='"none"',
          refusal="reasoning_effort is not supported by this server's models"),
    Field("verbosity", _on(CHAT), REFUSED, accepts=lambda v: v == "medium", unless='"medium"',
          refusal='only verbosity "medium" (the default) is supported'),
    Field("web_search_options", _on(CHAT), REFUSED, accepts=_falsy, unless="empty",
          refusal="web search is not supported by this server"),
    Field("frequency_penalty", _on(*PROTOCOLS, default=0.0), read=number, bound=BOUNDS["frequency_penalty"],
          note="; minus count x this from each generated token's logit"),
    Field("presence_penalty", _on(*PROTOCOLS, default=0.0), read=number, bound=BOUNDS["presence_penalty"],
          note="; minus this from each generated token's logit"),
    Field("repeat_penalty", _on(*PROTOCOLS, default=1.0), read=number, bound=BOUNDS["repeat_penalty"],
          note="; llama.cpp's, over the last `repeat_last_n` generated tokens"),
    Field("repeat_last_n", _on(*PROTOCOLS, default=64), read=integer, bound=BOUNDS["repeat_last_n"]),
    Field("logit_bias", _on(*PROTOCOLS), read=token_bias, convert=lambda v: v or None),
    Field("suffix", _on(COMPLETIONS), REFUSED, accepts=_falsy, unless="empty",
          refusal="suffix (insertion) is not supported by this server"),
    Field("max_completion_tokens", _on(*HTTP), read=integer, bound=BOUNDS["max_tokens"], alias_of="max_tokens",
          note="; `max_tokens` by its newer name"),
    Field("max_tokens", {CHAT: CONTEXT, COMPLETIONS: 16, WS: 256}, read=integer, bound=BOUNDS["max_tokens"],
          note="; capped by the context"),
    Field("seed", _on(*PROTOCOLS), read=integer, convert=lambda v: v % 2**64,
          note=", any (taken mod 2^64); none: a random one"),
    Field("temperature", {CHAT: 1.0, COMPLETIONS: 1.0, WS: 0.0}, read=number, bound=BOUNDS["temperature"]),
    Field("top_p", _on(*PROTOCOLS, default=1.0), read=number, bound=BOUNDS["top_p"]),
    Field("top_k", _on(*PROTOCOLS, default=0), read=integer, bound=BOUNDS["top_k"]),
    Field("min_p", _on(*PROTOCOLS, default=0.0), read=number, bound=BOUNDS["min_p"]),
    Field("stop", _on(*PROTOCOLS, default=()), read=stop_strings,
          note=", at most 16 of at most 256 characters; the reply ends before the first match"),
    Field("spec", _on(*PROTOCOLS, default=True), read=boolean,
          note="; false: no speculative decoding for this reply (the tokens are the same either way)"),
    Field("user", _on(*HTTP), IGNORED),
    Field("metadata", _on(CHAT), IGNORED),
    Field("store", _on(CHAT), IGNORED),
    Field("service_tier", _on(*HTTP), IGNORED),
    Field("safety_identifier", _on(CHAT), IGNORED),
    Field("prediction", _on(CHAT), IGNORED, note="a latency hint"),
    Field("prompt_cache_key", _on(CHAT), IGNORED, note="every prefix is cached anyway"),
    Field("prompt_cache_options", _on(CHAT), IGNORED, note="every prefix is cached anyway"),
    Field("prompt_cache_retention", _on(CHAT), IGNORED, note="every prefix is cached anyway"),
    Field("parallel_tool_calls", _on(CHAT, default=True), read=boolean,
          note="; false: at most one call per reply"),
)

_OF_PROTOCOL = {p: tuple(f for f in FIELDS if p in f.defaults) for p in PROTOCOLS}


def read_fields(body: dict, protocol: str) -> dict[str, Any]:
    """The honoured fields of `protocol` in `body` by name (an alias under its field's name),
    absent ones at the protocol's default. FieldError for the first wrong or refused field,
    in table order."""
    out: dict[str, Any] = {}
    for f in _OF_PROTOCOL[protocol]:
        v = body.get(f.name)
        if f.status == REFUSED and v is not None:
            f.check_refused(v)
        elif f.status == HONOURED and (f.alias_of or f.name) not in out:
            if v is not None:
                out[f.alias_of or f.name] = f.value(v)
            elif f.alias_of is None:
                out[f.name] = f.defaults[protocol]
    return out


def unknown_field(body: dict, protocol: str) -> str | None:
    """The first key of `body` that is no field of `protocol`, or None. The websocket refuses
    one (its own protocol: a typo must not pass for a setting); HTTP ignores them, as
    OpenAI-compatible servers do for fields of newer API versions."""
    known = {f.name for f in _OF_PROTOCOL[protocol]}
    return next((k for k in body if k not in known), None)


#: What each HTTP route reads itself besides FIELDS (the input and the model).
INPUTS = {CHAT: ("model", "messages"), COMPLETIONS: ("model", "prompt")}


def unknown_fields(body: dict, protocol: str) -> list[str]:
    """Every key of an HTTP `body` that neither FIELDS nor the route's INPUTS name (another
    server's extension, e.g. llama.cpp's `cache_prompt`): ignored, as llama.cpp and vLLM
    do, and named in one log line by the route."""
    known = {f.name for f in _OF_PROTOCOL[protocol]} | set(INPUTS[protocol])
    return [k for k in body if k not in known]


def sampling_params(fields: dict[str, Any], ctx: int) -> SamplingParams:
    """The SamplingParams `read_fields` values ask for; max_tokens capped by the context `ctx`.
    FieldError for `top_logprobs` without `logprobs`."""
    max_tokens = fields["max_tokens"]
    logprobs = _logprobs(fields)
    return SamplingParams(temperature=fields["temperature"], top_k=fields["top_k"], top_p=fields["top_p"],
                          min_p=fields["min_p"], seed=fields["seed"],
                          max_tokens=ctx if max_tokens is CONTEXT else min(max_tokens, ctx),
                          logit_bias=fields["logit_bias"] or None, presence_penalty=fields["presence_penalty"],
                          frequency_penalty=fields["frequency_penalty"], repeat_penalty=fields["repeat_penalty"],
                          repeat_last_n=fields["repeat_last_n"], logprobs=logprobs,
                          prompt_logprobs=logprobs if fields.get("echo") else None, speculate=fields["spec"])


def _logprobs(fields: dict[str, Any]) -> int | None:
    """The alternatives per token `logprobs` asks for (None: no logprobs): chat's true with
    `top_logprobs`, or completions' integer."""
    flag, top = fields.get("logprobs", False), fields.get("top_logprobs")
    if top and flag is False:
        raise FieldError("top_logprobs", "", code="invalid_value",
                         sentence="top_logprobs needs logprobs: true")
    if flag is False:
        return None
    return (top or 0) if flag is True else flag


# -- the docs' table ------------------------------------------------------------------------------
def _default_words(v) -> str:
    if v is None or v == ():
        return "none"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v) if v is CONTEXT or not isinstance(v, str) else f'"{v}"'


def _type_words(f: Field) -> str:
    if f.status != HONOURED:
        return "any"
    if f.bound is not None:
        words = f.bound.range if f.bound.integer else f"a number {f.bound.range}"
    else:
        words = _TYPE_WORDS[f.read]
    return words + f.note


def _status_words(f: Field) -> str:
    ignored = f"ignored ({f.note})" if f.note else "ignored (metadata)"
    return {HONOURED: "honoured", REFUSED: f"refused unless {f.unless}", IGNORED: ignored}[f.status]


def markdown_table() -> str:
    """FIELDS as the table docs/protocol.md shows (a test keeps the two the same)."""
    rows = ["| Field | Type and range | HTTP chat | HTTP completions | `/ws` `params` | |",
            "| --- | --- | --- | --- | --- | --- |"]
    for f in FIELDS:
        cols = [("-" if p not in f.defaults else f"as `{f.alias_of}`" if f.alias_of else
                 _default_words(f.defaults[p])) for p in PROTOCOLS]
        rows.append(f"| `{f.name}` | {_type_words(f)} | {' | '.join(cols)} | {_status_words(f)} |")
    return "\n".join(rows)

