"""Launching the tensor-core (MMA) products (mma_source.py) on a cupy.RawModule or the
numpy model (EmulatedMmaModule): which weights they take, the tile choice, the x split
into padded float16 hi/lo rows, grids and argument lists."""

from __future__ import annotations

from typing import Any

import numpy as np

from panechat.backends.cuda.kernels.constants import NT, cdiv
from panechat.backends.cuda.kernels.launch import ModuleKernels, add_arguments
from panechat.backends.cuda.kernels.mma_source import MMA_CHUNK, MMA_KERNEL_NAMES, MMA_TILES, mma_kernel_name


def mma_tile(m: int) -> tuple[int, int]:
    """(WT, TT) for M rows: the smallest token tile that holds them, else the largest.
    Tiling only groups elements: a row's arithmetic is the same in every tile."""
    for wt, tt in MMA_TILES:
        if m <= 8 * tt:
            return wt, tt
    return MMA_TILES[-1]


class MmaKernels(ModuleKernels):
    """out = x @ W.T on tensor cores for f16 and bf16 weights, q8 codes (int8 + float32
    scale, optional min, groups of 32 or 16 weights), and Q8_0 / Q4_x in block form (q80:
    int8 + float16 d; q4: nibbles as stored + float16 d, m) with K % 32 == 0; `handles` says which
    weights (a property of the weight, never of the batch)."""

    NAMES = tuple(MMA_KERNEL_NAMES)

    @staticmethod
    def handles(w: Any) -> bool:
        if w.k % MMA_CHUNK or w.n == 0:
            return False
        if w.kind in ("f16", "bf16", "q80", "q4"):  # q80, q4: Q8_0 / Q4_x in GGUF block form
            return w.kind in ("f16", "bf16") or getattr(w, "group", 32) == 32
        return w.kind == "q8" and getattr(w, "group", 32) in (16, 32)

    def split(self, x: Any, m_pad: int, gshift: int, want_sums: bool, bf16: bool = False) -> tuple:
        """mma_split_x: (parts [2, m_pad, K] float16 hi, lo -- bf16: [3, m_pad, K] uint16
        hi, mid, lo --, xinv [m_pad], xsum [m_pad, K >> gshift])."""
        xp = self.xp
        M, K = x.shape
        parts = xp.empty((3, m_pad, K), xp.uint16) if bf16 else xp.empty((2, m_pad, K), xp.float16)
        xinv = xp.empty(m_pad, xp.float32)
        xsum = xp.empty((m_pad, K >> gshift) if want_sums else (1,), xp.float32)
        i32 = np.int32
        self.fn("mma_split_x")((m_pad,), (NT,), (x, parts, xinv, xsum, i32(M), i32(K), i32(gshift),
                                                 i32(want_sums), i32(bf16)))
        return parts, xinv, xsum

    def linear(self, x: Any, w: Any, out: Any, add: Any = None) -> Any:
        M, K = x.shape
        N = w.n
        if K != w.k or out.shape != (M, N) or not self.handles(w):
            raise ValueError(f"mma linear: x{tuple(x.shape)} w[{w.n}, {w.k}] {w.kind} out{tuple(out.shape)}")
        if M == 0:
            return out
        wt, tt = mma_tile(M)
        m_pad = cdiv(M, 8 * tt) * 8 * tt
        q8 = w.kind in ("q8", "q80", "q4")
        gshift = getattr(w, "group", 32).bit_length() - 1 if q8 else 5
        has_m = q8 and w.mins is not None
        parts, xinv, xsum = self.split(x, m_pad, gshift, has_m, w.kind == "bf16")
        i32 = np.int32
        tail = add_arguments("mma linear", add, out, M, N)
        grid = (m_pad // (8 * tt), cdiv(N, 16 * wt))
        if grid[1] > 65535:
            raise ValueError(f"mma linear: N={N} too large for one launch")
        if q8:
            args = (parts, xinv, xsum, w.w, w.scales, w.mins if has_m else w.scales, out, i32(M), i32(N),
                    i32(K), i32(has_m), i32(gshift)) + tail
        else:
            args = (parts, xinv, xsum, w.w, out, i32(M), i32(N), i32(K)) + tail
        self.fn(mma_kernel_name(w.kind, wt, tt))(grid, (NT,), args)
        return out
