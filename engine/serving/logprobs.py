"""Log-probabilities of tokens, as OpenAI's `logprobs` / `top_logprobs` and the legacy
`echo` prompt logprobs report them.

Each comes from one row of logits alone (its log-softmax, in float64), so a row's
logprobs are the same alone and batched, as its tokens are. For a generated token the row
is the one the sampler saw, after the request's logits processors and before the
temperature (vLLM's "processed logprobs"); for a prompt token it is the model's own.
Only rows whose requests ask are read: the others cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the `top` most likely tokens of its row (id,
    logprob), best first (ties by id)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(row: np.ndarray) -> np.ndarray:
    """log softmax of one row of logits [V], in float64 (-inf for a banned token)."""
    x = np.asarray(row, np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def token_logprob(lp: np.ndarray, token: int, k: int) -> TokenLogprob:
    """`token`'s entry of the log-softmax row `lp`, with the row's `k` best tokens."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, lp.size)
        cand = np.argpartition(-lp, k - 1)[:k]
        cand = cand[np.lexsort((cand, -lp[cand]))]
        top = tuple((int(t), float(lp[t])) for t in cand)
    return TokenLogprob(int(token), float(lp[token]), top)


class HostRows:
    """A step's `before_pick` part that keeps host copies of the logit rows `rows` (after
    the processors changed them): for the requests that want logprobs, on a backend that
    samples on the device. On the host the step's logits are read directly instead."""

    __slots__ = ("rows", "host")

    def __init__(self, rows: list[int]):
        self.rows = rows
        self.host: np.ndarray | None = None  # [len(rows), V] once called

    def __call__(self, logits: Any, xp: ModuleType) -> None:
        picked = logits[xp.asarray(np.asarray(self.rows, np.int64))]
        self.host = picked if xp is np else xp.asnumpy(picked)


def prompt_logprobs(logits: np.ndarray, prompt: list[int], first: int, k: int) -> list[TokenLogprob]:
    """The logprobs of prompt tokens first+1 .. first+len(logits) from the logits at
    positions first .. (the row at position p predicts token p+1); rows past the prompt's
    end are ignored."""
    out = []
    for j, row in enumerate(logits):
        p = first + j + 1
        if p >= len(prompt):
            break
        out.append(token_logprob(log_softmax(row), prompt[p], k))
    return out
