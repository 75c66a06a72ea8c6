"""Batch-invariant CPU kernels (numba) for the numpy backend.

Why this module exists
----------------------
panechat promises that batching never changes an answer: a row's logits must be
bit-for-bit identical whether it is decoded alone or beside 1..31 other rows, at
any row position.  OpenBLAS ``x @ w.T`` breaks that promise: sgemm picks
different micro-kernels, blockings and summation orders depending on M and on
where a row falls inside a tile, so the same row yields different bits in
different batches.  A stacked GEMV (``np.matmul(w, x[:, :, None])``) is
invariant but re-reads every weight once per row, which is far too slow.

The kernels below fix each output element's arithmetic in the source code:

* Dot products use ``LANES`` (16) independent partial sums: lane ``l``
  accumulates ``x[k] * w[k]`` for ``k = c*16 + l`` in increasing ``c``
  (a rounded multiply, then a rounded add), the lanes are combined by a fixed
  halving tree (8, 4, 2, 1), and a K tail (``K % 16``) is then added
  sequentially.  This is written with explicit ``<16 x float>`` LLVM vectors
  (see the SIMD vocabulary below) and compiled WITHOUT fast-math, so LLVM may
  not reassociate and no FMA contraction happens.
* Work is split over output columns (and over (row, kv-head) in attention);
  register tiles of several rows x columns only change which elements are
  computed together, never how one element is computed.  So a row's bits do
  not depend on M, on its position, on the tile that handled it, on the
  thread count -- nor on the ISA: AVX-512, AVX2 and generic x86-64 builds
  give identical bits (verified with NUMBA_CPU_NAME=haswell / generic).
* Attention computes every (row, head) from its own q, K and V with the same
  lane scheme for q . k, a fixed-order max, an explicit polynomial exp (no
  libm, so also the same everywhere), a fixed-order sum and a weighted V sum
  accumulated sequentially over positions.

Kernels (all arrays C-contiguous; the wrappers raise ValueError otherwise):

  linear(x f32[M,K], w f32[N,K], out f32[M,N])              out = x @ w.T
  paged_attention(q f32[R,H,hd], k_blocks, v_blocks [NB,G,B,hd], tables i32[S,nb],
                  row_seq i32[R], row_pos i32[R], scale, out f32[R,H,hd], window=0)
  rope(x f32[R,H,hd], positions, neox, cos, sin)

Only what the product runs lives here: the int8-block linear and attention over a
contiguous cache, which the benchmarks and tests use as references, are in
scripts/reference_kernels.py.

``NumpyBackend.self_check()`` (backends/self_check.py) verifies the property on this
machine at start-up.

Compilation uses ``cache=True``: the first import on a machine compiles the
kernels (~15 s for all of them on 2 cores), later processes load them from
numba's on-disk cache (< 1 s).
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils, config
from numba.extending import intrinsic, models, register_model

__all__ = [
    "LANES",
    "linear",
    "paged_attention",
]

LANES = 16  # width of the explicit vectors; part of the numerical contract

_JIT = dict(cache=True, nogil=True)  # never fastmath: it would allow reordering
# Helpers are plain njit functions (LLVM inlines them where it pays). `inline="always"`
# (numba's own IR inlining) is kept only for helpers that take a function as an argument,
# which a cached kernel can only hold inlined: it tripled the cold compile of the attention
# and one-call decode kernels (154 -> 99 s of CPU for the default model's first reply).


# ---------------------------------------------------------------------------
# SIMD vocabulary: a numba type backed by the LLVM vector <16 x float>.
# Every operation is a plain IEEE instruction (no fast-math flags).
# ---------------------------------------------------------------------------

_VEC = ir.VectorType(ir.FloatType(), LANES)
_I32 = ir.IntType(32)


class _F32Vec(types.Type):
    def __init__(self):
        super().__init__(name=f"f32x{LANES}")


f32vec = _F32Vec()


@register_model(_F32Vec)
class _F32VecModel(models.PrimitiveModel):
    """A <16 x float> in registers; a plain [16 x float] (4-byte aligned) in memory.

    The memory form matters when a vector is stored inside a container (list,
    heap tuple): a <16 x float> there would be assumed 64-byte aligned.
    """

    _MEM = ir.ArrayType(ir.FloatType(), LANES)

    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC)

    def get_data_type(self):
        return self._MEM

    def as_data(self, builder, value):
        arr = ir.Constant(self._MEM, None)
        for i in range(LANES):
            arr = builder.insert_value(arr, builder.extract_element(value, ir.Constant(_I32, i)), i)
        return arr

    def from_data(self, builder, value):
        vec = ir.Constant(_VEC, None)
        for i in range(LANES):
            vec = builder.insert_element(vec, builder.extract_value(value, i), ir.Constant(_I32, i))
        return vec


def _is_c_array(a, dtype):
    return isinstance(a, types.Array) and a.dtype == dtype and a.layout == "C"


def _element_ptr(context, builder, arrty, arr, idxty, idx):
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.gep(data, [context.cast(builder, idx, idxty, types.intp)])


def call_llvm(builder, name, ret, *args):
    """Call the LLVM intrinsic (or function) `name` returning `ret`, declared in the module
    on first use."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, list(args))


def splat_value(builder, s, vty):
    """A vector of type vty with the scalar value s in every lane."""
    v = builder.insert_element(ir.Constant(vty, None), s, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, None), ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count))


