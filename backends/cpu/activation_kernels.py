"""The FFN's gated activations on the CPU, element by element in numba: silu(g) * u
(llama, qwen, phi3) and gelu_tanh(g) * u (gemma).

The numpy backend computes them here both per operation (`NumpyBackend.silu_mul`) and
inside the one-call decode step (`decoder`), so the two give the same bits. numpy's
own exp and tanh cannot be matched from numba, and a libm call is not safe in a loop the
vectoriser may split into vector body and scalar tail with other code; so exp is
`numpy_kernels._expf` (Cephes, ~1 ulp, plain IEEE operations only: the same value
vectorised or not), with its argument held below 88 (no overflow), and tanh is formed
from it:

  silu(g) = g / (1 + e^-g)
  tanh(y) = 1 - 2 / (e^2y + 1)

silu is within 4e-7 relative of float64's (for g < -88, where silu is under 1e-35, it
is g / (1 + e^88)); gelu within 1e-6 absolute
(tests/backends/test_activation_kernels.py). Each element depends only on its own g and
u. The loops are compiled with numpy's error model: Python's, the default, checks every
division for zero and keeps the loop from being vectorised (10x slower).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from panechat.backends.cpu.numpy_kernels import _JIT, _expf

_F = np.float32


@njit(**_JIT)
def silu_mul_one(g, u):
    return (g / (_F(1.0) + _expf(min(-g, _F(88.0))))) * u


@njit(**_JIT)
def gelu_mul_one(g, u):
    inner = _F(0.7978845608028654) * (g + _F(0.044715) * g * g * g)  # sqrt(2/pi)
    t = _F(1.0) - _F(2.0) / (_expf(min(_F(2.0) * inner, _F(88.0))) + _F(1.0))
    return _F(0.5) * g * (_F(1.0) + t) * u


@njit(error_model="numpy", **_JIT)
def _gated_row(g, u, o, c0, c1, gelu):
    """o[c0:c1] = act(g) * u there, for one row (float32 [N] each)."""
    if gelu:
        for n in range(c0, c1):
            o[n] = gelu_mul_one(g[n], u[n])
    else:
        for n in range(c0, c1):
            o[n] = silu_mul_one(g[n], u[n])


@njit(error_model="numpy", **_JIT)
def gated_columns(gate, up, out, c0, c1, gelu):
    """out[:, c0:c1] = act(gate) * up there (float32 [R, N] each): one contiguous loop per
    row and activation, which the vectoriser turns into vector code. Row by row through
    `_gated_row`: written as one loop nest over rows and columns, LLVM guarded its vector
    code with overlap checks over all the rows' ranges at once, which some placements of
    three separate buffers failed, so the whole nest ran scalar (4x slower: 1.9 ms of a
    5-row decode step of a 1B model, docs/benchmarks.md). A row's check is plain range
    overlap, which separate buffers never fail."""
    for r in range(gate.shape[0]):
        _gated_row(gate[r], up[r], out[r], c0, c1, gelu)


@njit(parallel=True, error_model="numpy", **_JIT)
def _gated(gate, up, out, gelu):
    for r in prange(gate.shape[0]):
        gated_columns(gate[r:r + 1], up[r:r + 1], out[r:r + 1], 0, gate.shape[1], gelu)


def gated(gate: np.ndarray, up: np.ndarray, gelu: bool) -> np.ndarray:
    """act(gate) * up for float32 gate, up of one shape (act: gelu_tanh or silu)."""
    gate, up = np.ascontiguousarray(gate, np.float32), np.ascontiguousarray(up, np.float32)
    if gate.shape != up.shape:
        raise ValueError(f"gated activation: gate {gate.shape} and up {up.shape} differ")
    out = np.empty_like(gate)
    n = gate.shape[-1] if gate.ndim else 1
    _gated(gate.reshape(-1, n), up.reshape(-1, n), out.reshape(-1, n), gelu)
    return out
