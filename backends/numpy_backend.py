"""The numpy (CPU) backend.

Kernel policy: OpenBLAS sgemm is fast but its rows are not batch-invariant (an output
row changes in the last bits with the number of rows and the row's position), so
`linear` and `attend` run numba kernels from `numpy_kernels` whose per-element
arithmetic is fixed by the source. Elementwise ops and per-row reductions use numpy.
"""

from __future__ import annotations

import os

import numpy as np

from .array_backend import ArrayBackend, ArrayKV


class NumpyBackend(ArrayBackend):
    """CPU arrays with numpy; batch-invariant matmul and attention kernels."""

    name = "numpy"

    def __init__(self, kernels: str = "auto"):
        self.kernels = _load_kernels() if kernels != "gemv" else None

    def describe(self) -> str:
        threads = os.environ.get("NUMBA_NUM_THREADS") or os.cpu_count()
        policy = "numba row-invariant kernels" if self.kernels else "stacked GEMV (OpenBLAS)"
        return f"numpy on CPU ({threads} threads), {policy}"

    def linear_weight(self, w: np.ndarray, qtype: str = "F32") -> np.ndarray:
        return np.ascontiguousarray(w, dtype=np.float32)

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x)
        if self.kernels is not None:
            out = np.empty((x.shape[0], w.shape[0]), np.float32)
            self.kernels.linear(x, w, out)
            return out
        # A stacked GEMV: one BLAS gemv per row, identical to the row computed alone.
        return np.matmul(w, x[:, :, None])[:, :, 0]

    def attend(self, kv: ArrayKV, layer, q, k, v, slots, positions, scale):
        self.write_kv(kv, layer, k, v, slots, positions)
        kc, vc = kv.k[layer], kv.v[layer]
        out = np.empty_like(q)
        if self.kernels is not None:
            self.kernels.attention(q, kc, vc, slots.astype(np.int32), positions.astype(np.int32),
                                   np.float32(scale), out)
            return out
        n_rep = q.shape[1] // kc.shape[1]
        for r in range(q.shape[0]):  # reference path: one row at a time
            keys = np.repeat(kc[slots[r], :, : positions[r] + 1], n_rep, axis=0)  # (H, L, hd)
            vals = np.repeat(vc[slots[r], :, : positions[r] + 1], n_rep, axis=0)
            s = np.matmul(keys, q[r][:, :, None])[:, :, 0] * np.float32(scale)  # (H, L)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[r] = np.matmul(vals.transpose(0, 2, 1), p[:, :, None])[:, :, 0]
        return out

    def self_check(self) -> str | None:
        if self.kernels is not None:
            return self.kernels.self_check()
        return None


def _load_kernels():
    try:
        from . import numpy_kernels
    except ImportError:
        return None
    return numpy_kernels