@intrinsic
def vzero(typingctx):
    """All-zero vector."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VEC, None)

    return f32vec(), codegen


@intrinsic
def vsplat(typingctx, s):
    """Vector with every lane equal to the float32 scalar ``s``."""
    if s != types.float32:
        return None

    def codegen(context, builder, sig, args):
        v = builder.insert_element(ir.Constant(_VEC, None), args[0], ir.Constant(_I32, 0))
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))

    return f32vec(s), codegen


@intrinsic
def vload(typingctx, arr, i):
    """Load ``arr.flat[i : i + 16]`` (float32, C-contiguous; no bounds check)."""
    if not (_is_c_array(arr, types.float32) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return builder.load(builder.bitcast(p, _VEC.as_pointer()), align=4, typ=_VEC)

    return f32vec(arr, i), codegen


_HALF_VEC = ir.VectorType(ir.HalfType(), LANES)


@intrinsic
def vload_kv(typingctx, arr, i):
    """Load ``arr.flat[i : i + 16]`` as float32 from KV storage: float32, or IEEE half
    floats held as uint16 bits (C-contiguous), each converted exactly (fpext)."""
    if not isinstance(i, types.Integer):
        return None
    if _is_c_array(arr, types.float32):
        def codegen(context, builder, sig, args):
            p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            return builder.load(builder.bitcast(p, _VEC.as_pointer()), align=4, typ=_VEC)
        return f32vec(arr, i), codegen
    if _is_c_array(arr, types.uint16):
        def codegen(context, builder, sig, args):
            p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            h = builder.load(builder.bitcast(p, _HALF_VEC.as_pointer()), align=2, typ=_HALF_VEC)
            return builder.fpext(h, _VEC)
        return f32vec(arr, i), codegen
    return None


@intrinsic
def load_kv(typingctx, arr, i):
    """``arr.flat[i]`` as a float32 scalar from float32 or half (uint16 bits) storage."""
    if not isinstance(i, types.Integer):
        return None
    if _is_c_array(arr, types.float32):
        def codegen(context, builder, sig, args):
            return builder.load(_element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1]))
        return types.float32(arr, i), codegen
    if _is_c_array(arr, types.uint16):
        def codegen(context, builder, sig, args):
            p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            h = builder.load(builder.bitcast(p, ir.HalfType().as_pointer()), align=2)
            return builder.fpext(h, ir.FloatType())
        return types.float32(arr, i), codegen
    return None


@intrinsic
def vstore(typingctx, arr, i, v):
    """Store ``v`` into ``arr.flat[i : i + 16]`` (float32, C-contiguous)."""
    if not (_is_c_array(arr, types.float32) and isinstance(i, types.Integer) and v == f32vec):
        return None

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        builder.store(args[2], builder.bitcast(p, _VEC.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(arr, i, v), codegen


def _prefetch_to(locality: int):
    """The typing and code of a prefetch of arr.flat[i] with LLVM's `locality` (3: into
    L1, prefetcht0; 2: into L2, prefetcht1); it never faults, even out of bounds."""

    def typer(typingctx, arr, i):
        if not (isinstance(arr, types.Array) and isinstance(i, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            fnty = ir.FunctionType(ir.VoidType(), [ir.PointerType(), _I32, _I32, _I32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            read, keep, data = ir.Constant(_I32, 0), ir.Constant(_I32, locality), ir.Constant(_I32, 1)
            builder.call(fn, [builder.bitcast(p, ir.PointerType()), read, keep, data])
            return context.get_dummy_value()

        return types.none(arr, i), codegen

    return typer


@intrinsic
def prefetch(typingctx, arr, i):
    """Hint the CPU to fetch arr.flat[i] into L1 (never faults, even out of bounds)."""
    return _prefetch_to(3)(typingctx, arr, i)


@intrinsic
def prefetch_l2(typingctx, arr, i):
    """Hint the CPU to fetch arr.flat[i] into L2 only (prefetcht1: L1 keeps what is being
    computed on); never faults, even out of bounds."""
    return _prefetch_to(2)(typingctx, arr, i)


@intrinsic
def vadd(typingctx, a, b):
    """Lane-wise a + b."""

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])

    return f32vec(f32vec, f32vec), codegen


@intrinsic
def vsub(typingctx, a, b):
    """Lane-wise a - b."""

    def codegen(context, builder, sig, args):
        return builder.fsub(args[0], args[1])

    return f32vec(f32vec, f32vec), codegen


@intrinsic
def vmul(typingctx, a, b):
    """Lane-wise a * b."""

    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])

    return f32vec(f32vec, f32vec), codegen


@intrinsic
def vmac(typingctx, acc, a, b):
    """Lane-wise acc + a * b, with the product rounded first (never an FMA)."""

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], builder.fmul(args[1], args[2]))

    return f32vec(f32vec, f32vec, f32vec), codegen


@intrinsic
def vmax(typingctx, m, v):
    """Lane-wise v if v > m, else m (a NaN in v never replaces m)."""

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered(">", args[1], args[0]), args[1], args[0])

    return f32vec(f32vec, f32vec), codegen


@intrinsic
def lane_max(typingctx, v):
    """The largest lane of v (lanes compared by `>`, in a fixed tree)."""
    if v != f32vec:
        return None

    def codegen(context, builder, sig, args):
        v, n = args[0], LANES
        while n > 1:
            n //= 2
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, LANES), [(k + n) % LANES for k in range(LANES)]))
            v = builder.select(builder.fcmp_ordered(">", hi, v), hi, v)
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.float32(v), codegen


@intrinsic
def vsum(typingctx, v):
    """Fixed-tree horizontal sum: lanes l and l+h are added for h = 8, 4, 2, 1."""

    def codegen(context, builder, sig, args):
        v, h = args[0], LANES // 2
        while h >= 1:
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h))))
            hi = builder.shuffle_vector(
                v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h, 2 * h)))
            )
            v, h = builder.fadd(lo, hi), h // 2
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.float32(f32vec), codegen


@intrinsic
def vsum16(typingctx, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
    """[vsum(v0), ..., vsum(v15)] as one vector, bit-identical to 16 vsum calls.

    The halving tree runs on all 16 vectors at once: at each level two vectors
    holding the partial lanes of n keys each are shuffled into "first halves"
    and "second halves" of every key and added, so each key sees exactly the
    additions vsum performs, at a quarter of the instructions.
    """
    vs = (v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15)
    if any(v != f32vec for v in vs):
        return None

    def codegen(context, builder, sig, args):
        vecs, h = list(args), LANES // 2
        while len(vecs) > 1:
            keys = LANES // (2 * h)  # keys per input vector, 2h lanes each
            lo = [i * 2 * h + l for i in range(2 * keys) for l in range(h)]
            hi = [i + h for i in lo]
            mask_lo = ir.Constant(ir.VectorType(_I32, LANES), lo)
            mask_hi = ir.Constant(ir.VectorType(_I32, LANES), hi)
            vecs = [
                builder.fadd(
                    builder.shuffle_vector(a, b, mask_lo), builder.shuffle_vector(a, b, mask_hi)
                )
                for a, b in zip(vecs[0::2], vecs[1::2])
            ]
            h //= 2
        return vecs[0]

    return f32vec(*vs), codegen


@intrinsic
def _i32_bits_as_f32(typingctx, i):
    """float32 whose bit pattern is the low 32 bits of integer i."""
    if not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        bits = context.cast(builder, args[0], sig.args[0], types.int32)
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(i), codegen


# ---------------------------------------------------------------------------
# linear: out[M, N] = x[M, K] @ w[N, K].T
# A "weight loader" returns the float32 vector w[n, k : k + 16]; the f32 and
# the quantised kernels share the tile code and differ only in the loader.
# ---------------------------------------------------------------------------

# Register tiles: tile shape never changes an element's arithmetic, so it may be
# chosen per ISA.  With 32 vector registers (AVX-512) a 4x6 tile keeps 24
# accumulators in registers (measured faster than 4x4, 6x4, 4x8, 2x4, 1x8 at
# M = 8..32); with 16 (AVX2, where a 16-lane vector takes two registers) one
# row x 6 columns measured best (vs 1x4, 2x2, 2x3, 3x2, 4x4).
TILE_N = 6  # output columns per tile


def _target_has_avx512() -> bool:
    """Whether numba compiles for AVX-512 (honours NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)."""
    feats = config.CPU_FEATURES
    if feats is None:
        feats = llvm.get_host_cpu_features().flatten()
    return "+avx512f" in feats.split(",")


_WIDE = _target_has_avx512()
_STREAM_MAX_ROWS = 32  # up to this M: one tile of columns per task, prefetching the next
_COLS_PER_TASK = 96  # above it: columns one task walks (the w panel stays in L2, x does not fit)


@njit(inline="always", **_JIT)
def _load_f32(w, ws, wm, n, k):
    """Weight vector w[n, k:k+16] of an f32 matrix (ws, wm unused)."""
    return vload(w, n * w.shape[1] + k)


@njit(inline="always", **_JIT)
def _prefetch_next_tile(w, n, k, pf):
    """When streaming weights from DRAM, prefetch the next tile's rows at column k."""
    if pf:
        K = w.shape[1]
        for j in range(TILE_N, 2 * TILE_N):
            prefetch(w, (n + j) * K + k)


