"""One thread's share of a product with weights read as stored: output columns c0..c1 of
x @ W.T, for the crew threads of the one-call decode step (`decoder`).

The columns are computed by `block_linear`'s own paths (register tiles up to
REG_MAX_ROWS rows, dequantized float32 panels above; a type with `cpu_packed` by
`packed32`'s or `packed256`'s over its repacked records, the rows quantized by each
thread), so every output element has the bits `quant_kernels.linear_block32` /
`linear_kquant` / `linear_packed` give it: which thread computes a column, and with which
neighbours, never changes its arithmetic. Each block type is its
own C-callable function (`range_function`, made from the type's registry entry by
`generated`), compiled on first use and cached; the step calls them through a table of
pointers indexed by a small integer code (`step_codes`, from the registry's order),
so one compiled step serves a file of mixed types (Q4_K_M mixes Q4_K and Q6_K), and a
model compiles only the types it holds (each takes ~20 s of CPU the first time).

These functions inline `block_linear` and `quant_kernels`; numba's cache folder is keyed
on a hash of all of backends/cpu and backends/quant (backends/cpu/__init__.py), so an edit
to either starts a fresh cache.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import cfunc, njit, types

from panechat.backends.cpu.addresses import f32_at, u8_at
from panechat.backends.cpu.block_linear import PAIR, PANEL_COLS, REG_MAX_ROWS, _dequantize_panel, _load_panel, _register_panel
from panechat.backends.cpu.numpy_kernels import _COLS_PER_TASK, _JIT, _STREAM_MAX_ROWS, TILE_N, _column_panel
from panechat.backends.cpu.generated import (bind_loader, cacheable, kernel_name, loader_of, packed_activations,
                                            packed_columns_of, uses_amx)
from panechat.backends.cpu.packed32 import quantized_rows as packed_rows
from panechat.backends.cpu.q8k_dot import quantized_rows
from panechat.backends.quant import registry


@njit(inline="always", **_JIT)
def split_unit(M):
    """Columns a share is a multiple of (the tile or panel width of M rows)."""
    if M <= REG_MAX_ROWS:
        return TILE_N
    return PANEL_COLS if M <= _STREAM_MAX_ROWS else _COLS_PER_TASK


@njit(inline="always", **_JIT)
def share(N, M, tid, n, group):
    """Columns (c0, c1) of N that thread tid of n computes: whole tiles (and whole groups of
    `group` columns: 16 for a repacked weight, else 1), as even as can be."""
    u = split_unit(M)
    if group > 1:
        a, b = u, group
        while b:
            a, b = b, a % b
        u = u * group // a  # the least common multiple
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


@njit(inline="always", **_JIT)
def _packed_range_at(x_at, M, K, w_at, N, rb, d_at, dmin_at, d_rows, d_cols, out_at, n_out, c0, c1, columns):
    """`_range_at` for a repacked weight (`packed32`; c0 a multiple of 16, c1 too or N): the
    rows rounded to int16 (each thread its own copy), then `columns`. d and dmin are unused."""
    if c1 <= c0:
        return
    x, out = numba.carray(f32_at(x_at), (M, K)), numba.carray(f32_at(out_at), (M, n_out))
    w = numba.carray(u8_at(w_at), ((N + 15) // 16 * 16, rb))  # the last group's padding included
    xq, xd, xs, sx = packed_rows(x)
    columns(w, xq, xd, xs, sx, out, c0, c1)


@njit(inline="always", **_JIT)
def _packed_q8k_range_at(x_at, M, K, w_at, N, rb, d_at, dmin_at, d_rows, d_cols, out_at, n_out, c0, c1, columns):
    """`_packed_range_at` for a product over Q8_K rows (`packed256`)."""
    if c1 <= c0:
        return
    x, out = numba.carray(f32_at(x_at), (M, K)), numba.carray(f32_at(out_at), (M, n_out))
    w = numba.carray(u8_at(w_at), ((N + 15) // 16 * 16, rb))
    xq, xd, xs = quantized_rows(x)
    columns(w, xq, xd, xs, out, c0, c1)


def _packed_q8k_range_template(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    """Template of the range function of a `cpu_packed` type over Q8_K rows."""
    _packed_q8k_range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _load2)


def _packed_range_template(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    """Template of the range function of a type with `cpu_packed` (`_load2`: its column product)."""
    _packed_range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _load2)


def _range_template(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1):
    """Template of each type's range function (`generated.bind_loader` binds `_load2`)."""
    _range_at(x, M, K, w, N, rb, d, dm, dr, dc, out, n_out, c0, c1, _load2)


_load2 = None  # bound per type
RANGE_SIGNATURE = types.void(*[types.int64] * 14)


def step_codes() -> dict[str, int]:
    """The one-call step's code of each type the CPU keeps in blocks: its position among the
    registry's block types (`range_functions` lists them in the same order)."""
    return {t.name: i for i, t in enumerate(registry.block_types())}


_COMPILED: dict = {}  # registry entry -> its compiled range function


def range_function(t: registry.QuantType):
    """The C-callable product over columns c0..c1 for block type `t`, compiled (or read from
    numba's cache) on first use: a model compiles only the types it holds. Arguments, all
    int64: x address, M, K; the blocks' address, N, bytes a row; d and dmin addresses, their
    rows and columns; out's address and columns; c0, c1."""
    if t not in _COMPILED:
        packed = packed_columns_of(t)
        if not packed:
            template = _range_template
        else:
            template = _packed_q8k_range_template if packed_activations(t) == "q8k" else _packed_range_template
        f = bind_loader(template, kernel_name("_range", t, uses_amx(t)), packed or loader_of(t))
        _COMPILED[t] = cfunc(RANGE_SIGNATURE, **dict(_JIT, cache=cacheable(t)))(f)
    return _COMPILED[t]


def range_functions(codes) -> np.ndarray:
    """int64 [len(step_codes())]: the address of each type's range function, for
    `decode_step` (`addresses.call_void`); compiled for the codes used, 0 for the rest."""
    used = set(int(c) for c in codes)
    return np.array([range_function(t).address if c in used else 0 for c, t in enumerate(registry.block_types())],
                    np.int64)
