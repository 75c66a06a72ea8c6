"""Token sampling: greedy, temperature, top-k, top-p, min-p, each request with its own RNG.

Small factories returning callables, as mlx-lm's `sample_utils.py`. A sampler sees one
sequence's logits only, so its choice never depends on the rest of the batch.

The arithmetic is finite for every parameter `validate` accepts: a temperature below
`GREEDY_BELOW` is greedy (llama.cpp's sampler is greedy for `temp <= 0`; dividing by a
subnormal temperature would overflow), and the scaled logits are shifted so the best token
has probability exactly 1 before the filters, which therefore always keep it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Callable

import numpy as np

from panechat.engine.serving.invalid_request import InvalidRequest

Sampler = Callable[[np.ndarray], int]

GREEDY_BELOW = 1e-5  # temperatures in [0, GREEDY_BELOW) mean greedy
MAX_TEMPERATURE = 10.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_REPEAT_PENALTY = 10.0
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs limit


class SamplingError(ValueError):
    """This sequence's logits cannot be sampled (NaN or +inf from the model); the engine
    fails that request alone."""


def _is_real(v) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_bias(b) -> bool:
    return isinstance(b, Mapping) and all(
        _is_int(t) and t >= 0 and _is_real(v) and math.isfinite(v) and abs(v) <= MAX_LOGIT_BIAS
        for t, v in b.items())


@dataclass(frozen=True)
class Bound:
    """What `SamplingParams` accepts for one field: an integer or a finite real number in
    [lo, hi] (either end open where `lo_open`/`hi_open`; no `hi`: unbounded above). The
    server's request schema (app/server/request_schema.py) shows and checks the same bound."""

    integer: bool
    lo: float
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""  # what a special value means, said after the range

    @property
    def range(self) -> str:
        """The range in words: "in (0, 1]", "an integer >= 1 (...)"."""
        if self.hi is None:
            span = f"{'>' if self.lo_open else '>='} {self.lo:g}"
        else:
            span = f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        words = f"an integer {span}" if self.integer else f"in {span}"
        return f"{words} ({self.note})" if self.note else words

    def problem(self, v) -> str | None:
        """Why `v` is refused ("must be ..."), or None when it is accepted."""
        if self.integer and not _is_int(v):
            return f"must be {self.range}"
        if not self.integer and (not _is_real(v) or not math.isfinite(v)):
            return "must be a finite number"
        below = v <= self.lo if self.lo_open else v < self.lo
        above = self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi)
        return f"must be {self.range}" if below or above else None


#: Each field's bound, in the order `validate` checks them (seed may also be None).
BOUNDS: dict[str, Bound] = {
    "temperature": Bound(False, 0.0, MAX_TEMPERATURE, note=f"below {GREEDY_BELOW:g} means greedy"),
    "top_k": Bound(True, 0, note="0 disables it"),
    "top_p": Bound(False, 0.0, 1.0, lo_open=True),
    "min_p": Bound(False, 0.0, 1.0, hi_open=True),
    "seed": Bound(True, 0),
    "max_tokens": Bound(True, 1),
    "presence_penalty": Bound(False, -2.0, 2.0, note="0 disables it"),
    "frequency_penalty": Bound(False, -2.0, 2.0, note="0 disables it"),
    "repeat_penalty": Bound(False, 0.0, MAX_REPEAT_PENALTY, lo_open=True, note="1 disables it"),
    "repeat_last_n": Bound(True, -1, note="-1: every generated token, 0 disables it"),
}

