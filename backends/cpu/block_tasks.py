"""One thread's share of a product with weights read as stored: output columns c0..c1 of
x @ W.T, for the crew threads of the one-call decode step (`cpu_decoder`).

The columns are computed by `block_linear`'s own paths (register tiles up to
REG_MAX_ROWS rows, dequantized float32 panels above), so every output element has the
bits `quant_kernels.linear_block32` / `linear_kquant` give it: which thread computes a
column, and with which neighbours, never changes its arithmetic. Each block type is its
own C-callable function (`range_function`), compiled on first use and cached; the step
calls them through a table of pointers indexed by a small integer code (`QTYPE_CODES`),
so one compiled step serves a file of mixed types (Q4_K_M mixes Q4_K and Q6_K), and a
model compiles only the types it holds (each takes ~20 s of CPU the first time).

numba's cache keys a function on its own module's file only: after editing
`block_linear` or `quant_kernels`, delete backends/__pycache__/block_tasks.*.nbi/.nbc too.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from numba import cfunc, njit, types

from panechat.backends.cpu.addresses import f32_at, u8_at
from panechat.backends.cpu.block_linear import PAIR, PANEL_COLS, REG_MAX_ROWS, _dequantize_panel, _load_panel, _register_panel
from panechat.backends.cpu.numpy_kernels import _COLS_PER_TASK, _JIT, _STREAM_MAX_ROWS, TILE_N, _column_panel
from panechat.backends.cpu.quant_kernels import (_pair_iq4_nl, _pair_iq4_xs, _pair_q2_k, _pair_q3_k, _pair_q4_0, _pair_q4_1, _pair_q4_k,
                            _pair_q5_0, _pair_q5_1, _pair_q5_k, _pair_q6_k, _pair_q8_0)

QTYPE_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7,
               "IQ4_NL": 8, "IQ4_XS": 9, "Q2_K": 10, "Q3_K": 11}


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


@njit(inline="always", **_JIT)
def _range_at(x_at, M, K, w_at, N, rb, d_at, dmin_at, d_rows, d_cols, out_at, n_out, c0, c1, load2):
    """`_range` on arrays given by address and shape (a C-callable function's arguments)."""
    x, out = numba.carray(f32_at(x_at), (M, K)), numba.carray(f32_at(out_at), (M, n_out))
    w = numba.carray(u8_at(w_at), (N, rb))
    d, dmin = numba.carray(f32_at(d_at), (d_rows, d_cols)), numba.carray(f32_at(dmin_at), (d_rows, d_cols))
    _range(x, w, d, dmin, out, c0, c1, load2)


# One named function per type, not made by a factory: numba's cache keys a function on its
# name and line, so closures from one factory would share (and overwrite) one cache entry.
def _range_q8_0(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _pair_q8_0)


def _range_q4_0(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _pair_q4_0)


def _range_q4_1(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _pair_q4_1)


def _range_q5_0(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _pair_q5_0)


def _range_q5_1(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _pair_q5_1)


def _range_q4_k(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _pair_q4_k)


def _range_q5_k(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _pair_q5_k)


def _range_q6_k(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _pair_q6_k)


def _range_iq4_nl(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _pair_iq4_nl)


def _range_iq4_xs(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _pair_iq4_xs)


def _range_q2_k(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _pair_q2_k)


def _range_q3_k(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _pair_q3_k)


_RANGES = (_range_q8_0, _range_q4_0, _range_q4_1, _range_q5_0, _range_q5_1, _range_q4_k, _range_q5_k, _range_q6_k,
           _range_iq4_nl, _range_iq4_xs, _range_q2_k, _range_q3_k)
RANGE_SIGNATURE = types.void(*[types.int64] * 14)


@functools.cache
def range_function(code: int):
    """The C-callable product over columns c0..c1 for block type `code`, compiled (or read
    from numba's cache) on first use: a model compiles only the types it holds. Arguments,
    all int64: x address, M, K; the blocks' address, N, bytes a row; d and dmin addresses,
    their rows and columns; out's address and columns; c0, c1."""
    return cfunc(RANGE_SIGNATURE, **_JIT)(_RANGES[code])


def range_functions(codes) -> np.ndarray:
    """int64 [len(QTYPE_CODES)]: the address of each type's range function, for
    `decode_step` (`addresses.call_void`); compiled for the codes used, 0 for the rest."""
    used = set(int(c) for c in codes)
    return np.array([range_function(c).address if c in used else 0 for c in range(len(QTYPE_CODES))], np.int64)