@njit(inline="always", **_JIT)
def _tile_4x6(x, w, ws, wm, out, m, n, kv, load, pf):
    """out[m:m+4, n:n+6]: 24 vector accumulators, each weight vector used 4 times."""
    K = x.shape[1]
    x0, x1, x2, x3 = m * K, (m + 1) * K, (m + 2) * K, (m + 3) * K
    a00 = a01 = a02 = a03 = a04 = a05 = a10 = a11 = a12 = a13 = a14 = a15 = vzero()
    a20 = a21 = a22 = a23 = a24 = a25 = a30 = a31 = a32 = a33 = a34 = a35 = vzero()
    for k in range(0, kv, LANES):
        _prefetch_next_tile(w, n, k, pf)
        w0, w1, w2 = load(w, ws, wm, n, k), load(w, ws, wm, n + 1, k), load(w, ws, wm, n + 2, k)
        w3, w4, w5 = load(w, ws, wm, n + 3, k), load(w, ws, wm, n + 4, k), load(w, ws, wm, n + 5, k)
        v = vload(x, x0 + k)
        a00, a01, a02 = vmac(a00, v, w0), vmac(a01, v, w1), vmac(a02, v, w2)
        a03, a04, a05 = vmac(a03, v, w3), vmac(a04, v, w4), vmac(a05, v, w5)
        v = vload(x, x1 + k)
        a10, a11, a12 = vmac(a10, v, w0), vmac(a11, v, w1), vmac(a12, v, w2)
        a13, a14, a15 = vmac(a13, v, w3), vmac(a14, v, w4), vmac(a15, v, w5)
        v = vload(x, x2 + k)
        a20, a21, a22 = vmac(a20, v, w0), vmac(a21, v, w1), vmac(a22, v, w2)
        a23, a24, a25 = vmac(a23, v, w3), vmac(a24, v, w4), vmac(a25, v, w5)
        v = vload(x, x3 + k)
        a30, a31, a32 = vmac(a30, v, w0), vmac(a31, v, w1), vmac(a32, v, w2)
        a33, a34, a35 = vmac(a33, v, w3), vmac(a34, v, w4), vmac(a35, v, w5)
    _store6(out, m, n, a00, a01, a02, a03, a04, a05)
    _store6(out, m + 1, n, a10, a11, a12, a13, a14, a15)
    _store6(out, m + 2, n, a20, a21, a22, a23, a24, a25)
    _store6(out, m + 3, n, a30, a31, a32, a33, a34, a35)


@njit(inline="always", **_JIT)
def _tile_2x6(x, w, ws, wm, out, m, n, kv, load, pf):
    """out[m:m+2, n:n+6]."""
    K = x.shape[1]
    x0, x1 = m * K, (m + 1) * K
    a00 = a01 = a02 = a03 = a04 = a05 = a10 = a11 = a12 = a13 = a14 = a15 = vzero()
    for k in range(0, kv, LANES):
        _prefetch_next_tile(w, n, k, pf)
        w0, w1, w2 = load(w, ws, wm, n, k), load(w, ws, wm, n + 1, k), load(w, ws, wm, n + 2, k)
        w3, w4, w5 = load(w, ws, wm, n + 3, k), load(w, ws, wm, n + 4, k), load(w, ws, wm, n + 5, k)
        v = vload(x, x0 + k)
        a00, a01, a02 = vmac(a00, v, w0), vmac(a01, v, w1), vmac(a02, v, w2)
        a03, a04, a05 = vmac(a03, v, w3), vmac(a04, v, w4), vmac(a05, v, w5)
        v = vload(x, x1 + k)
        a10, a11, a12 = vmac(a10, v, w0), vmac(a11, v, w1), vmac(a12, v, w2)
        a13, a14, a15 = vmac(a13, v, w3), vmac(a14, v, w4), vmac(a15, v, w5)
    _store6(out, m, n, a00, a01, a02, a03, a04, a05)
    _store6(out, m + 1, n, a10, a11, a12, a13, a14, a15)


@njit(inline="always", **_JIT)
def _tile_1x6(x, w, ws, wm, out, m, n, kv, load, pf):
    """out[m, n:n+6]: one row against six weight rows."""
    x0 = m * x.shape[1]
    a0 = a1 = a2 = a3 = a4 = a5 = vzero()
    for k in range(0, kv, LANES):
        _prefetch_next_tile(w, n, k, pf)
        v = vload(x, x0 + k)
        a0, a1 = vmac(a0, v, load(w, ws, wm, n, k)), vmac(a1, v, load(w, ws, wm, n + 1, k))
        a2, a3 = vmac(a2, v, load(w, ws, wm, n + 2, k)), vmac(a3, v, load(w, ws, wm, n + 3, k))
        a4, a5 = vmac(a4, v, load(w, ws, wm, n + 4, k)), vmac(a5, v, load(w, ws, wm, n + 5, k))
    _store6(out, m, n, a0, a1, a2, a3, a4, a5)