#: The bound of the number of alternatives a logprobs request may ask for (OpenAI's 20).
LOGPROBS_BOUND = Bound(True, 0, MAX_TOP_LOGPROBS)


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler; a temperature below GREEDY_BELOW (0 included)
    means greedy. `logit_bias` (token id -> bias added to its logit) and the penalties are
    applied by logits processors before the sampler (logits_processors.py): presence and
    frequency as OpenAI defines them, repeat_penalty over the last repeat_last_n tokens as
    llama.cpp does, all over the generated tokens. `logprobs` (None: off) asks for each
    generated token's log-probability and that many alternatives; `prompt_logprobs` the
    same for every prompt token after the first (logprobs.py)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = field(default=None, hash=False)  # llguidance grammar (grammar.py); its mask applies
    speculate: bool = True  # may decode with draft tokens (speculation.py; the tokens are the same either way)

    def validate(self) -> None:
        """Raise InvalidRequest (one line, naming the field) for a parameter outside its
        `BOUNDS`: floats must be finite and in range, integers must be integers (any size;
        max_tokens is further capped by the context). The engine's own defence: the
        sampler's arithmetic is finite only within them."""
        for name, bound in BOUNDS.items():
            v = getattr(self, name)
            why = None if name == "seed" and v is None else bound.problem(v)
            if why is not None:
                raise InvalidRequest(f"{name} {why}", param=name)
        if self.logit_bias is not None and not _is_bias(self.logit_bias):
            raise InvalidRequest(f"logit_bias must map token ids (integers >= 0) to numbers in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", param="logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            why = None if v is None else LOGPROBS_BOUND.problem(v)
            if why is not None:
                raise InvalidRequest(f"{name} {why}", param=name)
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidRequest("grammar must be a string (an llguidance grammar)", param="grammar")

    @property
    def greedy(self) -> bool:
        """True when the sampler takes the argmax (temperature below GREEDY_BELOW)."""
        return self.temperature < GREEDY_BELOW


class RowSampler:
    """One request's sampler: called with its logits [V] on the host -> token id (raises
    SamplingError when the logits hold NaN or +inf); also what a backend that samples on
    the device needs (`device_seed`: the request's 64-bit key, its own seed or a random
    one; the step is the number of tokens generated so far) and `device_pick`, the same
    error check for a token picked there."""

    __slots__ = ("params", "device_seed", "_rng")

    def __init__(self, params: SamplingParams):
        self.params = params
        self._rng = None if params.greedy else np.random.default_rng(params.seed)
        seed = params.seed if params.seed is not None else int(np.random.default_rng().integers(2**63))
        self.device_seed = seed % 2**64

    def __call__(self, logits: np.ndarray) -> int:
        if self._rng is None:
            return _greedy(logits)
        return _sample(logits, self.params, self._rng)

    @staticmethod
    def device_pick(pick: np.ndarray) -> int:
        """The token of a device pick (token, bad), or SamplingError when bad."""
        if pick[1]:
            raise _bad_logits()
        return int(pick[0])


def make_sampler(params: SamplingParams) -> RowSampler:
    """A callable logits[V] -> token id (greedy for a tiny temperature); it raises
    SamplingError when the logits hold NaN or +inf."""
    return RowSampler(params)


def device_sampling_rows(samplers: list[RowSampler], steps: list[int]) -> tuple[np.ndarray, ...]:
    """The per-row arrays `Backend.sample_rows` takes (temperature 0 for greedy, top_p,
    min_p, top_k, seeds, steps), built once per step."""
    ps = [s.params for s in samplers]
    return (np.array([0.0 if p.greedy else p.temperature for p in ps], np.float32),
            np.array([p.top_p for p in ps], np.float32), np.array([p.min_p for p in ps], np.float32),
            np.array([min(p.top_k, 2**31 - 1) for p in ps], np.int32),
            np.array([s.device_seed for s in samplers], np.uint64), np.asarray(steps, np.int64))


def _greedy(logits: np.ndarray) -> int:
    tok = int(np.argmax(logits))
    if not math.isfinite(logits[tok]):  # argmax lands on a NaN or +inf when there is one
        raise _bad_logits()
    return tok


def _bad_logits() -> SamplingError:
    return SamplingError("the model produced non-finite logits (NaN or inf) for this request")


def _sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    # float64 and temperature >= GREEDY_BELOW: |x| <= 3.4e38 / 1e-5, so no overflow
    x = logits.astype(np.float64) / p.temperature
    top = x.max()  # NaN when any logit is NaN
    if not math.isfinite(top):
        raise _bad_logits()
    probs = np.exp(x - top)  # relative to the best token, whose entry is exactly 1.0
    if p.min_p > 0.0:  # keep tokens at least min_p times as likely as the best (1.0 > min_p: kept)
        probs[probs < p.min_p] = 0.0
    if 0 < p.top_k < probs.size:
        cut = np.partition(probs, probs.size - p.top_k)[probs.size - p.top_k]
        probs[probs < cut] = 0.0
    probs /= probs.sum()  # the sum is >= 1: the best token's 1.0 survives every filter
    if p.top_p < 1.0:
        probs = _nucleus(probs, p.top_p)
    return int(rng.choice(probs.size, p=probs))


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Zero all but the smallest most-likely set whose mass reaches top_p (exact; always
    at least the best token, so a tiny top_p means "the best token only").

    Sorting the whole vocabulary per token is slow, so look at the 256 most likely first;
    only when their mass falls short of top_p is the full sort needed."""
    k = min(256, probs.size)
    cand = np.argpartition(-probs, k - 1)[:k]
    if probs[cand].sum() < top_p:
        cand = np.arange(probs.size)
    cand = cand[np.argsort(-probs[cand], kind="stable")]
    keep = cand[: int(np.searchsorted(np.cumsum(probs[cand]), top_p)) + 1]
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()
