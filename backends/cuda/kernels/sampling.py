"""Sampling on the device: the Philox4x32-10 counter-based generator the `sample_rows`
kernel draws from, and the per-row parameter table it reads (`sampling_table`); the
kernel's contract is the comment above it in sampling.cuh, its emulation
`emulation.emulate_sample_rows`.

Each row is sampled from its own logits and its own (seed, step) alone: the token does not
depend on the batch, and a seeded request gives the same tokens every time. Greedy rows
are exactly the host's `np.argmax` (ties: the lowest index; a NaN or inf there is reported
as bad, which the engine turns into the host's SamplingError). The filters are the host
sampler's (engine/serving/sampling.py: temperature, min-p relative to the best token, top-k with
its ties kept, top-p over the most likely tokens) computed in float32 with thresholds;
the difference from the host: top-p keeps every token tied at the cut (the host breaks
the tie by index), and the random draw is Philox, not numpy's generator, so a seeded
reply on the GPU is reproducible on the GPU but is not the host's reply for that seed.
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def philox_word0(counter: tuple[int, int, int, int], key: tuple[int, int]) -> int:
    """Word 0 of Philox4x32-10(counter, key) (what the kernel's philox_word0 returns)."""
    c0, c1, c2, c3 = (int(c) & _MASK for c in counter)
    k0, k1 = (int(k) & _MASK for k in key)
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        hi0, lo0 = p0 >> 32, p0 & _MASK
        hi1, lo1 = p1 >> 32, p1 & _MASK
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c0


def uniform(seed: int, step: int) -> np.float32:
    """The row's uniform in [0, 1): the top 24 bits of Philox word 0, times 2^-24."""
    w = philox_word0((step, 0, 0, 0), (seed & _MASK, (seed >> 32) & _MASK))
    return _F32(w >> 8) * _F32(2.0 ** -24)


def sampling_table(temperature, top_p, min_p, top_k, seeds, steps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's per-row inputs from per-row lists: fparams float32 [R, 4] (temperature,
    0 for greedy; top_p; min_p; 0), top_k int32 [R], seed_step uint32 [R, 3] (seed low and
    high words, the step: how many tokens the request has generated)."""
    R = len(temperature)
    f = np.zeros((R, 4), np.float32)
    f[:, 0], f[:, 1], f[:, 2] = temperature, top_p, min_p
    seeds = np.asarray(seeds, np.uint64)
    ss = np.empty((R, 3), np.uint32)
    ss[:, 0] = seeds & np.uint64(_MASK)
    ss[:, 1] = seeds >> np.uint64(32)
    ss[:, 2] = np.asarray(steps, np.uint64) & np.uint64(_MASK)
    return f, np.asarray(top_k, np.int32), ss
