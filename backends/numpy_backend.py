"""The numpy (CPU) backend.

Kernel policy: OpenBLAS sgemm is fast but its rows are not batch-invariant (an output
row changes in the last bits with the number of rows and the row's position), so
`linear` and `attend` run numba kernels from `numpy_kernels` whose per-element
arithmetic is fixed by the source. Elementwise ops and per-row reductions use numpy.
"""

from __future__ import annotations

import os

import numpy as np

from .base import Array, Backend


class NumpyKV:
    """K and V per layer, each [slots, n_kv, ctx, head_dim] float32 (zero pages are lazy)."""

    def __init__(self, n_slots: int, n_layer: int, n_kv: int, ctx: int, head_dim: int):
        shape = (n_slots, n_kv, ctx, head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(n_layer)]
        self.v = [np.zeros(shape, np.float32) for _ in range(n_layer)]
        self.bytes_per_slot = 2 * n_layer * n_kv * ctx * head_dim * 4


class NumpyBackend(Backend):
    """CPU arrays with numpy; batch-invariant matmul and attention kernels."""

    name = "numpy"

    def __init__(self, kernels: str = "auto"):
        self.kernels = _load_kernels() if kernels != "gemv" else None

    def describe(self) -> str:
        threads = os.environ.get("NUMBA_NUM_THREADS") or os.cpu_count()
        policy = "numba row-invariant kernels" if self.kernels else "stacked GEMV (OpenBLAS)"
        return f"numpy on CPU ({threads} threads), {policy}"

    def asarray(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a)

    def to_numpy(self, a: np.ndarray) -> np.ndarray:
        return a

    def linear_weight(self, w: np.ndarray, qtype: str = "F32") -> np.ndarray:
        return np.ascontiguousarray(w, dtype=np.float32)

    def embed(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return table[ids]

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x)
        if self.kernels is not None:
            out = np.empty((x.shape[0], w.shape[0]), np.float32)
            self.kernels.linear(x, w, out)
            return out
        # A stacked GEMV: one BLAS gemv per row, identical to the row computed alone.
        return np.matmul(w, x[:, :, None])[:, :, 0]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
        return x * (1.0 / np.sqrt(ms + np.float32(eps))) * weight

    def rope(self, x: Array, positions: Array, style: str) -> Array:
        cos = self._rope_cos[positions][:, None, :]  # (R, 1, rope_dim/2)
        sin = self._rope_sin[positions][:, None, :]
        half = cos.shape[-1]
        out = x.copy()
        if style == "neox":
            a, b = x[..., :half], x[..., half:2 * half]
            out[..., :half] = a * cos - b * sin
            out[..., half:2 * half] = b * cos + a * sin
        else:
            a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
            out[..., 0:2 * half:2] = a * cos - b * sin
            out[..., 1:2 * half:2] = b * cos + a * sin
        return out

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return gate / (np.float32(1.0) + np.exp(-gate)) * up

    def new_kv(self, n_slots, n_layer, n_kv, ctx, head_dim) -> NumpyKV:
        return NumpyKV(n_slots, n_layer, n_kv, ctx, head_dim)

    def attend(self, kv: NumpyKV, layer, q, k, v, slots, positions, scale):
        kc, vc = kv.k[layer], kv.v[layer]
        kc[slots, :, positions, :] = k
        vc[slots, :, positions, :] = v
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

    def copy_slot(self, kv: NumpyKV, src: int, dst: int, n_tokens: int) -> None:
        for layer in range(len(kv.k)):
            kv.k[layer][dst, :, :n_tokens] = kv.k[layer][src, :, :n_tokens]
            kv.v[layer][dst, :, :n_tokens] = kv.v[layer][src, :, :n_tokens]

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
