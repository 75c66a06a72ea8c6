"""One thread's share of a product with weights read as stored: output columns c0..c1 of
x @ W.T, for the crew threads of the one-call decode step (`cpu_decoder`).

The columns are computed by `block_linear`'s own paths (register tiles up to
REG_MAX_ROWS rows, dequantized float32 panels above), so every output element has the
bits `quant_kernels.linear_block32` / `linear_kquant` give it: which thread computes a
column, and with which neighbours, never changes its arithmetic. `product_range` picks
the block type by a small integer code (`QTYPE_CODES`), so one compiled step serves a
file of mixed types (Q4_K_M mixes Q4_K and Q6_K); each type is its own cached function.

numba's cache keys a function on its own module's file only: after editing
`block_linear` or `quant_kernels`, delete backends/__pycache__/block_tasks.*.nbi/.nbc too.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .block_linear import PAIR, PANEL_COLS, REG_MAX_ROWS, _dequantize_panel, _load_panel, _register_panel
from .numpy_kernels import _COLS_PER_TASK, _JIT, _STREAM_MAX_ROWS, TILE_N, _column_panel
from .quant_kernels import (_pair_q4_0, _pair_q4_1, _pair_q4_k, _pair_q5_0, _pair_q5_1, _pair_q5_k, _pair_q6_k,
                            _pair_q8_0)

QTYPE_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}


@njit(inline="always", **_JIT)
def split_unit(M):
    """Columns a share is a multiple of (the tile or panel width of M rows)."""
    if M <= REG_MAX_ROWS:
        return TILE_N
    return PANEL_COLS if M <= _STREAM_MAX_ROWS else _COLS_PER_TASK


@njit(inline="always", **_JIT)
def share(N, M, tid, n):
    """Columns (c0, c1) of N that thread tid of n computes: whole tiles, as even as can be."""
    u = split_unit(M)
    T = (N + u - 1) // u
    return min(N, T * tid // n * u), min(N, T * (tid + 1) // n * u)


@njit(inline="always", **_JIT)
def _range(x, w, wd, wdm, out, c0, c1, load2):
    M, K = x.shape
    if c1 <= c0:
        return
    if M <= REG_MAX_ROWS:
        _register_panel(x, w, wd, wdm, out, c0, c1, load2, w.shape[1] * PAIR // K)
        return
    cols = split_unit(M)
    buf = np.empty((cols, K), np.float32)
    for n0 in range(c0, c1, cols):
        n1 = min(n0 + cols, c1)
        _dequantize_panel(w, wd, wdm, n0, n1, load2, buf)
        _column_panel(x, buf, n0, n0, out, n0, n1, _load_panel, False)


@njit(**_JIT)
def _range_q8_0(x, w, wd, wdm, out, c0, c1):
    _range(x, w, wd, wdm, out, c0, c1, _pair_q8_0)


@njit(**_JIT)
def _range_q4_0(x, w, wd, wdm, out, c0, c1):
    _range(x, w, wd, wdm, out, c0, c1, _pair_q4_0)


@njit(**_JIT)
def _range_q4_1(x, w, wd, wdm, out, c0, c1):
    _range(x, w, wd, wdm, out, c0, c1, _pair_q4_1)


@njit(**_JIT)
def _range_q5_0(x, w, wd, wdm, out, c0, c1):
    _range(x, w, wd, wdm, out, c0, c1, _pair_q5_0)


@njit(**_JIT)
def _range_q5_1(x, w, wd, wdm, out, c0, c1):
    _range(x, w, wd, wdm, out, c0, c1, _pair_q5_1)


@njit(**_JIT)
def _range_q4_k(x, w, wd, wdm, out, c0, c1):
    _range(x, w, wd, wdm, out, c0, c1, _pair_q4_k)


@njit(**_JIT)
def _range_q5_k(x, w, wd, wdm, out, c0, c1):
    _range(x, w, wd, wdm, out, c0, c1, _pair_q5_k)


@njit(**_JIT)
def _range_q6_k(x, w, wd, wdm, out, c0, c1):
    _range(x, w, wd, wdm, out, c0, c1, _pair_q6_k)


@njit(**_JIT)
def product_range(code, x, w, wd, wdm, out, c0, c1):
    """out[:, c0:c1] = (x @ W.T)[:, c0:c1] for W of block type `code` (QTYPE_CODES): `w` its
    stored bytes [N, bytes per row]; `wd`, `wdm` the K-quants' float32 d and dmin
    (`quant_kernels.superblock_scales`; any float32 2-d array for the other types)."""
    if code == 0:
        _range_q8_0(x, w, wd, wdm, out, c0, c1)
    elif code == 1:
        _range_q4_0(x, w, wd, wdm, out, c0, c1)
    elif code == 2:
        _range_q4_1(x, w, wd, wdm, out, c0, c1)
    elif code == 3:
        _range_q5_0(x, w, wd, wdm, out, c0, c1)
    elif code == 4:
        _range_q5_1(x, w, wd, wdm, out, c0, c1)
    elif code == 5:
        _range_q4_k(x, w, wd, wdm, out, c0, c1)
    elif code == 6:
        _range_q5_k(x, w, wd, wdm, out, c0, c1)
    else:
        _range_q6_k(x, w, wd, wdm, out, c0, c1)
