"""The linear driver for weights read as stored in 32-weight steps (GGUF blocks).

Every block type (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 blocks of 32; the 32-weight sub-blocks of
Q4_K, Q5_K, Q6_K) is read by a *pair loader* ``load2(w, wd, wdm, n, k) -> (lo, hi)``: the
float32 vectors w[n, k:k+16] and w[n, k+16:k+32] for k a multiple of 32, dequantized in
registers to exactly gguf's floats (`quant_kernels`). One call decodes a block's scales
(or a sub-block's scale and min) once for its 32 weights, not once per 16.

Each output element is then reduced exactly as `numpy_kernels.linear` reduces it: lane l
accumulates x[k] * w[k] for k = c*16 + l in increasing c (lo, then hi, block after
block), the fixed halving tree, no K tail (K is a multiple of 32). Only *where* the
floats come from depends on M, never how an element is computed, so a row's bits are the
same at every batch size and position:

* M <= REG_MAX_ROWS (decode): register tiles (1 row x 6 columns; 2 x 6, 3 x 3 or 4 x 3
  for 2, 3 or 4 rows, so a decoded pair serves every row: a 4 x 6 tile with its 8 x
  vectors spills and measured 1.7x slower) take each pair straight from the loader; weights stream from memory once per step, in their stored
  bytes (a Q4_x weight is 4.5-5 bits), prefetched a tile ahead.
* larger M (batched decode, prefill): each task dequantizes its panel of output columns
  once into a float32 scratch (a few KB, in L1/L2, freed after the task) and runs the
  float32 tiles of `numpy_kernels` over every row, so a weight is decoded once per step
  whatever the batch, and a quantized product costs about what a float32 one does.

The kernels that inline these loops are cached in a folder named by a hash of every
source under backends/cpu and backends/quant (backends/cpu/__init__.py), so an edit here
can never leave stale machine code in use.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from panechat.backends.cpu.numpy_kernels import (
    _COLS_PER_TASK,
    _JIT,
    _STREAM_MAX_ROWS,
    _WIDE,
    LANES,
    TILE_N,
    _column_panel,
    _store6,
    column_task,
    column_tasks,
    prefetch,
    vload,
    vmac,
    vstore,
    vsum,
    vzero,
)

PAIR = 2 * LANES  # weights per loader call: a 32-weight block or K-quant sub-block
REG_MAX_ROWS = 4  # up to this many rows weights are dequantized in registers per tile
PANEL_COLS = 12  # output columns a task dequantizes at once when M <= _STREAM_MAX_ROWS


@njit(inline="always", **_JIT)
def _prefetch_next_tile(w, n, k, pf, bpp):
    """Prefetch the next tile's stored bytes for weights k.. (bpp: bytes per 32 weights)."""
    if pf:
        rb = w.shape[1]
        o = (k // PAIR) * bpp
        for j in range(TILE_N, 2 * TILE_N):
            prefetch(w, (n + j) * rb + o)


@njit(inline="always", **_JIT)
def _mac2(a, xl, xh, lh):
    """a + xl * lo + xh * hi, in that order: two 16-weight chunks of one lane's sum."""
    return vmac(vmac(a, xl, lh[0]), xh, lh[1])


@njit(inline="always", **_JIT)
def _rtile_4x3(x, w, wd, wdm, out, m, n, load2, pf, bpp):
    """out[m:m+4, n:n+3], weights dequantized in registers, each pair used by 4 rows
    (12 accumulators and 8 x vectors: a 4x6 tile would not fit the 32 registers)."""
    K = x.shape[1]
    x0, x1, x2, x3 = m * K, (m + 1) * K, (m + 2) * K, (m + 3) * K
    a00 = a01 = a02 = a10 = a11 = a12 = a20 = a21 = a22 = a30 = a31 = a32 = vzero()
    for k in range(0, K, PAIR):
        _prefetch_next_tile(w, n, k, pf, bpp)
        k2 = k + LANES
        l0, h0, l1, h1 = vload(x, x0 + k), vload(x, x0 + k2), vload(x, x1 + k), vload(x, x1 + k2)
        l2, h2, l3, h3 = vload(x, x2 + k), vload(x, x2 + k2), vload(x, x3 + k), vload(x, x3 + k2)
        p = load2(w, wd, wdm, n, k)
        a00, a10, a20, a30 = _mac2(a00, l0, h0, p), _mac2(a10, l1, h1, p), _mac2(a20, l2, h2, p), _mac2(a30, l3, h3, p)
        p = load2(w, wd, wdm, n + 1, k)
        a01, a11, a21, a31 = _mac2(a01, l0, h0, p), _mac2(a11, l1, h1, p), _mac2(a21, l2, h2, p), _mac2(a31, l3, h3, p)
        p = load2(w, wd, wdm, n + 2, k)
        a02, a12, a22, a32 = _mac2(a02, l0, h0, p), _mac2(a12, l1, h1, p), _mac2(a22, l2, h2, p), _mac2(a32, l3, h3, p)
    _store3(out, m, n, a00, a01, a02)
    _store3(out, m + 1, n, a10, a11, a12)
    _store3(out, m + 2, n, a20, a21, a22)
    _store3(out, m + 3, n, a30, a31, a32)


@njit(inline="always", **_JIT)
def _store3(out, m, n, a0, a1, a2):
    out[m, n], out[m, n + 1], out[m, n + 2] = vsum(a0), vsum(a1), vsum(a2)


@njit(inline="always", **_JIT)
def _rtile_1x6(x, w, wd, wdm, out, m, n, load2, pf, bpp):
    """out[m, n:n+6]: one row against six weight rows."""
    K = x.shape[1]
    x0 = m * K
    a0 = a1 = a2 = a3 = a4 = a5 = vzero()
    for k in range(0, K, PAIR):
        _prefetch_next_tile(w, n, k, pf, bpp)
        xl, xh = vload(x, x0 + k), vload(x, x0 + k + LANES)
        a0 = _mac2(a0, xl, xh, load2(w, wd, wdm, n, k))
        a1 = _mac2(a1, xl, xh, load2(w, wd, wdm, n + 1, k))
        a2 = _mac2(a2, xl, xh, load2(w, wd, wdm, n + 2, k))
        a3 = _mac2(a3, xl, xh, load2(w, wd, wdm, n + 3, k))
        a4 = _mac2(a4, xl, xh, load2(w, wd, wdm, n + 4, k))
        a5 = _mac2(a5, xl, xh, load2(w, wd, wdm, n + 5, k))
    _store6(out, m, n, a0, a1, a2, a3, a4, a5)


@njit(inline="always", **_JIT)
def _rtile_2x6(x, w, wd, wdm, out, m, n, load2, pf, bpp):
    """out[m:m+2, n:n+6]: each pair used by 2 rows (12 accumulators, 4 x vectors)."""
    K = x.shape[1]
    x0, x1 = m * K, (m + 1) * K
    a0 = a1 = a2 = a3 = a4 = a5 = b0 = b1 = b2 = b3 = b4 = b5 = vzero()
    for k in range(0, K, PAIR):
        _prefetch_next_tile(w, n, k, pf, bpp)
        k2 = k + LANES
        l0, h0, l1, h1 = vload(x, x0 + k), vload(x, x0 + k2), vload(x, x1 + k), vload(x, x1 + k2)
        p = load2(w, wd, wdm, n, k)
        a0, b0 = _mac2(a0, l0, h0, p), _mac2(b0, l1, h1, p)
        p = load2(w, wd, wdm, n + 1, k)
        a1, b1 = _mac2(a1, l0, h0, p), _mac2(b1, l1, h1, p)
        p = load2(w, wd, wdm, n + 2, k)
        a2, b2 = _mac2(a2, l0, h0, p), _mac2(b2, l1, h1, p)
        p = load2(w, wd, wdm, n + 3, k)
        a3, b3 = _mac2(a3, l0, h0, p), _mac2(b3, l1, h1, p)
        p = load2(w, wd, wdm, n + 4, k)
        a4, b4 = _mac2(a4, l0, h0, p), _mac2(b4, l1, h1, p)
        p = load2(w, wd, wdm, n + 5, k)
        a5, b5 = _mac2(a5, l0, h0, p), _mac2(b5, l1, h1, p)
    _store6(out, m, n, a0, a1, a2, a3, a4, a5)
    _store6(out, m + 1, n, b0, b1, b2, b3, b4, b5)


@njit(inline="always", **_JIT)
def _rtile_3x3(x, w, wd, wdm, out, m, n, load2, pf, bpp):
    """out[m:m+3, n:n+3]: each pair used by 3 rows (9 accumulators, 6 x vectors)."""
    K = x.shape[1]
    x0, x1, x2 = m * K, (m + 1) * K, (m + 2) * K
    a00 = a01 = a02 = a10 = a11 = a12 = a20 = a21 = a22 = vzero()
    for k in range(0, K, PAIR):
        _prefetch_next_tile(w, n, k, pf, bpp)
        k2 = k + LANES
        l0, h0, l1, h1 = vload(x, x0 + k), vload(x, x0 + k2), vload(x, x1 + k), vload(x, x1 + k2)
        l2, h2 = vload(x, x2 + k), vload(x, x2 + k2)
        p = load2(w, wd, wdm, n, k)
        a00, a10, a20 = _mac2(a00, l0, h0, p), _mac2(a10, l1, h1, p), _mac2(a20, l2, h2, p)
        p = load2(w, wd, wdm, n + 1, k)
        a01, a11, a21 = _mac2(a01, l0, h0, p), _mac2(a11, l1, h1, p), _mac2(a21, l2, h2, p)
        p = load2(w, wd, wdm, n + 2, k)
        a02, a12, a22 = _mac2(a02, l0, h0, p), _mac2(a12, l1, h1, p), _mac2(a22, l2, h2, p)
    _store3(out, m, n, a00, a01, a02)
    _store3(out, m + 1, n, a10, a11, a12)
    _store3(out, m + 2, n, a20, a21, a22)


@njit(inline="always", **_JIT)
def _rtile_1x1(x, w, wd, wdm, out, m, n, load2):
    """out[m, n] alone (leftover columns when N % 6 != 0)."""
    K = x.shape[1]
    x0 = m * K
    a = vzero()
    for k in range(0, K, PAIR):
        a = _mac2(a, vload(x, x0 + k), vload(x, x0 + k + LANES), load2(w, wd, wdm, n, k))
    out[m, n] = vsum(a)


@njit(inline="always", **_JIT)
def _register_panel(x, w, wd, wdm, out, n0, n1, load2, bpp):
    """All M (<= REG_MAX_ROWS) rows of out[:, n0:n1], dequantizing in registers."""
    M = x.shape[0]
    n6 = n0 + (n1 - n0) // TILE_N * TILE_N
    m = 0
    if _WIDE and M == 4:
        for n in range(n0, n6, TILE_N):
            _rtile_4x3(x, w, wd, wdm, out, 0, n, load2, True, bpp)
            _rtile_4x3(x, w, wd, wdm, out, 0, n + 3, load2, False, bpp)
        m = 4
    elif _WIDE and M == 3:
        for n in range(n0, n6, TILE_N):
            _rtile_3x3(x, w, wd, wdm, out, 0, n, load2, True, bpp)
            _rtile_3x3(x, w, wd, wdm, out, 0, n + 3, load2, False, bpp)
        m = 3
    elif _WIDE and M == 2:
        for n in range(n0, n6, TILE_N):
            _rtile_2x6(x, w, wd, wdm, out, 0, n, load2, True, bpp)
        m = 2
    for mr in range(m, M):
        for n in range(n0, n6, TILE_N):
            _rtile_1x6(x, w, wd, wdm, out, mr, n, load2, mr == 0, bpp)
    for mr in range(M):
        for n in range(n6, n1):
            _rtile_1x1(x, w, wd, wdm, out, mr, n, load2)


@njit(inline="always", **_JIT)
def _dequantize_panel(w, wd, wdm, n0, n1, load2, buf):
    """buf[n - n0, :] = float32 weight row n for n0 <= n < n1 (gguf's exact floats)."""
    K = buf.shape[1]
    for n in range(n0, n1):
        o = (n - n0) * K
        for k in range(0, K, PAIR):
            lo, hi = load2(w, wd, wdm, n, k)
            _vstore2(buf, o + k, lo, hi)


@njit(inline="always", **_JIT)
def _vstore2(buf, o, lo, hi):
    vstore(buf, o, lo)
    vstore(buf, o + LANES, hi)


@njit(inline="always", **_JIT)
def _load_panel(w, n0, unused, n, k):
    """w[n, k:k+16] from a dequantized panel whose first row is weight row n0."""
    return vload(w, (n - n0) * w.shape[1] + k)


MAX_WEIGHTS = 3  # weights one call may compute (q, k, v), all of one type and K


@njit(inline="always", **_JIT)
def block_linear_driver(x, ws, wds, wdms, outs, count, load2):
    """outs[j][M, N_j] = x[M, K] @ W_j.T for the first `count` (1..3) weights of the
    3-tuples `ws` (stored bytes), `wds`, `wdms` (per-weight scales, as `load2` reads them),
    all read by `load2` (K a multiple of 32): one parallel region over the column panels
    of all of them (see the module docstring for the two paths). Unused tuple entries may
    repeat a used one."""
    M, K = x.shape
    reg = M <= REG_MAX_ROWS
    cols = TILE_N if reg else (PANEL_COLS if M <= _STREAM_MAX_ROWS else _COLS_PER_TASK)
    t1, t2, t3 = column_tasks(outs, count, cols)
    for t in prange(t3):
        j, n0 = column_task(t, t1, t2, cols)
        w, wd, wdm, out = ws[j], wds[j], wdms[j], outs[j]
        n1 = min(n0 + cols, out.shape[1])
        if reg:
            _register_panel(x, w, wd, wdm, out, n0, n1, load2, w.shape[1] * PAIR // K)
        else:
            buf = np.empty((n1 - n0, K), np.float32)
            _dequantize_panel(w, wd, wdm, n0, n1, load2, buf)
            _column_panel(x, buf, n0, n0, out, n0, n1, _load_panel, False)
