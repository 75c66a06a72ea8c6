"""Token sampling: greedy, temperature, top-k, top-p, min-p, each request with its own RNG.

Small factories returning callables, as mlx-lm's `sample_utils.py`. A sampler sees one
sequence's logits only, so its choice never depends on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

Sampler = Callable[[np.ndarray], int]


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256

    def validate(self) -> None:
        """Raise ValueError (one line) for out-of-range parameters."""
        if not (0.0 <= self.temperature <= 10.0):
            raise ValueError("temperature must be between 0 and 10")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if not (0.0 <= self.min_p < 1.0):
            raise ValueError("min_p must be in [0, 1)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise ValueError("seed must be a non-negative integer")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


def make_sampler(params: SamplingParams) -> Sampler:
    """A callable logits[V] -> token id; greedy when temperature is 0."""
    if params.temperature == 0.0:
        return lambda logits: int(np.argmax(logits))
    rng = np.random.default_rng(params.seed)
    return lambda logits: _sample(logits, params, rng)


def _sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    x = logits.astype(np.float64) / p.temperature
    probs = np.exp(x - x.max())
    if p.min_p > 0.0:  # keep tokens at least min_p times as likely as the best one
        probs[probs < p.min_p] = 0.0
    if 0 < p.top_k < probs.size:
        cut = np.partition(probs, probs.size - p.top_k)[probs.size - p.top_k]
        probs[probs < cut] = 0.0
    probs /= probs.sum()
    if p.top_p < 1.0:
        probs = _nucleus(probs, p.top_p)
    return int(rng.choice(probs.size, p=probs))


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Zero all but the smallest most-likely set whose mass reaches top_p (exact).

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
