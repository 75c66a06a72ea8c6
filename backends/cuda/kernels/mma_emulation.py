"""A numpy model of the tensor-core (MMA) kernels of mma_source.py, and its error bound.

`split_x` is bit for bit what `mma_split_x` computes (IEEE operations only). The product
cannot be: inside one mma instruction the tensor core's summation of 16 products and the
accumulator is not IEEE-specified (NVIDIA documents no rounding; measured parts align to
the largest term and truncate). `emulate_mma_product` models each mma as the exact sum
rounded once to float32 and follows the kernel's order everywhere else (chunks of 32 k to
warp c % 8, group partials from zero, hi then lo, fma with the scale, the warp tree), so
it is within `mma_error_bound` of the float64 product, as the device must be. Rows are
computed from their own inputs alone, as on the device: invariance is exact here too.

The bound, per output element y = sum_k x_k w_k (w the exact dequantized weights: q*d + m
as a real number):
    |y~ - y| <= (2^-18 + (K / G / 8 + 4) * 2^-22) * sum_k |x_k| |w'_k|
                + 2^-38 * max_k |x_k| * sum_k |w'_k|
with G the weights per scale (32; 16 for Q6_K; 32 for f16 and bf16), w'_k = |q_k d| + |m|
(f16, bf16: |w_k|). The first 2^-18 covers the split (|x - hi - lo| <= 2^-22 |x|; bf16's
three parts: 2^-26 |x|), up to four mma results per group (six for bf16) with 2^-21 of
(|C| + sum|a b|) each, and the mins' group sums; the
second term one rounding per group step of each warp's chain and the tree; the last the
f16 subnormal range of lo (relative to the row's largest |x|, thanks to the row's
power-of-two scale).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from panechat.backends.cuda.kernels.emulation import EmulatedModule, fma_f32
from panechat.backends.cuda.kernels.mma_source import MMA_CHUNK, MMA_SOURCE, MMA_WARPS

_F32 = np.float32


def split_scale(x: np.ndarray) -> np.ndarray:
    """s per row: |x * 2^s| < 2^15, from the biased exponent of the row's max |x|."""
    mx = np.fmax.reduce(np.abs(np.asarray(x, np.float32)), axis=1, initial=_F32(0.0)).astype(np.float32)
    eb = (mx.view(np.int32) >> 23) & 0xFF
    return np.where(eb == 255, 0, np.where(eb == 0, 120, np.clip(141 - eb, -120, 120))).astype(np.int32)


def _pow2(e: np.ndarray) -> np.ndarray:
    return ((np.asarray(e, np.int32) + 127) << 23).astype(np.int32).view(np.float32)


def to_bf16(v: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even (cvt.rn.bf16.f32; finite v)."""
    u = np.asarray(v, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, np.uint16).astype(np.uint32) << 16).view(np.float32)


def part_values(xp: np.ndarray, bf16: bool) -> tuple[np.ndarray, ...]:
    """The x parts [P, R, K] (float16, or bfloat16 bits) as float64 arrays."""
    return tuple((from_bf16(p) if bf16 else np.asarray(p).view(np.float16)).astype(np.float64) for p in xp)


def split_x(x: np.ndarray, m_pad: int, gshift: int = 5, want_sums: bool = False, bf16: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(parts [2, m_pad, K] float16 hi, lo -- or [3, m_pad, K] bfloat16 bits hi, mid, lo --,
    xinv float32 [m_pad], xsum float32 [m_pad, K >> gshift] or None): mma_split_x's
    results, bit for bit; rows past M are zeros, xinv 1."""
    x = np.asarray(x, np.float32)
    M, K = x.shape
    s = split_scale(x)
    with np.errstate(invalid="ignore", over="ignore"):
        v = x * _pow2(s)[:, None]
        if bf16:
            xp = np.zeros((3, m_pad, K), np.uint16)
            xp[0, :M] = to_bf16(v)
            r1 = v - from_bf16(xp[0, :M])
            xp[1, :M] = to_bf16(r1)
            xp[2, :M] = to_bf16(r1 - from_bf16(xp[1, :M]))
        else:
            xp = np.zeros((2, m_pad, K), np.float16)
            xp[0, :M] = v.astype(np.float16)
            xp[1, :M] = (v - xp[0, :M].astype(np.float32)).astype(np.float16)
    xinv = np.ones(m_pad, np.float32)
    xinv[:M] = _pow2(-s)
    xsum = None
    if want_sums:
        G = 1 << gshift
        xsum = np.zeros((m_pad, K >> gshift), np.float32)
        if M and K:
            groups = np.concatenate([np.zeros((M, K >> gshift, 1), np.float32), v.reshape(M, K >> gshift, G)], 2)
            xsum[:M] = np.add.accumulate(groups, axis=2, dtype=np.float32)[:, :, -1]  # from +0, in order
    return xp, xinv, xsum


def _tree8(a: np.ndarray) -> np.ndarray:
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))


