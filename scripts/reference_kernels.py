"""Reference kernels the product does not run, kept for the benchmarks and the tests:
`linear_q8` (int8 blocks of 32, with `quantize_q8` / `dequantize_q8`) and `attention`
over a contiguous slotted KV cache. scripts/bench_kernels.py measures them; the tests
check them against float64 and batch invariance, and compare the product's
`numpy_kernels.paged_attention` with `attention` bit for bit.

  linear_q8(x, wq i8[N,K], scales f32[N,K/32], out, mins=None)  int8 blocks
  attention(q f32[R,H,hd], k_cache, v_cache f32[S,G,ctx,hd],
            row_slot i32[R], row_pos i32[R], scale, out f32[R,H,hd], window=0)

They are built from numpy_kernels' parts (`_linear_driver`, `_attend_heads`, the SIMD
vocabulary), so each output element has that module's arithmetic. numba caches them
(cache=True) in the CPU kernels' cache folder, which importing panechat.backends.cpu names
by a hash of its sources (backends/cpu/__init__.py): an edit of numpy_kernels starts a new
folder, an edit of this file changes this file's own stamp, so no stale kernel is loaded.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from panechat.backends.cpu.numpy_kernels import (
    _JIT,
    _VEC,
    LANES,
    _attend_heads,
    _check_linear,
    _element_ptr,
    _is_c_array,
    _linear_driver,
    _require,
    f32vec,
    vadd,
    vmul,
    vsplat,
)

QBLOCK = 32  # weights per quantisation block (GGUF Q8_0 / Q4_0 / Q4_1)


@intrinsic
def vload_i8(typingctx, arr, i):
    """Load ``arr.flat[i : i + 16]`` (int8, C-contiguous) converted exactly to float32."""
    if not (_is_c_array(arr, types.int8) and isinstance(i, types.Integer)):
        return None
    i8vec = ir.VectorType(ir.IntType(8), LANES)

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        q = builder.load(builder.bitcast(p, i8vec.as_pointer()), align=1, typ=i8vec)
        return builder.sitofp(q, _VEC)

    return f32vec(arr, i), codegen


@njit(inline="always", **_JIT)
def _load_q8(w, ws, wm, n, k):
    """Dequantised w[n, k:k+16] = q * d for int8 blocks of 32 (Q8_0, Q4_0)."""
    return vmul(vload_i8(w, n * w.shape[1] + k), vsplat(ws[n, k // 32]))


@njit(inline="always", **_JIT)
def _load_q8_offset(w, ws, wm, n, k):
    """Dequantised w[n, k:k+16] = q * d + m for int8 blocks of 32 (Q4_1)."""
    b = k // 32
    return vadd(vmul(vload_i8(w, n * w.shape[1] + k), vsplat(ws[n, b])), vsplat(wm[n, b]))


@njit(parallel=True, **_JIT)
def _linear_q8(x, wq, scales, out):
    _linear_driver(x, wq, scales, scales, out, _load_q8)


@njit(parallel=True, **_JIT)
def _linear_q8_offset(x, wq, scales, mins, out):
    _linear_driver(x, wq, scales, mins, out, _load_q8_offset)


def linear_q8(
    x: np.ndarray,
    wq: np.ndarray,
    scales: np.ndarray,
    out: np.ndarray,
    mins: np.ndarray | None = None,
) -> np.ndarray:
    """out = x @ W.T with W[n, k] = wq[n, k] * scales[n, k // 32] (+ mins[n, k // 32]).

    x float32 [M, K]; wq int8 [N, K]; scales (and mins) float32 [N, K // 32];
    out float32 [M, N]; all C-contiguous, K a multiple of 32.  Q8_0 and Q4_0
    (q - 8) use scales only, Q4_1 adds mins.  The result is bit-identical to
    ``linear(x, dequantize_q8(wq, scales, mins), out)``: the same per-element
    operation order, with the weights dequantised in registers.
    """
    _check_linear(x, wq, np.int8, out)
    _require("scales", scales, np.float32, 2)
    N, K = wq.shape
    if K % QBLOCK or scales.shape != (N, K // QBLOCK):
        raise ValueError(f"linear_q8: K={K} must be a multiple of {QBLOCK}, scales [N, K/32]")
    if mins is None:
        _linear_q8(x, wq, scales, out)
    else:
        _require("mins", mins, np.float32, 2)
        if mins.shape != scales.shape:
            raise ValueError("linear_q8: mins must have the shape of scales")
        _linear_q8_offset(x, wq, scales, mins, out)
    return out


def quantize_q8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 blocks of 32 (GGUF Q8_0 style) for tests and benchmarks.

    Returns (wq int8 [N, K], scales float32 [N, K/32]); scales are rounded to
    float16 like GGUF's.
    """
    N, K = w.shape
    blocks = w.reshape(N, K // QBLOCK, QBLOCK).astype(np.float32)
    d = np.abs(blocks).max(axis=2) / 127.0
    d = d.astype(np.float16).astype(np.float32)  # GGUF stores d as f16
    safe = np.where(d == 0, 1, d)
    q = np.clip(np.rint(blocks / safe[:, :, None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(q.reshape(N, K)), np.ascontiguousarray(d)


def dequantize_q8(wq: np.ndarray, scales: np.ndarray, mins: np.ndarray | None = None) -> np.ndarray:
    """float32 W with exactly the values linear_q8 uses (q * d, then + m, in float32)."""
    N, K = wq.shape
    w = wq.reshape(N, K // QBLOCK, QBLOCK).astype(np.float32) * scales[:, :, None]
    if mins is not None:
        w = w + mins[:, :, None]
    return np.ascontiguousarray(w.reshape(N, K), dtype=np.float32)


# ---------------------------------------------------------------------------
# attention over a contiguous cache [S, G, ctx, hd]: numpy_kernels' per-head arithmetic
# ---------------------------------------------------------------------------

@njit(inline="always", **_JIT)
def _attend_group(q, kc, vc, r, g, slot, first, P, scale, out):
    """All query heads of kv head g for row r over the P keys from position `first`."""
    G = kc.shape[1]
    grp = q.shape[1] // G
    kvo = ((slot * G + g) * kc.shape[2] + first) * q.shape[2]  # flat offset of kc[slot, g, first, 0]
    _attend_heads(q, kc, vc, kvo, r, g * grp, grp, P, scale, out)


@njit(parallel=True, **_JIT)
def _attention(q, k_cache, v_cache, row_slot, row_pos, scale, window, out):
    R = q.shape[0]
    G = k_cache.shape[1]
    for task in prange(R * G):
        r, g = task // G, task % G
        first = max(0, row_pos[r] - window + 1) if window > 0 else 0
        _attend_group(q, k_cache, v_cache, r, g, row_slot[r], first, row_pos[r] + 1 - first, scale, out)


def attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    row_slot: np.ndarray,
    row_pos: np.ndarray,
    scale: float,
    out: np.ndarray,
    window: int = 0,
) -> np.ndarray:
    """Causal grouped-query attention over a slotted KV cache, batch-invariant per row.

    q float32 [R, n_head, hd]; k_cache, v_cache float32 [S, n_kv, ctx, hd];
    row_slot, row_pos int32 [R]; out float32 [R, n_head, hd]; all C-contiguous.
    Row r, head h attends to positions 0..row_pos[r] (inclusive) of slot
    row_slot[r], kv head h // (n_head // n_kv); with a sliding `window` > 0 only to
    positions max(0, row_pos[r] - window + 1)..row_pos[r] (llama.cpp's standard SWA
    mask).  The result is the same bits as attention over just those keys.
    Returns ``out``.
    """
    for name, a, dtype, ndim in (
        ("q", q, np.float32, 3),
        ("k_cache", k_cache, np.float32, 4),
        ("v_cache", v_cache, np.float32, 4),
        ("row_slot", row_slot, np.int32, 1),
        ("row_pos", row_pos, np.int32, 1),
        ("out", out, np.float32, 3),
    ):
        _require(name, a, dtype, ndim)
    R, H, D = q.shape
    S, G, C, D2 = k_cache.shape
    if D2 != D or v_cache.shape != k_cache.shape or out.shape != q.shape or H % G:
        raise ValueError(f"attention: shapes q{q.shape} kv{k_cache.shape} out{out.shape}")
    if row_slot.shape != (R,) or row_pos.shape != (R,):
        raise ValueError("attention: row_slot and row_pos must be [R]")
    if R and (row_slot.min() < 0 or row_slot.max() >= S or row_pos.min() < 0 or row_pos.max() >= C):
        raise ValueError("attention: row_slot / row_pos out of range")
    if window < 0:
        raise ValueError(f"attention: window must be >= 0, got {window}")
    _attention(q, k_cache, v_cache, row_slot, row_pos, np.float32(scale), np.int64(window), out)
    return out