@njit(inline="always", **_JIT)
def _tile_1x1(x, w, ws, wm, out, m, n, kv, load):
    """out[m, n] alone (leftover columns when N % 6 != 0)."""
    x0 = m * x.shape[1]
    a = vzero()
    for k in range(0, kv, LANES):
        a = vmac(a, vload(x, x0 + k), load(w, ws, wm, n, k))
    out[m, n] = vsum(a)


@njit(inline="always", **_JIT)
def _store6(out, m, n, a0, a1, a2, a3, a4, a5):
    out[m, n], out[m, n + 1], out[m, n + 2] = vsum(a0), vsum(a1), vsum(a2)
    out[m, n + 3], out[m, n + 4], out[m, n + 5] = vsum(a3), vsum(a4), vsum(a5)


@njit(inline="always", **_JIT)
def _column_panel(x, w, ws, wm, out, n0, n1, load, pf):
    """All rows of out[:, n0:n1] over k < kv (K rounded down to 16 lanes)."""
    M, K = x.shape
    kv = K - K % LANES
    n6 = n0 + (n1 - n0) // TILE_N * TILE_N
    m = 0
    if _WIDE:
        while m + 4 <= M:
            for n in range(n0, n6, TILE_N):
                _tile_4x6(x, w, ws, wm, out, m, n, kv, load, pf)
            m += 4
        if m + 2 <= M:
            for n in range(n0, n6, TILE_N):
                _tile_2x6(x, w, ws, wm, out, m, n, kv, load, pf)
            m += 2
    for mr in range(m, M):
        for n in range(n0, n6, TILE_N):
            _tile_1x6(x, w, ws, wm, out, mr, n, kv, load, pf)
    for mr in range(M):
        for n in range(n6, n1):
            _tile_1x1(x, w, ws, wm, out, mr, n, kv, load)