def emulate_mma_product(parts: tuple[np.ndarray, ...], xinv: np.ndarray, xsum: np.ndarray | None,
                        w: np.ndarray, d: np.ndarray | None = None, m: np.ndarray | None = None,
                        gshift: int = 5) -> np.ndarray:
    """out [R, N] float32 for split rows (the parts' values [R, K] each, hi first; xinv,
    xsum) and weights w [N, K] (their values: f16, bf16, or int8 codes with scales d
    [N, K/G] and mins m): the kernel's order, each mma rounded once (module doc)."""
    R, K = parts[0].shape
    N = w.shape[0]
    if K % MMA_CHUNK:
        raise ValueError(f"MMA products need K % {MMA_CHUNK} == 0, got {K}")
    W = np.asarray(w, np.float64)
    X = tuple(np.asarray(p, np.float64) for p in parts)
    acc = np.zeros((MMA_WARPS, R, N), np.float32)
    g16 = d is not None and gshift == 4
    with np.errstate(invalid="ignore", over="ignore"):
        for c in range(K // MMA_CHUNK):
            warp = c % MMA_WARPS
            for grp, js in (((0, (0,)), (1, (1,))) if g16 else ((0, (0, 1)),)):
                p = np.zeros((R, N), np.float32)
                for j in js:
                    k = slice(MMA_CHUNK * c + 16 * j, MMA_CHUNK * c + 16 * j + 16)
                    for part in X:  # hi, (mid,) lo
                        p = (p.astype(np.float64) + part[:, k] @ W[:, k].T).astype(np.float32)
                if d is None:
                    acc[warp] = acc[warp] + p
                else:
                    b = 2 * c + grp if g16 else c
                    acc[warp] = fma_f32(np.asarray(d, np.float32)[None, :, b], p, acc[warp])
                    if m is not None:
                        acc[warp] = fma_f32(np.asarray(m, np.float32)[None, :, b], xsum[:, b, None], acc[warp])
        return _tree8(acc) * np.asarray(xinv, np.float32)[:, None]


def mma_error_bound(x: np.ndarray, w_abs: np.ndarray, group: int = 32) -> np.ndarray:
    """The bound of the module doc, per element [M, N] (float64), for x [M, K] and w_abs
    [N, K] = |q d| + |m| (or |w|)."""
    x = np.abs(np.asarray(x, np.float64))
    wa = np.asarray(w_abs, np.float64)
    K = x.shape[1]
    rel = 2.0 ** -18 + (K / group / MMA_WARPS + 4) * 2.0 ** -22
    return rel * (x @ wa.T) + 2.0 ** -38 * x.max(axis=1, initial=0.0)[:, None] * wa.sum(axis=1)[None, :]


# -- a stand-in for the compiled MMA module --------------------------------------------------

def block_codes(qs: np.ndarray, n: int, k: int, has_m: bool) -> np.ndarray:
    """Q4 block form (16 bytes per 32 weights: byte j = weight j low nibble, j + 16 high)
    -> the codes the kernel multiplies [n, k]: q - 8 (Q4_0) or q (Q4_1, with a min)."""
    b = np.asarray(qs, np.uint8).reshape(n, k // 32, 16)
    q = np.concatenate([b & 0x0F, b >> 4], axis=2).reshape(n, k).astype(np.int16)
    return (q if has_m else q - 8).astype(np.int8)


class EmulatedMmaModule(EmulatedModule):
    """get_function() like cupy.RawModule for the MMA module, running the model above after
    checking every launch's arguments against the kernel's C signature and its grid."""

    def __init__(self) -> None:
        super().__init__(MMA_SOURCE)

    def _emulate(self, name: str, grid: tuple, args: tuple) -> None:
        (_emu_split if name == "mma_split_x" else _emu_linear)(name, tuple(int(g) for g in grid), args)


def _emu_split(name: str, grid: tuple, args: Any) -> None:
    x, xp, xinv, xsum, M, K, gshift, want, bf16 = args
    M, K, R = int(M), int(K), grid[0]
    parts, inv, sums = split_x(x.reshape(-1, K)[:M], R, int(gshift), bool(want), bool(bf16))
    if xp.size != parts.size:
        raise ValueError(f"{name}: x parts buffer of {xp.size} for {parts.shape}")
    xp.reshape(-1)[...] = parts.reshape(-1).view(xp.dtype)
    xinv[:R] = inv
    if want:
        xsum.reshape(R, -1)[...] = sums


def _emu_linear(name: str, grid: tuple, args: Any) -> None:
    _, _, kind, wt, tt = name.split("_")
    wt, tt = int(wt), int(tt)
    if kind in ("q8", "q80", "q4"):
        xp, xinv, xsum, q, d, m, out, M, N, K, has_m, gshift, add, add_mode = args
        M, N, K = int(M), int(N), int(K)
        f32 = (lambda a: a) if kind == "q8" else (lambda a: a.view(np.float16).astype(np.float32))
        d2 = f32(d.reshape(N, -1))
        mins = f32(m.reshape(N, -1)) if int(has_m) else None
        w = block_codes(q, N, K, bool(int(has_m))) if kind == "q4" else q.reshape(N, K)
        gs = int(gshift)
    else:
        xp, xinv, xsum, w0, out, M, N, K, add, add_mode = args
        M, N, K = int(M), int(N), int(K)
        w0 = w0.reshape(N, K)
        w, d2, mins, gs = from_bf16(w0.view(np.uint16)) if kind == "bf16" else w0.view(np.float16), None, None, 5
    R = grid[0] * 8 * tt
    n_parts = 3 if kind == "bf16" else 2
    if grid[1] != -(-N // (16 * wt)) or R < M or xp.size != n_parts * R * K:
        raise ValueError(f"{name}: grid {grid} does not cover M={M}, N={N} (tiles {wt}x{tt}) or x parts")
    sums = xsum.reshape(R, -1) if mins is not None else None
    parts = part_values(xp.reshape(n_parts, R, K), kind == "bf16")
    y = emulate_mma_product(parts, xinv[:R], sums, w, d2, mins, gs)[:M]
    if int(add_mode):
        y = y + (add.reshape(M, N) if int(add_mode) == 1 else add.reshape(N))
    out.reshape(M, N)[...] = y
