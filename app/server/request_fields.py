"""Reading what both protocols receive, for the OpenAI API and the websocket protocol
alike: the JSON itself (`parse_json`), then typed reads of the fields they share
(sampling parameters and stop strings).

A bad field raises `FieldError(key, what, code)`; each protocol words it as its own error
(`'temperature' must be a number` over HTTP, `params.temperature must be a number` in a
websocket frame)."""

from __future__ import annotations

import json

from panechat.engine.serving.sampling import SamplingParams

MAX_STOP = 16
MAX_STOP_LEN = 256


class FieldError(ValueError):
    def __init__(self, key: str, what: str, code: str | None = "invalid_type"):
        super().__init__(f"{key} {what}")
        self.key, self.what, self.code = key, what, code


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def opt_num(d: dict, key: str, default):
    v = d.get(key)
    if v is None:
        return default
    if not is_num(v):
        raise FieldError(key, "must be a number")
    return float(v)


def opt_int(d: dict, key: str, default):
    v = d.get(key)
    if v is None:
        return default
    if not is_int(v):
        raise FieldError(key, "must be an integer")
    return v


def stop_strings(v) -> list[str]:
    """`stop`: a string or a list of strings; empty strings are dropped."""
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise FieldError("stop", "must be a string or a list of strings", code=None)
    if len(v) > MAX_STOP or any(len(s) > MAX_STOP_LEN for s in v):
        raise FieldError("stop", f"takes at most {MAX_STOP} strings of at most {MAX_STOP_LEN} characters", code=None)
    return [s for s in v if s]


def sampling_params(*, temperature, top_p, top_k, min_p, seed, max_tokens, ctx: int) -> SamplingParams:
    """SamplingParams from already type-checked values; ValueError for out-of-range ones."""
    if max_tokens is None:
        max_tokens = ctx
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    if seed is not None:
        seed %= 2**64  # numpy seeds are non-negative; keep any integer deterministic
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                       max_tokens=min(max_tokens, ctx))
    p.validate()
    return p


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
