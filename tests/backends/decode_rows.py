"""One decode step's inputs for the attention tests: R rows, each its own sequence."""

from __future__ import annotations

import numpy as np

from panechat.backends.paged_kv import BLOCK_TOKENS


def decode_rows(rng: np.random.Generator, R: int, H: int, G: int, D: int, S: int, nb: int) -> tuple:
    """(q [R, H, D], k [R, G, D], v [R, G, D], seqs, positions): R distinct sequences of the
    S, each at a random position within nb blocks."""
    q = rng.standard_normal((R, H, D), dtype=np.float32)
    k = rng.standard_normal((R, G, D), dtype=np.float32)
    v = rng.standard_normal((R, G, D), dtype=np.float32)
    seqs = rng.choice(S, R, replace=False).astype(np.int32)
    poss = rng.integers(0, nb * BLOCK_TOKENS, R).astype(np.int32)
    return q, k, v, seqs, poss