@njit(inline="always", **_JIT)
def _linear_driver(x, w, ws, wm, out, load):
    """Parallel over column panels of the output.

    Up to _STREAM_MAX_ROWS rows each task is one 6-column tile: weights stream
    from DRAM once (prefetched a tile ahead) and are reused from L1 by every
    row block.  For long prefills x no longer fits in cache, so tasks walk
    wider panels whose weights stay in L2 while x streams through.
    """
    M = x.shape[0]
    N = out.shape[1]
    stream = M <= _STREAM_MAX_ROWS
    cols = TILE_N if stream else _COLS_PER_TASK
    for p in prange((N + cols - 1) // cols):
        n0 = p * cols
        _column_panel(x, w, ws, wm, out, n0, min(n0 + cols, N), load, stream)


@njit(parallel=True, **_JIT)
def _linear_f32(x, w, out):
    _linear_driver(x, w, w, w, out, _load_f32)
    M, K = x.shape
    kv = K - K % LANES
    if kv != K:  # add the K % 16 leftover products, sequentially in k
        for m in prange(M):
            for n in range(w.shape[0]):
                s = out[m, n]
                for k in range(kv, K):
                    s = s + x[m, k] * w[n, k]
                out[m, n] = s


@njit(inline="always", **_JIT)
def column_tasks(outs, count, cols):
    """Tasks of `cols` output columns over the first `count` (1..3) of the 3-tuple `outs`,
    in order: their cumulative counts (t1, t2, t3), for one parallel region over all."""
    t1 = (outs[0].shape[1] + cols - 1) // cols
    t2 = t1 + ((outs[1].shape[1] + cols - 1) // cols if count > 1 else 0)
    t3 = t2 + ((outs[2].shape[1] + cols - 1) // cols if count > 2 else 0)
    return t1, t2, t3


@njit(inline="always", **_JIT)
def column_task(t, t1, t2, cols):
    """(output j, first column n0) of task t of `column_tasks`."""
    j = 0 if t < t1 else (1 if t < t2 else 2)
    return j, (t - (0 if j == 0 else (t1 if j == 1 else t2))) * cols


@njit(inline="always", **_JIT)
def block_task(t, t1, t2, t3, cols, rows, M):
    """(output j, first column n0, rows r0..r1) of task t when the t3 tasks of `column_tasks`
    repeat for each block of `rows` of the M rows, block by block (a thread's tasks in a
    row share their block's activations): t3 * ceil(M / rows) tasks."""
    j, n0 = column_task(t % t3, t1, t2, cols)
    r0 = t // t3 * rows
    return j, n0, r0, min(r0 + rows, M)


def _require(name, a, dtype, ndim):
    """Raise ValueError unless a is a C-contiguous ndarray of dtype with ndim dims."""
    ok = isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == ndim
    if not (ok and a.flags.c_contiguous):
        got = f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{name} must be a C-contiguous {np.dtype(dtype)} array, {ndim}-d; got {got}")


def _check_linear(x, w, wdtype, out):
    _require("x", x, np.float32, 2)
    _require("w", w, wdtype, 2)
    _require("out", out, np.float32, 2)
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or out.shape != (M, N):
        raise ValueError(f"linear: shapes x{x.shape} w{w.shape} out{out.shape} do not match")


def linear(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[M, N] = x[M, K] @ w[N, K].T, batch-invariant per row.

    All three arrays float32 and C-contiguous (else ValueError).  Returns ``out``.
    """
    _check_linear(x, w, np.float32, out)
    _linear_f32(x, w, out)
    return out


# ---------------------------------------------------------------------------
# attention: softmax(q . k * scale) @ v per (row, head), grouped-query.
# ---------------------------------------------------------------------------

_F = np.float32
_EXP_LO = _F(-87.33654)  # below this expf underflows to (sub)normals; clamp
_LOG2E = _F(1.44269504088896341)
_LN2_HI = _F(0.693359375)
_LN2_LO = _F(-2.12194440e-4)
_P0, _P1, _P2 = _F(1.9875691500e-4), _F(1.3981999507e-3), _F(8.3334519073e-3)
_P3, _P4, _P5 = _F(4.1665795894e-2), _F(1.6666665459e-1), _F(5.0000001201e-1)


@njit(**_JIT)
def _expf(x):
    """exp(x) for float32 x <= 0 (Cephes expf, ~1 ulp) from explicit +, *, floor.

    Plain IEEE operations only, so the loop vectoriser may vectorise it without
    changing any bits, and every machine computes the same values.
    """
    x = max(x, _EXP_LO)
    n = np.floor(x * _LOG2E + _F(0.5))
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    p = (p * (r * r) + r) + _F(1.0)
    return p * _i32_bits_as_f32((np.int32(n) + 127) << 23)


@intrinsic
def vexp(typingctx, v):
    """Lane-wise `_expf`: the same operations on 16 lanes, so the same bits (NaN included:
    the clamp keeps a NaN, as `max` does). LLVM's vectoriser left `_expf`'s loop at about
    1.3 cycles a value; this is half that."""
    if v != f32vec:
        return None

    def codegen(context, builder, sig, args):
        def splat(c):
            return splat_value(builder, ir.Constant(ir.FloatType(), float(c)), _VEC)

        x, lo = args[0], splat(_EXP_LO)
        x = builder.select(builder.fcmp_ordered("<", x, lo), lo, x)
        n = call_llvm(builder, "llvm.floor.v16f32", _VEC, builder.fadd(builder.fmul(x, splat(_LOG2E)), splat(0.5)))
        r = builder.fsub(builder.fsub(x, builder.fmul(n, splat(_LN2_HI))), builder.fmul(n, splat(_LN2_LO)))
        p = splat(_P0)
        for c in (_P1, _P2, _P3, _P4, _P5):
            p = builder.fadd(builder.fmul(p, r), splat(c))
        p = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), splat(1.0))
        ivec = ir.VectorType(_I32, LANES)
        k = builder.add(builder.fptosi(n, ivec), splat_value(builder, ir.Constant(_I32, 127), ivec))
        return builder.fmul(p, builder.bitcast(builder.shl(k, splat_value(builder, ir.Constant(_I32, 23), ivec)), _VEC))

    return f32vec(v), codegen


@njit(**_JIT)
def _dot(a, ao, b, bo, D):
    """sum_d a.flat[ao + d] * b.flat[bo + d] with the same lane scheme as linear."""
    dv = D - D % LANES
    acc = vzero()
    for d in range(0, dv, LANES):
        acc = vmac(acc, vload(a, ao + d), vload(b, bo + d))
    s = vsum(acc)
    for d in range(dv, D):
        s = s + a.flat[ao + d] * b.flat[bo + d]
    return s


@njit(**_JIT)
def _scores16(q, qo, kc, o, D, dv):
    """The 16 scores q . k[i] for k[i] = kc.flat[o + i*D:], i < 16, with _dot's bits.

    Sixteen independent lane accumulators advance together over the head
    dimension (each exactly as in _dot) and are reduced at once by vsum16.
    """
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero()
    a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = vzero()
    for d in range(0, dv, LANES):
        qv, k = vload(q, qo + d), o + d
        a0, a1 = vmac(a0, qv, vload(kc, k)), vmac(a1, qv, vload(kc, k + D))
        a2, a3 = vmac(a2, qv, vload(kc, k + 2 * D)), vmac(a3, qv, vload(kc, k + 3 * D))
        a4, a5 = vmac(a4, qv, vload(kc, k + 4 * D)), vmac(a5, qv, vload(kc, k + 5 * D))
        a6, a7 = vmac(a6, qv, vload(kc, k + 6 * D)), vmac(a7, qv, vload(kc, k + 7 * D))
        a8, a9 = vmac(a8, qv, vload(kc, k + 8 * D)), vmac(a9, qv, vload(kc, k + 9 * D))
        a10, a11 = vmac(a10, qv, vload(kc, k + 10 * D)), vmac(a11, qv, vload(kc, k + 11 * D))
        a12, a13 = vmac(a12, qv, vload(kc, k + 12 * D)), vmac(a13, qv, vload(kc, k + 13 * D))
        a14, a15 = vmac(a14, qv, vload(kc, k + 14 * D)), vmac(a15, qv, vload(kc, k + 15 * D))
    return vsum16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)


@njit(**_JIT)
def _scores(q, qo, kc, ko, P, scale, e):
    """e[t] = _dot(q[qo:], k[t]) * scale for t < P, where k[t] = kc.flat[ko + t*D:].

    Blocks of 16 keys go through _scores16; leftover keys use _dot.
    """
    D = q.shape[2]
    dv = D - D % LANES
    qf, kf = q.reshape(-1), kc.reshape(-1)
    pv = P - P % LANES
    sv = vsplat(scale)
    for t in range(0, pv, LANES):
        o = ko + t * D
        v = _scores16(q, qo, kc, o, D, dv)
        if dv == D:
            vstore(e, t, vmul(v, sv))
            continue
        vstore(e, t, v)
        for i in range(LANES):
            st = e[t + i]
            for d in range(dv, D):  # head-dim tail, as in _dot
                st = st + qf[qo + d] * kf[o + i * D + d]
            e[t + i] = st * scale
    for t in range(pv, P):
        e[t] = _dot(q, qo, kc, ko + t * D, D) * scale


@njit(**_JIT)
def _exp_less_max(e, P):
    """e[t] = exp(e[t] - m) in place for t < P (float32 [>= P]), m the largest of e[0:P]:
    softmax's numerators. The largest value is the same whatever order it is found in (a
    tie of +0 and -0 may give either, and x - 0 and x + 0 are equal but for x = -0, whose
    exp is 1 either way), so 16 lanes find it (a loop-carried scalar `max` would not be
    vectorised); exp runs 16 lanes at a time (`vexp`, `_expf`'s bits), the tail one by one."""
    pv = P - P % LANES
    m = e[0]
    if pv:
        v = vload(e, 0)
        for t in range(LANES, pv, LANES):
            v = vmax(v, vload(e, t))
        m = max(m, lane_max(v))
    for t in range(pv, P):
        m = max(m, e[t])
    mv = vsplat(m)
    for t in range(0, pv, LANES):
        vstore(e, t, vexp(vsub(vload(e, t), mv)))
    for t in range(pv, P):
        e[t] = _expf(e[t] - m)


@njit(**_JIT)
def _sum(e, P):
    """Fixed-order sum of e[0:P] (16 lane partial sums, tree, sequential tail)."""
    pv = P - P % LANES
    acc = vzero()
    for t in range(0, pv, LANES):
        acc = vadd(acc, vload(e, t))
    s = vsum(acc)
    for t in range(pv, P):
        s = s + e[t]
    return s


_KEY_BLOCK = 64  # keys per block of the weighted V sum (the V block stays in L1)


# The weighted V sums: acc[j, d] += e[j, t] * v[t, d] key after key, each element's chain
# in position order from its running value (`vmac`: a rounded product, then a rounded add).
# `_vNx4` take N heads' chains over 64 columns (four vectors a head) at once, so each value
# vector is loaded (and, from a float16 store, converted: `vload_kv`, exact) once for all N
# heads of a kv group; 4N independent chains hide the add latency. Flat offsets throughout:
# e[j, t] is ef[eo + j * P + t], acc[j, d] acc[ao + j * D + d], v[t, d] vb.flat[vo + t * D + d].
# The four are one register tile at four widths (numba has no templates); three and four
# heads as pairs loaded each vector twice: 16-20% slower (the default model's 9 heads at 2000
# positions 36.4 against 30.2 us, the 1B's 32 heads 118.7 against 102.3, in L2).


@njit(**_JIT)
def _v1x4(ef, eo, P, vb, vo, n, acc, ao, D, c):
    """One head's 64 columns from c (module comment above)."""
    o0 = ao + c
    a0, a1, a2, a3 = vload(acc, o0), vload(acc, o0 + LANES), vload(acc, o0 + 2 * LANES), vload(acc, o0 + 3 * LANES)
    for i in range(n):
        o = vo + i * D + c
        v0, v1, v2, v3 = vload_kv(vb, o), vload_kv(vb, o + LANES), vload_kv(vb, o + 2 * LANES), vload_kv(vb, o + 3 * LANES)
        ea = vsplat(ef[eo + i])
        a0, a1, a2, a3 = vmac(a0, ea, v0), vmac(a1, ea, v1), vmac(a2, ea, v2), vmac(a3, ea, v3)
    vstore(acc, o0, a0)
    vstore(acc, o0 + LANES, a1)
    vstore(acc, o0 + 2 * LANES, a2)
    vstore(acc, o0 + 3 * LANES, a3)


@njit(**_JIT)
def _v2x4(ef, eo, P, vb, vo, n, acc, ao, D, c):
    """Two heads' 64 columns from c, sharing each value vector."""
    o0, o1 = ao + c, ao + D + c
    a0, a1, a2, a3 = vload(acc, o0), vload(acc, o0 + LANES), vload(acc, o0 + 2 * LANES), vload(acc, o0 + 3 * LANES)
    b0, b1, b2, b3 = vload(acc, o1), vload(acc, o1 + LANES), vload(acc, o1 + 2 * LANES), vload(acc, o1 + 3 * LANES)
    for i in range(n):
        o = vo + i * D + c
        v0, v1, v2, v3 = vload_kv(vb, o), vload_kv(vb, o + LANES), vload_kv(vb, o + 2 * LANES), vload_kv(vb, o + 3 * LANES)
        ea, eb = vsplat(ef[eo + i]), vsplat(ef[eo + P + i])
        a0, a1, a2, a3 = vmac(a0, ea, v0), vmac(a1, ea, v1), vmac(a2, ea, v2), vmac(a3, ea, v3)
        b0, b1, b2, b3 = vmac(b0, eb, v0), vmac(b1, eb, v1), vmac(b2, eb, v2), vmac(b3, eb, v3)
    vstore(acc, o0, a0)
    vstore(acc, o0 + LANES, a1)
    vstore(acc, o0 + 2 * LANES, a2)
    vstore(acc, o0 + 3 * LANES, a3)
    vstore(acc, o1, b0)
    vstore(acc, o1 + LANES, b1)
    vstore(acc, o1 + 2 * LANES, b2)
    vstore(acc, o1 + 3 * LANES, b3)


@njit(**_JIT)
def _v3x4(ef, eo, P, vb, vo, n, acc, ao, D, c):
    """Three heads' 64 columns from c, sharing each value vector."""
    o0, o1, o2 = ao + c, ao + D + c, ao + 2 * D + c
    a0, a1, a2, a3 = vload(acc, o0), vload(acc, o0 + LANES), vload(acc, o0 + 2 * LANES), vload(acc, o0 + 3 * LANES)
    b0, b1, b2, b3 = vload(acc, o1), vload(acc, o1 + LANES), vload(acc, o1 + 2 * LANES), vload(acc, o1 + 3 * LANES)
    c0, c1, c2, c3 = vload(acc, o2), vload(acc, o2 + LANES), vload(acc, o2 + 2 * LANES), vload(acc, o2 + 3 * LANES)
    for i in range(n):
        o = vo + i * D + c
        v0, v1, v2, v3 = vload_kv(vb, o), vload_kv(vb, o + LANES), vload_kv(vb, o + 2 * LANES), vload_kv(vb, o + 3 * LANES)
        ea, eb, ec = vsplat(ef[eo + i]), vsplat(ef[eo + P + i]), vsplat(ef[eo + 2 * P + i])
        a0, a1, a2, a3 = vmac(a0, ea, v0), vmac(a1, ea, v1), vmac(a2, ea, v2), vmac(a3, ea, v3)
        b0, b1, b2, b3 = vmac(b0, eb, v0), vmac(b1, eb, v1), vmac(b2, eb, v2), vmac(b3, eb, v3)
        c0, c1, c2, c3 = vmac(c0, ec, v0), vmac(c1, ec, v1), vmac(c2, ec, v2), vmac(c3, ec, v3)
    vstore(acc, o0, a0)
    vstore(acc, o0 + LANES, a1)
    vstore(acc, o0 + 2 * LANES, a2)
    vstore(acc, o0 + 3 * LANES, a3)
    vstore(acc, o1, b0)
    vstore(acc, o1 + LANES, b1)
    vstore(acc, o1 + 2 * LANES, b2)
    vstore(acc, o1 + 3 * LANES, b3)
    vstore(acc, o2, c0)
    vstore(acc, o2 + LANES, c1)
    vstore(acc, o2 + 2 * LANES, c2)
    vstore(acc, o2 + 3 * LANES, c3)


@njit(**_JIT)
def _v4x4(ef, eo, P, vb, vo, n, acc, ao, D, c):
    """Four heads' 64 columns from c, sharing each value vector."""
    o0, o1, o2, o3 = ao + c, ao + D + c, ao + 2 * D + c, ao + 3 * D + c
    a0, a1, a2, a3 = vload(acc, o0), vload(acc, o0 + LANES), vload(acc, o0 + 2 * LANES), vload(acc, o0 + 3 * LANES)
    b0, b1, b2, b3 = vload(acc, o1), vload(acc, o1 + LANES), vload(acc, o1 + 2 * LANES), vload(acc, o1 + 3 * LANES)
    c0, c1, c2, c3 = vload(acc, o2), vload(acc, o2 + LANES), vload(acc, o2 + 2 * LANES), vload(acc, o2 + 3 * LANES)
    d0, d1, d2, d3 = vload(acc, o3), vload(acc, o3 + LANES), vload(acc, o3 + 2 * LANES), vload(acc, o3 + 3 * LANES)
    for i in range(n):
        o = vo + i * D + c
        v0, v1, v2, v3 = vload_kv(vb, o), vload_kv(vb, o + LANES), vload_kv(vb, o + 2 * LANES), vload_kv(vb, o + 3 * LANES)
        ea, eb = vsplat(ef[eo + i]), vsplat(ef[eo + P + i])
        ec, ed = vsplat(ef[eo + 2 * P + i]), vsplat(ef[eo + 3 * P + i])
        a0, a1, a2, a3 = vmac(a0, ea, v0), vmac(a1, ea, v1), vmac(a2, ea, v2), vmac(a3, ea, v3)
        b0, b1, b2, b3 = vmac(b0, eb, v0), vmac(b1, eb, v1), vmac(b2, eb, v2), vmac(b3, eb, v3)
        c0, c1, c2, c3 = vmac(c0, ec, v0), vmac(c1, ec, v1), vmac(c2, ec, v2), vmac(c3, ec, v3)
        d0, d1, d2, d3 = vmac(d0, ed, v0), vmac(d1, ed, v1), vmac(d2, ed, v2), vmac(d3, ed, v3)
    vstore(acc, o0, a0)
    vstore(acc, o0 + LANES, a1)
    vstore(acc, o0 + 2 * LANES, a2)
    vstore(acc, o0 + 3 * LANES, a3)
    vstore(acc, o1, b0)
    vstore(acc, o1 + LANES, b1)
    vstore(acc, o1 + 2 * LANES, b2)
    vstore(acc, o1 + 3 * LANES, b3)
    vstore(acc, o2, c0)
    vstore(acc, o2 + LANES, c1)
    vstore(acc, o2 + 2 * LANES, c2)
    vstore(acc, o2 + 3 * LANES, c3)
    vstore(acc, o3, d0)
    vstore(acc, o3 + LANES, d1)
    vstore(acc, o3 + 2 * LANES, d2)
    vstore(acc, o3 + 3 * LANES, d3)


@njit(**_JIT)
def value_sums(ef, eo, P, nh, vb, vo, n, acc, ao, D):
    """acc[j, :] += e[j, t] * v[t, :] for heads j < nh and keys t < n, added in order
    (flat offsets as in the module comment above; vb float32 or float16 KV as uint16): up
    to four heads share each loaded value vector, then 16-lane and scalar column tails."""
    dv = D - D % LANES
    c4 = dv - dv % (4 * LANES)
    for c in range(0, c4, 4 * LANES):
        j = 0
        while j < nh:
            left = nh - j
            if left >= 4:
                _v4x4(ef, eo + j * P, P, vb, vo, n, acc, ao + j * D, D, c)
                j += 4
            elif left == 3:
                _v3x4(ef, eo + j * P, P, vb, vo, n, acc, ao + j * D, D, c)
                j += 3
            elif left == 2:
                _v2x4(ef, eo + j * P, P, vb, vo, n, acc, ao + j * D, D, c)
                j += 2
            else:
                _v1x4(ef, eo + j * P, P, vb, vo, n, acc, ao + j * D, D, c)
                j += 1
    for j in range(nh):
        for c in range(c4, dv, LANES):
            a = vload(acc, ao + j * D + c)
            for i in range(n):
                a = vmac(a, vsplat(ef[eo + j * P + i]), vload_kv(vb, vo + i * D + c))
            vstore(acc, ao + j * D + c, a)
        for d in range(dv, D):
            a1 = acc[ao + j * D + d]
            for i in range(n):
                a1 = a1 + ef[eo + j * P + i] * load_kv(vb, vo + i * D + d)
            acc[ao + j * D + d] = a1


@njit(**_JIT)
def _weighted_v(e, vc, vo, P, acc):
    """acc[j, :] = sum_t e[j, t] * v[t, :] for t = 0..P-1, added sequentially in t.

    v[t, :] is vc.flat[vo + t*D : vo + (t+1)*D].  Keys are walked in blocks so
    each block of V stays in L1 while every head's chains pass over it.
    """
    grp, D = acc.shape
    ef, af = e.reshape(-1), acc.reshape(-1)
    for t0 in range(0, P, _KEY_BLOCK):
        t1 = min(t0 + _KEY_BLOCK, P)
        value_sums(ef, t0, P, grp, vc, vo + t0 * D, t1 - t0, af, 0, D)


@njit(**_JIT)
def normalized(acc, e, P, out, r, h):
    """out[r, h, :] = acc / (the fixed-order sum of e[0:P]): softmax's division, last."""
    inv = _F(1.0) / _sum(e, P)
    for d in range(acc.shape[0]):
        out[r, h, d] = acc[d] * inv


@njit(**_JIT)
def _attend_heads(q, kc, vc, kvo, r, h0, grp, P, scale, out):
    """Query heads h0..h0+grp-1 of row r over the P keys k[t] = kc.flat[kvo + t*D:] (and
    V likewise); the keys are read once per group."""
    H, D = q.shape[1], q.shape[2]
    e = np.empty((grp, P), np.float32)  # scores, then exp(score - max)
    for j in range(grp):
        _scores(q, (r * H + h0 + j) * D, kc, kvo, P, scale, e[j])
    for j in range(grp):
        _exp_less_max(e[j], P)
    acc = np.zeros((grp, D), np.float32)
    _weighted_v(e, vc, kvo, P, acc)
    for j in range(grp):
        normalized(acc[j], e[j], P, out, r, h0 + j)


@njit(**_JIT)
def _gather(blocks, table, first, P, g, buf):
    """buf[t, :] = the key (or value) of kv head g at position first + t, read through the
    block table as float32: buf holds positions in order whatever blocks they lie in."""
    G, B, D = blocks.shape[1], blocks.shape[2], blocks.shape[3]
    dv = D - D % LANES
    for t in range(P):
        p = first + t
        o = ((table[p // B] * G + g) * B + p % B) * D
        for d in range(0, dv, LANES):
            vstore(buf, t * D + d, vload_kv(blocks, o + d))
        for d in range(dv, D):
            buf[t, d] = load_kv(blocks, o + d)


@njit(parallel=True, **_JIT)
def _gather_shared(k_blocks, v_blocks, tables, seq_of, n_pos, kbuf, vbuf):
    """kbuf[u, g, :n_pos[u]] = keys of sequence seq_of[u], kv head g, in position order
    (float32); vbuf likewise: once per call for a sequence with several rows."""
    G = k_blocks.shape[1]
    for task in prange(len(seq_of) * G):
        u, g = task // G, task % G
        _gather(k_blocks, tables[seq_of[u]], 0, n_pos[u], g, kbuf[u, g])
        _gather(v_blocks, tables[seq_of[u]], 0, n_pos[u], g, vbuf[u, g])


@njit(parallel=True, **_JIT)
def _paged_attention(q, k_blocks, v_blocks, tables, row_seq, row_pos, scale, window, buf_of,
                     kbuf, vbuf, out):
    R, H, D = q.shape
    G = k_blocks.shape[1]
    grp = H // G
    # kv head-major: a thread's consecutive tasks read one kv head's keys and values (a
    # 2000-position float32 gather is 1 MB: it stays in L2), where alternating heads evicted
    # them (the default model's 2000-token prefill: attention 2.2 -> 1.5 s)
    for task in prange(R * G):
        g, r = task // R, task % R
        first = max(0, row_pos[r] - window + 1) if window > 0 else 0
        P = row_pos[r] + 1 - first
        u = buf_of[row_seq[r]]
        if u >= 0:  # the sequence's keys were gathered once for all its rows
            _attend_heads(q, kbuf[u, g], vbuf[u, g], first * D, r, g * grp, grp, P, scale, out)
        else:  # a sequence with one row: gather just its window, in this task
            kb = np.empty((P, D), np.float32)
            vb = np.empty((P, D), np.float32)
            _gather(k_blocks, tables[row_seq[r]], first, P, g, kb)
            _gather(v_blocks, tables[row_seq[r]], first, P, g, vb)
            _attend_heads(q, kb, vb, 0, r, g * grp, grp, P, scale, out)


def paged_attention(
    q: np.ndarray,
    k_blocks: np.ndarray,
    v_blocks: np.ndarray,
    tables: np.ndarray,
    row_seq: np.ndarray,
    row_pos: np.ndarray,
    scale: float,
    out: np.ndarray,
    window: int = 0,
) -> np.ndarray:
    """Causal grouped-query attention over a paged KV cache, batch-invariant per row: the
    same bits as `attention` on a contiguous cache (scripts/reference_kernels.py) holding
    the same (float32-converted) keys, whatever blocks they lie in. Row r, head h attends
    to positions 0..row_pos[r] of sequence row_seq[r], kv head h // (n_head // n_kv); with
    a sliding `window` > 0 only to positions max(0, row_pos[r] - window + 1)..row_pos[r]
    (llama.cpp's standard SWA mask).

    k_blocks, v_blocks [n_blocks, n_kv, B, hd]: float32, or float16 (read exactly as
    float32); tables int32 [S, max_blocks]: position p of sequence s lies in block
    tables[s, p // B] at offset p % B; row_seq, row_pos int32 [R]. Each (row, kv head)
    reads its keys and values in position order from float32 buffers, then runs
    the per-head arithmetic (`_attend_heads`) on them; a sequence with several rows in the call (a
    prefill chunk) is gathered once for all of them, up to its last row's position."""
    if k_blocks.dtype == np.float16:
        k_blocks, v_blocks = k_blocks.view(np.uint16), v_blocks.view(np.uint16)
    for name, a, dtype, ndim in (
        ("q", q, np.float32, 3),
        ("k_blocks", k_blocks, k_blocks.dtype, 4),
        ("v_blocks", v_blocks, k_blocks.dtype, 4),
        ("tables", tables, np.int32, 2),
        ("row_seq", row_seq, np.int32, 1),
        ("row_pos", row_pos, np.int32, 1),
        ("out", out, np.float32, 3),
    ):
        _require(name, a, dtype, ndim)
    if k_blocks.dtype not in (np.float32, np.uint16):
        raise ValueError(f"paged_attention: KV dtype must be float32 or float16, got {k_blocks.dtype}")
    R, H, D = q.shape
    NB, G, B, D2 = k_blocks.shape
    if D2 != D or v_blocks.shape != k_blocks.shape or out.shape != q.shape or H % G:
        raise ValueError(f"paged_attention: shapes q{q.shape} kv{k_blocks.shape} out{out.shape}")
    if row_seq.shape != (R,) or row_pos.shape != (R,):
        raise ValueError("paged_attention: row_seq and row_pos must be [R]")
    if R:
        if row_seq.min() < 0 or row_seq.max() >= tables.shape[0] or row_pos.min() < 0 \
                or row_pos.max() >= tables.shape[1] * B:
            raise ValueError("paged_attention: row_seq / row_pos out of range")
        read = tables[row_seq][np.arange(tables.shape[1]) <= (row_pos // B)[:, None]]
        if read.min() < 0 or read.max() >= NB:  # every block a row reads must exist
            raise ValueError("paged_attention: a block table entry is out of range")
    if window < 0:
        raise ValueError(f"paged_attention: window must be >= 0, got {window}")
    # a sequence with several rows (a prefill chunk) is gathered once, not once per row
    counts = np.bincount(row_seq, minlength=tables.shape[0]) if R else np.zeros(tables.shape[0], np.int64)
    multi = np.nonzero(counts > 1)[0].astype(np.int32)
    buf_of = np.full(tables.shape[0], -1, np.int32)
    buf_of[multi] = np.arange(len(multi), dtype=np.int32)
    n_pos = np.zeros(len(multi), np.int32)
    if len(multi):
        mine = buf_of[row_seq] >= 0
        np.maximum.at(n_pos, buf_of[row_seq[mine]], row_pos[mine] + 1)
    width = int(n_pos.max()) if len(multi) else 0
    kbuf = np.empty((len(multi), G, width, D), np.float32)
    vbuf = np.empty((len(multi), G, width, D), np.float32)
    if len(multi):
        _gather_shared(k_blocks, v_blocks, tables, multi, n_pos, kbuf, vbuf)
    _paged_attention(q, k_blocks, v_blocks, tables, row_seq, row_pos, np.float32(scale),
                     np.int64(window), buf_of, kbuf, vbuf, out)
    return out


@njit(**_JIT)
def _rope(x, pos, cos, sin, neox, out):
    R, H, D = x.shape
    half = cos.shape[1]
    for r in range(R):
        p = pos[r]
        for h in range(H):
            for i in range(half):
                c, s = cos[p, i], sin[p, i]
                ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
                a, b = x[r, h, ia], x[r, h, ib]
                out[r, h, ia] = a * c - b * s
                out[r, h, ib] = b * c + a * s
            for j in range(2 * half, D):
                out[r, h, j] = x[r, h, j]


def rope(x: np.ndarray, positions: np.ndarray, neox: bool, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary embedding of x f32[R, H, hd] at `positions` [R] with float32 tables
    [max_pos, rope_dim/2]: `ArrayBackend.rope`'s numpy expressions element for element
    (a*cos - b*sin and b*cos + a*sin, each product and sum rounded to float32, no FMA:
    no fast-math), in one call instead of a dozen numpy temporaries."""
    out = np.empty_like(x)
    _rope(x, positions, cos, sin, neox, out)
    return out
