"""Logits processors: per-request steps that change a row's logits before its token is
picked (a grammar's token mask, penalties, logit_bias).

A processor sees its own request's row and tokens only, so it cannot make one row depend
on another: a request's tokens stay the same alone and batched (vLLM v1 applies its
processors to the whole batch; per row, the promise holds by construction). Rows without
processors are never touched, and a step where no row has any does no work at all.

Where the logits are: on the host (numpy, MLX) the processors change the step's numpy
logits before the host sampler; where the backend samples on the device (CuPy), they
change the device rows (through the array module `xp`) before the device pick, so only
token ids cross to the host either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from panechat.engine.serving.invalid_request import InvalidRequest
from panechat.engine.serving.sampling import SamplingParams


class LogitsProcessor(Protocol):
    """One request's change to its logits, applied before each of its tokens is picked."""

    def apply(self, logits: Any, output_ids: Sequence[int], xp: ModuleType) -> None:
        """Change `logits` [V] (float32, this request's row of the step; numpy or a device
        array of array module `xp`) in place. `output_ids`: the tokens generated so far
        (read only). A processor keeping state (a grammar) advances from them. One may
        also have `prefetch(output_ids)`, called once the step's token is appended, to start
        the next step's work while the next forward pass runs (grammar.py)."""


class LogitBias:
    """OpenAI's `logit_bias`: add a fixed bias to some tokens' logits (-100 bans a token,
    100 all but forces it)."""

    def __init__(self, bias: Mapping[int, float]):
        self.ids = np.fromiter(bias.keys(), np.int64, len(bias))
        self.values = np.fromiter(bias.values(), np.float32, len(bias))
        self._on: tuple[ModuleType, Any, Any] | None = None  # (xp, ids, values) on that module

    def apply(self, logits: Any, output_ids: Sequence[int], xp: ModuleType) -> None:
        if self._on is None or self._on[0] is not xp:  # copied to the device once, not per token
            self._on = (xp, xp.asarray(self.ids), xp.asarray(self.values))
        _, ids, values = self._on
        logits[ids] += values  # float32 + float32: the same bits on the host and the device


class RepeatPenalty:
    """llama.cpp's `repeat_penalty` over the last `last_n` generated tokens (-1: all): each
    distinct one has a positive logit divided by the penalty, a negative one multiplied."""

    def __init__(self, penalty: float, last_n: int):
        self.penalty = np.float32(penalty)
        self.last_n = last_n

    def apply(self, logits: Any, output_ids: Sequence[int], xp: ModuleType) -> None:
        window = output_ids if self.last_n < 0 else output_ids[len(output_ids) - self.last_n:]
        if not window:
            return
        ids = xp.asarray(np.unique(np.asarray(window, np.int64)))
        x = logits[ids]
        logits[ids] = xp.where(x <= 0, x * self.penalty, x / self.penalty)  # float32 either way


class CountPenalty:
    """OpenAI's `frequency_penalty` and `presence_penalty` over the generated tokens: a
    token's logit loses count * frequency + (count > 0) * presence. The counts are kept as
    the tokens come (each token read once)."""

    def __init__(self, frequency: float, presence: float):
        self.frequency, self.presence = np.float32(frequency), np.float32(presence)
        self._counts: dict[int, int] = {}
        self._seen = 0

    def apply(self, logits: Any, output_ids: Sequence[int], xp: ModuleType) -> None:
        for t in output_ids[self._seen:]:
            self._counts[t] = self._counts.get(t, 0) + 1
        self._seen = len(output_ids)
        if not self._counts:
            return
        n = len(self._counts)
        ids = np.fromiter(self._counts.keys(), np.int64, n)
        delta = np.fromiter(self._counts.values(), np.float32, n) * self.frequency + self.presence
        logits[xp.asarray(ids)] -= xp.asarray(delta)  # float32 - float32: the same bits everywhere


def penalty_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The penalty processors `params` asks for (none at their neutral values), in
    llama.cpp's order: repeat, then frequency and presence."""
    out: list[LogitsProcessor] = []
    if params.repeat_penalty != 1.0 and params.repeat_last_n != 0:
        out.append(RepeatPenalty(params.repeat_penalty, params.repeat_last_n))
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        out.append(CountPenalty(params.frequency_penalty, params.presence_penalty))
    return out


def make_processors(params: SamplingParams, vocab_size: int) -> tuple[LogitsProcessor, ...]:
    """The processors a request's parameters ask for, in the order they apply (fresh
    objects per request: they may keep state). InvalidRequest (one line, the client's
    mistake: a 400, not a 500) for a token id outside the vocabulary."""
    out: list[LogitsProcessor] = []
    if params.logit_bias:
        bad = [t for t in params.logit_bias if t >= vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias names token {max(bad)} but the vocabulary holds ids 0 to "
                                 f"{vocab_size - 1}", param="logit_bias")
        out.append(LogitBias(params.logit_bias))
    out.extend(penalty_processors(params))
    return tuple(out)


class StepProcessors:
    """The processors of one step's sampled rows: `(logits, xp)` applies each row's own, in
    order, to that row alone. A row whose processor raised is remembered (`check`) so
    that it fails alone; the other rows go on."""

    __slots__ = ("rows", "failed")

    def __init__(self, rows: list[tuple[int, tuple[LogitsProcessor, ...], Sequence[int]]]):
        self.rows = rows  # (logit row, its processors, its tokens so far)
        self.failed: dict[int, Exception] = {}

    def __call__(self, logits: Any, xp: ModuleType) -> None:
        """Apply to the step's logits [L, V] in place (numpy, or the device's `xp`)."""
        for i, procs, output_ids in self.rows:
            row = logits[i]  # a view: the changes land in the step's logits
            try:
                for p in procs:
                    p.apply(row, output_ids, xp)
            except Exception as e:  # this row's alone
                self.failed[i] = e

    def prefetch(self) -> None:
        """Let each row's processors that can start their next step's work now (the step's
        tokens are appended); a failure is left for that row's next `apply` to meet."""
        for _, procs, output_ids in self.rows:
            for p in procs:
                start = getattr(p, "prefetch", None)
                if start is not None:
                    start(output_ids)

    def check(self, i: int) -> None:
        """Raise what row `i`'s processors raised, if anything."""
        e = self.failed.get(i)
        if e is not None:
            raise e


def step_processors(rows: Sequence[tuple[tuple[LogitsProcessor, ...], Sequence[int]]]) -> StepProcessors | None:
    """From each sampled row's (processors, tokens so far): the step's StepProcessors, or
    None when no row has any (the sampling path is then exactly the one without the seam)."""
    with_procs = [(i, procs, ids) for i, (procs, ids) in enumerate(rows) if procs]
    return StepProcessors(with_procs) if with_procs else None
