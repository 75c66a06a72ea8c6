"""Backend operations shared by numpy and CuPy through one array-module seam (`xp`).

Everything here is elementwise or a per-row reduction, so it is row-invariant on any
array module; the subclasses supply `linear` and `attend`, where the kernel policy lives.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Array, Backend
from .self_check import CheckPlan, check_batch_invariance


class ArrayKV:
    """K and V per layer, each [slots, n_kv, ctx, head_dim] float32, on `xp`'s device."""

    def __init__(self, xp: Any, n_slots: int, n_layer: int, n_kv: int, ctx: int, head_dim: int):
        shape = (n_slots, n_kv, ctx, head_dim)
        self.k = [xp.zeros(shape, xp.float32) for _ in range(n_layer)]
        self.v = [xp.zeros(shape, xp.float32) for _ in range(n_layer)]
        self.bytes_per_slot = 2 * n_layer * n_kv * ctx * head_dim * 4


class ArrayBackend(Backend):
    """The forward pass's non-matmul operations written once against `self.xp`."""

    xp: Any = np
    check_plan: CheckPlan = CheckPlan()  # what `self_check` probes; subclasses pick theirs

    def asarray(self, a: np.ndarray) -> Array:
        return self.xp.ascontiguousarray(self.xp.asarray(a))

    def to_numpy(self, a: Array) -> np.ndarray:
        return a if isinstance(a, np.ndarray) else self.xp.asnumpy(a)

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        xp = self.xp
        ms = xp.mean(x * x, axis=-1, keepdims=True, dtype=xp.float32)
        return x * (1.0 / xp.sqrt(ms + xp.float32(eps))) * weight

    def rope(self, x: Array, positions: Array, style: str, tables: tuple[Array, Array]) -> Array:
        cos = tables[0][positions][:, None, :]  # (R, 1, rope_dim/2)
        sin = tables[1][positions][:, None, :]
        half = cos.shape[-1]
        out = x.copy()
        if style == "neox":  # rotate the first half against the second
            a, b = x[..., :half], x[..., half:2 * half]
            out[..., :half] = a * cos - b * sin
            out[..., half:2 * half] = b * cos + a * sin
        else:  # "normal": rotate adjacent pairs
            a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
            out[..., 0:2 * half:2] = a * cos - b * sin
            out[..., 1:2 * half:2] = b * cos + a * sin
        return out

    def silu_mul(self, gate: Array, up: Array) -> Array:
        return gate / (self.xp.float32(1.0) + self.xp.exp(-gate)) * up

    def gelu_mul(self, gate: Array, up: Array) -> Array:
        xp, f = self.xp, self.xp.float32
        inner = f(0.7978845608028654) * (gate + f(0.044715) * gate * gate * gate)  # sqrt(2/pi)
        return f(0.5) * gate * (f(1.0) + xp.tanh(inner)) * up

    def new_kv(self, n_slots, n_layer, n_kv, ctx, head_dim) -> ArrayKV:
        return ArrayKV(self.xp, n_slots, n_layer, n_kv, ctx, head_dim)

    def write_kv(self, kv: ArrayKV, layer: int, k: Array, v: Array, slots: Array, positions: Array) -> None:
        kv.k[layer][slots, :, positions, :] = k
        kv.v[layer][slots, :, positions, :] = v

    def copy_slot(self, kv: ArrayKV, src: int, dst: int, n_tokens: int) -> None:
        for layer in range(len(kv.k)):
            kv.k[layer][dst, :, :n_tokens] = kv.k[layer][src, :, :n_tokens]
            kv.v[layer][dst, :, :n_tokens] = kv.v[layer][src, :, :n_tokens]

    def kv_export(self, kv: ArrayKV, where: int, n_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
        host = self.to_numpy
        return [(np.array(host(kv.k[i][where, :, :n_tokens]), copy=True),
                 np.array(host(kv.v[i][where, :, :n_tokens]), copy=True)) for i in range(len(kv.k))]

    def kv_import(self, kv: ArrayKV, where: int, arrays: list[tuple[np.ndarray, np.ndarray]]) -> None:
        if len(arrays) != len(kv.k):
            raise ValueError(f"KV arrays for {len(arrays)} layers, the cache has {len(kv.k)}")
        for i, (k, v) in enumerate(arrays):
            n = k.shape[1]
            kv.k[i][where, :, :n] = self.xp.asarray(k, dtype=kv.k[i].dtype)
            kv.v[i][where, :, :n] = self.xp.asarray(v, dtype=kv.v[i].dtype)

    def self_check(self) -> str | None:
        return check_batch_invariance(self, self.check_plan)
