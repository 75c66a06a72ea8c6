"""Backend operations shared by numpy and CuPy through one array-module seam (`xp`).

Everything here is elementwise or a per-row reduction, so it is row-invariant on any
array module; the subclasses supply `linear` and `attend`, where the kernel policy lives.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from panechat.backends.base import Array, Backend
from panechat.backends.paged_kv import BLOCK_TOKENS, PagedKV, kv_dtype_bytes
from panechat.backends.quant.gguf_tensor import GGUFTensor
from panechat.backends.self_check import CheckPlan, check_batch_invariance


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

    def new_paged_kv(self, n_blocks, n_layer, n_kv, head_dim, dtype="f16") -> PagedKV:
        xp = self.xp
        dt = xp.float16 if kv_dtype_bytes(dtype) == 2 else xp.float32
        shape = (n_blocks, n_kv, BLOCK_TOKENS, head_dim)
        return PagedKV([xp.zeros(shape, dt) for _ in range(n_layer)],
                       [xp.zeros(shape, dt) for _ in range(n_layer)], n_blocks, n_kv, head_dim, dtype)

    def write_kv(self, kv: PagedKV, layer: int, k: Array, v: Array, seqs: Array, positions: Array,
                 tables: Array | None = None) -> None:
        t = kv.slot_table if tables is None else tables
        blocks, offs = t[seqs, positions // BLOCK_TOKENS], positions % BLOCK_TOKENS
        kv.k[layer][blocks, :, offs, :] = k  # rounded to the store's dtype (nearest even)
        kv.v[layer][blocks, :, offs, :] = v

    def contiguous_kv(self, kv: PagedKV, layer: int, tables: Array | None) -> tuple[Array, Array]:
        """K and V of every sequence of `tables` gathered in position order as float32
        [S, n_kv, max_blocks * B, hd] (exact conversion), for kernels that take a
        contiguous cache; entries past a sequence's blocks (-1 in a table) are garbage
        that no row reads."""
        xp = self.xp
        t = kv.slot_table if tables is None else tables
        S, nb = t.shape
        out = []
        for store in (kv.k[layer], kv.v[layer]):
            g = store[t]  # (S, nb, n_kv, B, hd)
            g = g.transpose(0, 2, 1, 3, 4).reshape(S, kv.n_kv, nb * BLOCK_TOKENS, kv.head_dim)
            out.append(xp.ascontiguousarray(g.astype(xp.float32)))
        return out[0], out[1]

    def self_check(self, weights: Sequence[GGUFTensor] = ()) -> str | None:
        return check_batch_invariance(self, self.check_plan, weights=weights)
