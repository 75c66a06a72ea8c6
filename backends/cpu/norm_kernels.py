"""RMS norm as one numba call, with the bits of `ArrayBackend.rms_norm`'s numpy expression.

``x * (1.0 / sqrt(mean(x * x, axis=-1, dtype=float32) + eps)) * weight`` is seven numpy
calls and as many temporaries (~9 us a row of 576 on the dev machine, 61 calls a step).
This kernel performs the same float32 operations on each element in the same order:

* each square x*x rounded to float32;
* their sum as numpy's add.reduce computes it along a contiguous row: the pairwise sum of
  numpy's `FLOAT_pairwise_sum` (runs under 8 summed in order; up to 128 in 8 interleaved
  partial sums combined ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the tail in order; longer
  runs split in two at a multiple of 8 below the middle), added to a zero start;
* the mean as numpy's `_mean` divides: the float32 sum by the item count (an intp) in
  float64, rounded to float32;
* ms + eps, sqrt, 1 / that, x * inv, then * weight, each rounded to float32 (no FMA: no
  fast-math).

tests/backends/test_norm_kernels.py checks it equals the numpy expression bit for bit
over row lengths from 1 to 4096 and 1..33 rows.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

_JIT = dict(cache=True, nogil=True)  # never fastmath: it would allow reordering


@njit(**_JIT)
def _leaf(a, o, n):
    """numpy's pairwise sum of a[o : o + n] for n <= 128 (no split)."""
    if n < 8:
        res = np.float32(-0.0)
        for i in range(n):
            res = res + a[o + i]
        return res
    r0, r1, r2, r3 = a[o], a[o + 1], a[o + 2], a[o + 3]
    r4, r5, r6, r7 = a[o + 4], a[o + 5], a[o + 6], a[o + 7]
    end = n - n % 8
    for i in range(8, end, 8):
        b = o + i
        r0, r1, r2, r3 = r0 + a[b], r1 + a[b + 1], r2 + a[b + 2], r3 + a[b + 3]
        r4, r5, r6, r7 = r4 + a[b + 4], r5 + a[b + 5], r6 + a[b + 6], r7 + a[b + 7]
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for i in range(end, n):
        res = res + a[o + i]
    return res


@njit(**_JIT)
def _pairwise(a, n, task_o, task_n, vals):
    """numpy's pairwise sum of the float32 values a[0 : n]: runs over 128 split in two at
    n2 = n // 2 rounded down to a multiple of 8, left + right. Written with an explicit
    stack (numba's cache mishandles recursive functions): tasks (o, n) to sum, n = -1
    meaning "add the two values on top of `vals`"."""
    nt, nv = 1, 0
    task_o[0], task_n[0] = 0, n
    while nt:
        nt -= 1
        o, m = task_o[nt], task_n[nt]
        if m < 0:
            nv -= 1
            vals[nv - 1] = vals[nv - 1] + vals[nv]
        elif m <= 128:
            vals[nv] = _leaf(a, o, m)
            nv += 1
        else:
            n2 = m // 2
            n2 -= n2 % 8
            task_o[nt], task_n[nt] = 0, -1  # popped last: left + right
            task_o[nt + 1], task_n[nt + 1] = o + n2, m - n2
            task_o[nt + 2], task_n[nt + 2] = o, n2  # popped first
            nt += 3
    return vals[0]


@njit(**_JIT)
def _rms_norm_row(x, weight, eps, out, sq, task_o, task_n, vals):
    """One row (float32 [D]) of `_rms_norm`; sq [D], task_o, task_n, vals: its scratch."""
    D = x.shape[0]
    for d in range(D):
        sq[d] = x[d] * x[d]
    total = np.float32(0.0) + _pairwise(sq, D, task_o, task_n, vals)
    ms = np.float32(np.float64(total) / np.float64(D))
    inv = np.float32(1.0) / np.float32(math.sqrt(ms + eps))
    for d in range(D):
        out[d] = (x[d] * inv) * weight[d]


@njit(**_JIT)
def _rms_norm(x, weight, eps, out):
    """Row by row (see `activation_kernels.gated_columns`: a loop nest over rows and
    columns may lose its vector code to LLVM's overlap checks over all the rows)."""
    R, D = x.shape
    sq = np.empty(D, np.float32)
    task_o, task_n = np.empty(192, np.int64), np.empty(192, np.int64)  # 3 per level: ample
    vals = np.empty(64, np.float32)
    for r in range(R):
        _rms_norm_row(x[r], weight, eps, out[r], sq, task_o, task_n, vals)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis of float32 x (C-contiguous, any
    leading shape) with float32 weight [D]: `ArrayBackend.rms_norm`'s bits."""
    if x.dtype != np.float32 or weight.dtype != np.float32 or not x.flags.c_contiguous \
            or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: float32 C-contiguous x [..., D] and weight [D], got x {x.dtype}{x.shape} "
                         f"weight {weight.dtype}{weight.shape}")
    out = np.empty_like(x)
    if x.ndim == 2:
        _rms_norm(x, np.ascontiguousarray(weight), np.float32(eps), out)
    else:
        D = x.shape[-1]
        _rms_norm(x.reshape(-1, D), np.ascontiguousarray(weight), np.float32(eps), out.reshape(-1, D))
    return out
