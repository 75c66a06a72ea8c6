"""Reading what every protocol receives: the JSON itself (`parse_json`), then typed reads of
one field each (`number`, `integer`, `boolean`, `json_object`, `stop_strings`, `token_bias`,
`logprobs_flag`), which the request
schema (request_schema.py) names per field.

A bad field raises `FieldError(key, what, code)`; each protocol words it as its own error
(`'temperature' must be a number` over HTTP, `params.temperature must be a number` in a
websocket frame)."""

from __future__ import annotations

import json
import math

from panechat.engine.serving.invalid_request import InvalidRequest
from panechat.engine.serving.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS

MAX_STOP = 16
MAX_STOP_LEN = 256


class FieldError(InvalidRequest):
    """One request field is wrong: `key` names it, `what` says how ("must be a number"),
    `code` is OpenAI's error code. `sentence`, when set, is the whole message instead (a
    refusal such as "only n=1 is supported")."""

    def __init__(self, key: str, what: str, code: str | None = "invalid_type", sentence: str | None = None):
        super().__init__(sentence or f"{key} {what}", param=key)
        self.key, self.what, self.code, self.sentence = key, what, code, sentence

    def worded(self, name: str) -> str:
        """The one-line message with the field called `name` (`'top_p'`, `params.top_p`)."""
        return self.sentence or f"{name} {self.what}"


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def number(key: str, v) -> float:
    """A JSON number as a float (an integer too large for one reads as infinite, which the
    field's bound then refuses)."""
    if not is_num(v):
        raise FieldError(key, "must be a number")
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def integer(key: str, v) -> int:
    if not is_int(v):
        raise FieldError(key, "must be an integer")
    return v


def boolean(key: str, v) -> bool:
    if not isinstance(v, bool):
        raise FieldError(key, "must be true or false")
    return v


def json_object(key: str, v) -> dict:
    if not isinstance(v, dict):
        raise FieldError(key, "must be an object", code=None)
    return v


def stop_strings(key: str, v) -> list[str]:
    """`stop`: a string or a list of strings; empty strings are dropped."""
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise FieldError(key, "must be a string or a list of strings", code=None)
    if len(v) > MAX_STOP or any(len(s) > MAX_STOP_LEN for s in v):
        raise FieldError(key, f"takes at most {MAX_STOP} strings of at most {MAX_STOP_LEN} characters", code=None)
    return [s for s in v if s]


def token_bias(key: str, v) -> dict[int, float]:
    """`logit_bias`: an object mapping token ids (as JSON keys are, strings of integers) to
    numbers in [-100, 100] (OpenAI's range); the vocabulary is checked by the engine."""
    if not isinstance(v, dict):
        raise FieldError(key, "must be an object mapping token ids to biases", code=None)
    out = {}
    for k, b in v.items():
        t = k if is_int(k) else int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else None
        if t is None:
            raise FieldError(key, f"names {str(k)[:40]!r}, which is not a token id (an integer >= 0)",
                             code="invalid_value")
        if not is_num(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise FieldError(key, f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] "
                             f"(token {t} has {str(b)[:40]})", code="invalid_value")
        out[t] = float(b)
    return out


def logprobs_flag(key: str, v) -> int | bool:
    """`logprobs`: true or false (chat), or the number of alternatives to list with each
    token (legacy completions; 0: the chosen token only)."""
    if not isinstance(v, bool) and not is_int(v):
        raise FieldError(key, "must be true, false or an integer")
    if not isinstance(v, bool) and not 0 <= v <= MAX_TOP_LOGPROBS:
        raise FieldError(key, f"must be true, false or an integer in [0, {MAX_TOP_LOGPROBS}]", code="invalid_value")
    return v


def parse_json(raw: bytes | str):
    """json.loads without NaN/Infinity and without lone surrogates (`"\\ud800"`, which
    cannot be encoded or tokenized); ValueError for anything malformed."""
    def _no_constants(name):
        raise ValueError(f"{name} is not valid JSON")
    try:
        obj = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    stack = [obj]
    while stack:  # iterative: nesting depth is bounded only by json.loads
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone UTF-16 surrogate (invalid Unicode)") from None
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return obj
