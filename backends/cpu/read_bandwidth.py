"""The machine's streaming read bandwidth, measured the way the kernels read weights:
`numba` threads each summing a contiguous share of a large array with 512-bit loads
(four independent vector sums, so the adds never limit the loads). For benchmarks only
(`panechat bench kernels`): a product's GB/s means something next to this figure."""

from __future__ import annotations

import time

import numpy as np
from numba import njit, prange

from panechat.backends.cpu.numpy_kernels import _JIT, LANES, vadd, vload, vsum, vzero


@njit(parallel=True, **_JIT)
def _read_all(a, parts, sums):
    """sums[p] = a sum over share p of `a` (float32, length a multiple of 64 * parts)."""
    share = a.size // parts
    for p in prange(parts):
        s0 = s1 = s2 = s3 = vzero()
        for i in range(p * share, (p + 1) * share, 4 * LANES):
            s0, s1 = vadd(s0, vload(a, i)), vadd(s1, vload(a, i + LANES))
            s2, s3 = vadd(s2, vload(a, i + 2 * LANES)), vadd(s3, vload(a, i + 3 * LANES))
        sums[p] = vsum(vadd(vadd(s0, s1), vadd(s2, s3)))


def read_bandwidth(nbytes: int = 1 << 30, threads: int = 0, rounds: int = 5, clock=time.perf_counter) -> float:
    """GB/s (1e9 bytes a second) of reading `nbytes` (rounded to whole 64-float pieces) once,
    the best of `rounds` after one warm-up pass, on `threads` shares (0: numba's count)."""
    import numba

    parts = threads or numba.get_num_threads()
    n = nbytes // 4 // (64 * parts) * (64 * parts)
    a = np.ones(n, np.float32)  # written once, so every page is resident before timing
    sums = np.empty(parts, np.float32)
    _read_all(a, parts, sums)
    best = float("inf")
    for _ in range(rounds):
        t0 = clock()
        _read_all(a, parts, sums)
        best = min(best, clock() - t0)
    return a.nbytes / best / 1e9
