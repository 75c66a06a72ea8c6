"""K-quant products with activations rounded to 8 bits, as llama.cpp computes them.

A float32 product over dequantized Q4_K weights costs more in arithmetic than its bytes
cost in memory (a weight decoded, scaled and multiplied per lane). llama.cpp instead
rounds each activation row to int8 in blocks of 256 (its Q8_K: one float scale a block,
`quantize_row_q8_K_ref`), and multiplies integer codes by integer activations: exact
integer sums, one float multiply-add per super-block. So does this module, in the form
the compile target's instruction set allows (`target_form`, chosen when numba compiles:
NUMBA_CPU_NAME / NUMBA_CPU_FEATURES pick another target): VNNI (`vpdpbusd`: 64 u8 x s8
products a instruction, `vpdpwssd` for the sub-block scales), AVX-512 BW without VNNI or
AVX2 (`vpmaddubsw` / `vpmaddwd`, as llama.cpp's AVX2 code; codes below 64 never reach
its saturation), and plain LLVM integer vectors anywhere else (ARM servers). Integer sums
are exact, so every form gives the same integers and the same floats.

Per output element (row m, column n), super-block s in increasing order:

  isum = sum over the 256 weights k of sc[j(k)] * q[k] * xq[k]               (exact int32)
  msum = sum over the 8 sub-blocks j of m[j] * (xq sum of sub-block j)        (exact int32)
  acc  = (acc + (dx * d) * f32(isum)) - (dx * dmin) * f32(msum)               (float32)

with dx the row's block scale, d and dmin the super-block's; out = acc after the last
super-block (Q6_K: one integer, isum - 32 * sum_g sc[g] * (xq sum of group g), and
acc + (dx * d) * f32(it)). Integer sums are exact, so how they are formed is free: here
16 lanes of partial sums per element, reduced at each super-block (few rows); in
`q8k_panel` 16 columns per vector against codes decoded once (many rows). Nothing in it
depends on other rows or on how many there are: a row's bits are the same alone or in any
batch, and by either path. The row tiles here (below `q8k_panel`'s row counts) compute four
weight rows against four activation rows at a time, then two, then one (each block decoded
once for the rows of a tile), in chunks of 64 rows that stay in L2; the tiles choose only
which elements are computed together.
`reference_q4_k` is the same arithmetic in numpy (the tests' exact reference).
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from panechat.backends.cpu.numpy_kernels import _JIT, _element_ptr, _is_c_array, column_task, column_tasks, prefetch

QK = 256  # weights (and activations) a super-block

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_B64 = ir.VectorType(_I8, 64)
_B32 = ir.VectorType(_I8, 32)
_B16 = ir.VectorType(_I8, 16)
_V16 = ir.VectorType(_I32, 16)
_V8 = ir.VectorType(_I32, 8)
_H16 = ir.VectorType(_I16, 16)
_H32 = ir.VectorType(_I16, 32)
_F16V = ir.VectorType(ir.FloatType(), 16)


FORMS = ("vnni", "avx512", "avx2", "generic")  # the integer-product forms, fastest first


def target_form(features: str | None = None) -> str:
    """The form of the integer products for a compile target's LLVM feature string
    ("+avx2,-avx512f,..."): "vnni" (AVX-512 VNNI and BW: vpdpbusd / vpdpwssd), "avx512"
    (AVX-512 BW: vpmaddubsw / vpmaddwd on 64 bytes), "avx2" (the same on 32-byte halves)
    or "generic" (plain LLVM integer vectors, any CPU). None: numba's target, which honours
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES (a named CPU without features: "generic"). Every form
    computes the same exact integers, so the same bits."""
    if features is None:
        features = config.CPU_FEATURES
        if features is None:
            if config.CPU_NAME not in (None, "host"):
                return "generic"  # a named target: assume only its baseline
            features = llvm.get_host_cpu_features().flatten()
    have = set(features.split(","))
    if {"+avx512bw", "+avx512vnni"} <= have:
        return "vnni"
    if "+avx512bw" in have:
        return "avx512"
    return "avx2" if "+avx2" in have else "generic"


FORM = target_form()  # read at code generation: a kernel compiled for one target keeps its form


def _splat(builder, ty, value):
    return ir.Constant(ty, [value] * ty.count)


def _load(builder, ptr, offset, ty):
    p = builder.gep(ptr, [ir.Constant(ir.IntType(64), offset)]) if offset else ptr
    return builder.load(builder.bitcast(p, ty.as_pointer()), align=1, typ=ty)


def _call(builder, name, ret, *args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, list(args))


def _halves(builder, v, lanes):
    """v's low and high halves (each `lanes` elements)."""
    return [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, lanes), list(range(h, h + lanes))))
            for h in (0, lanes)]


def _join(builder, lo, hi):
    n = lo.type.count
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))


def _madd_words(builder, a, b):
    """Lane l (int32): a16[2l] * b16[2l] + a16[2l + 1] * b16[2l + 1], the int16 halves of
    a and b (vpmaddwd; LLVM's integer vectors in the generic form)."""
    if FORM in ("vnni", "avx512"):
        return _call(builder, "llvm.x86.avx512.pmaddw.d.512", _V16, builder.bitcast(a, _H32), builder.bitcast(b, _H32))
    if FORM == "avx2":
        pa, pb = _halves(builder, builder.bitcast(a, _H32), 16), _halves(builder, builder.bitcast(b, _H32), 16)
        return _join(builder, *[_call(builder, "llvm.x86.avx2.pmadd.wd", _V8, x, y) for x, y in zip(pa, pb)])
    wide = ir.VectorType(_I32, 32)
    prod = builder.mul(builder.sext(builder.bitcast(a, _H32), wide), builder.sext(builder.bitcast(b, _H32), wide))
    even, odd = ([builder.shuffle_vector(prod, prod, ir.Constant(_V16, [2 * l + i for l in range(16)]))
                  for i in (0, 1)])
    return builder.add(even, odd)


def _pair_sums(builder, u8, s8):
    """int16 [32]: u8[2j] * s8[2j] + u8[2j + 1] * s8[2j + 1] (vpmaddubsw; exact for codes
    below 64, which never reach its saturation)."""
    if FORM == "avx2":
        hu, hs = _halves(builder, u8, 32), _halves(builder, s8, 32)
        return _join(builder, *[_call(builder, "llvm.x86.avx2.pmadd.ub.sw", _H16, x, y) for x, y in zip(hu, hs)])
    return _call(builder, "llvm.x86.avx512.pmaddubs.w.512", _H32, u8, s8)


def _dot4(builder, acc, u8, s8):
    """acc[l] + sum_{i<4} u8[4l+i] * s8[4l+i] for 16 int32 lanes (u8 below 64; exact)."""
    u8, s8 = builder.bitcast(u8, _B64), builder.bitcast(s8, _B64)
    if FORM == "vnni":
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", _V16, acc, builder.bitcast(u8, _V16),
                     builder.bitcast(s8, _V16))
    if FORM in ("avx512", "avx2"):
        return builder.add(acc, _madd_words(builder, _pair_sums(builder, u8, s8), _splat(builder, _H32, 1)))
    return dot4_plain(builder, acc, u8, s8)


def dot4_plain(builder, acc, u8, s8):
    """`_dot4` in plain LLVM integer vectors (any CPU; any u8, exact): the generic form."""
    prod = builder.mul(builder.zext(u8, ir.VectorType(_I32, 64)), builder.sext(s8, ir.VectorType(_I32, 64)))
    for i in range(4):
        acc = builder.add(acc, builder.shuffle_vector(prod, prod, ir.Constant(_V16, [4 * l + i for l in range(16)])))
    return acc


def _dot2(builder, acc, a, b):
    """acc[l] + a16[2l] * b16[2l] + a16[2l+1] * b16[2l+1], the signed int16 halves of a, b."""
    if FORM == "vnni":
        return _call(builder, "llvm.x86.avx512.vpdpwssd.512", _V16, acc, a, b)
    return builder.add(acc, _madd_words(builder, a, b))


def _scaled_dot(builder, acc, u8, s8, sc):
    """acc[l] + sc[l] * sum_{i<4} u8[4l+i] * s8[4l+i] (u8 below 64, sc int32 lanes with
    their signed int16 scale in the low half and 0 in the high half; exact)."""
    if FORM == "vnni":
        zero = ir.Constant(_V16, None)
        dot = _call(builder, "llvm.x86.avx512.vpdpbusd.512", _V16, zero, builder.bitcast(u8, _V16),
                    builder.bitcast(s8, _V16))
        # vpdpwssd: dot's high int16 is its sign, times sc's high half 0
        return _call(builder, "llvm.x86.avx512.vpdpwssd.512", _V16, acc, dot, sc)
    if FORM in ("avx512", "avx2"):
        both = builder.or_(sc, builder.shl(sc, _splat(builder, _V16, 16)))  # the scale in each int16 half
        return builder.add(acc, _madd_words(builder, _pair_sums(builder, u8, s8), both))
    dot = dot4_plain(builder, ir.Constant(_V16, None), u8, s8)
    return builder.add(acc, builder.mul(dot, builder.sext(builder.trunc(sc, ir.VectorType(_I16, 16)), _V16)))


def _times_small(builder, a, b):
    """a * b lane by lane, for a int32 in int16 range and b with its signed int16 value in the
    low half and 0 in the high half (one vpmaddwd: a's sign half meets b's zero half)."""
    if FORM == "generic":
        return builder.mul(a, builder.sext(builder.trunc(b, ir.VectorType(_I16, 16)), _V16))
    return _madd_words(builder, a, b)


def _scales_mins(builder, wp):
    """The 6-bit scales and mins of the Q4_K block at wp as int32 lanes (sc0..7, m0..7):
    llama.cpp's utmp unpacking of the 12 bytes at wp + 4, in one 4-lane vector."""
    v4 = ir.VectorType(_I32, 4)
    v = _load(builder, wp, 4, v4)  # u0, u1, u2 (and 4 code bytes, unused)
    p = builder.shuffle_vector(v, v, ir.Constant(v4, [0, 2, 1, 2]))
    q = builder.shuffle_vector(v, v, ir.Constant(v4, [0, 0, 1, 1]))
    low = builder.and_(p, _splat(builder, v4, 0x3F3F3F3F))  # lanes 0, 2: u0 & k1, u1 & k1
    high = builder.or_(builder.and_(builder.lshr(p, ir.Constant(v4, [0, 0, 0, 4])), _splat(builder, v4, 0x0F0F0F0F)),
                       builder.shl(builder.and_(builder.lshr(q, _splat(builder, v4, 6)),
                                                _splat(builder, v4, 0x03030303)), _splat(builder, v4, 4)))
    words = builder.select(ir.Constant(ir.VectorType(ir.IntType(1), 4), [1, 0, 1, 0]), low, high)
    return builder.zext(builder.bitcast(words, _B16), _V16)


_S_PICKS = [[0] * 8 + [2] * 8, [1] * 8 + [3] * 8, [4] * 8 + [6] * 8, [5] * 8 + [7] * 8]
_M_PICKS = [8 + l // 2 for l in range(16)]  # lane l: the min of sub-block l // 2


def _splat_f32(builder, s):
    return builder.shuffle_vector(builder.insert_element(ir.Constant(_F16V, None), s, ir.Constant(_I32, 0)),
                                  ir.Constant(_F16V, None), ir.Constant(_V16, [0] * 16))


_Q5_BITS = ((0, 2), (1, 3), (4, 6), (5, 7))  # qh bits of each code vector's two 32-byte halves


def _bits_to(builder, qh, bits, to, mask):
    """A 64-byte vector whose first 32 bytes hold bit(s) bits[0].. of the 32 bytes at qh
    moved to bit `to` (then masked by the byte `mask`), the last 32 bytes bits[1]..: one
    variable shift of 32-bit words on the bytes loaded twice (a bit moved within its byte
    never meets its neighbours' bits under the mask)."""
    half = _load(builder, qh, 0, _B32)
    both = builder.bitcast(builder.shuffle_vector(half, half, ir.Constant(ir.VectorType(_I32, 64), list(range(64)))), _V16)
    left = bits[0] < to  # the pairs here shift both halves the same way
    counts = ir.Constant(_V16, [abs(to - b) for b in bits for _ in range(8)])
    moved = builder.shl(both, counts) if left else builder.lshr(both, counts)
    return builder.and_(builder.bitcast(moved, _B64), _splat(builder, _B64, mask))


def _q4k_codes(builder, wp, q5):
    """The four 64-byte code vectors of a Q4_K (q5: Q5_K) block, in `_q4k_block`'s lane order."""
    lo4 = _splat(builder, _B64, 0x0F)
    codes = []
    for half in (0, 64):
        q = _load(builder, wp, (48 if q5 else 16) + half, _B64)
        codes += [builder.and_(q, lo4), builder.and_(builder.lshr(q, _splat(builder, _B64, 4)), lo4)]
    if q5:
        qh = builder.gep(wp, [ir.Constant(ir.IntType(64), 16)])
        for i, bits in enumerate(_Q5_BITS):
            codes[i] = builder.or_(codes[i], _bits_to(builder, qh, bits, 4, 0x10))
    return codes


def _reduce_pair(builder, a, b):
    """The sums of the 16 int32 lanes of a and of b (exact in any order): one shuffle tree
    for both, a's lanes in the low half and b's in the high half."""
    v = builder.add(builder.shuffle_vector(a, b, ir.Constant(_V16, list(range(8)) + list(range(16, 24)))),
                    builder.shuffle_vector(a, b, ir.Constant(_V16, list(range(8, 16)) + list(range(24, 32)))))
    for h in (4, 2, 1):
        v = builder.add(v, builder.shuffle_vector(v, v, ir.Constant(_V16, [i + h if i % 8 < h else i for i in range(16)])))
    return builder.extract_element(v, ir.Constant(_I32, 0)), builder.extract_element(v, ir.Constant(_I32, 8))


def _float_step(builder, acc, dd, isum, dm, msum):
    """The contract's float step: (acc + dd * f32(isum)) - dm * f32(msum), each a plain IEEE
    operation (the panels do the same on 16 columns' lanes)."""
    f32 = acc.type
    acc = builder.fadd(acc, builder.fmul(dd, builder.sitofp(isum, f32)))
    return builder.fsub(acc, builder.fmul(dm, builder.sitofp(msum, f32)))


def _q4k_ints(builder, wp, xp, bp, q5=False):
    """isum and msum of one Q4_K super-block (module docstring) as 16 int32 lanes of partial
    sums each: wp its 144 bytes, xp the row's 256 int8 activations, bp their 16 int16 sums
    of 16. q5: a Q5_K block (176 bytes: qh[32] at 16, qs at 48; weight 32j + l has bit j of
    qh[l] as its fifth bit)."""
    cat = ir.Constant(ir.VectorType(_I32, 64), list(range(64)))
    codes = _q4k_codes(builder, wp, q5)
    xs = []
    for a, b in ((0, 64), (32, 96), (128, 192), (160, 224)):  # the weights of each code vector
        xs.append(builder.shuffle_vector(_load(builder, xp, a, _B32), _load(builder, xp, b, _B32), cat))
    sm = _scales_mins(builder, wp)
    zero = ir.Constant(_V16, None)
    part = [zero, zero]  # two chains of integer adds (exact: their order cannot matter), half the latency
    for i, (c, x, picks) in enumerate(zip(codes, xs, _S_PICKS)):
        part[i & 1] = _scaled_dot(builder, part[i & 1], c, x, builder.shuffle_vector(sm, sm, ir.Constant(_V16, picks)))
    isum = builder.add(part[0], part[1])
    # msum[l] = m[l // 2] * (sum of activation group l): the mins' part, exact
    bs = builder.sext(_load(builder, bp, 0, _H16), _V16)
    return isum, _times_small(builder, bs, builder.shuffle_vector(sm, sm, ir.Constant(_V16, _M_PICKS)))


def _q4k_block(builder, acc, wp, xp, bp, dd, dm, q5=False):
    """acc (float32) after one Q4_K (q5: Q5_K) super-block against one activation row."""
    isum, msum = _reduce_pair(builder, *_q4k_ints(builder, wp, xp, bp, q5))
    return _float_step(builder, acc, dd, isum, dm, msum)


def _q6k_ints(builder, wp, xp, bp):
    """The one integer of a Q6_K super-block (module docstring) as 16 int32 lanes of partial
    sums, and a zero msum: wp its 210 bytes, xp the row's 256 int8 activations, bp their 16
    int16 sums of 16. Codes are taken unsigned (0..63) and the offset 32 subtracted as
    32 * sc[g] * (sum of group g's activations)."""
    lo4 = _splat(builder, _B64, 0x0F)
    sc = _load(builder, wp, 192, _B16)
    sc16 = builder.zext(builder.sext(sc, ir.VectorType(_I16, 16)), _V16)  # signed scale in the low half
    zero = ir.Constant(_V16, None)
    part = [zero, zero]  # one chain of integer adds per half (exact in any order)
    for h in (0, 1):
        ql = _load(builder, wp, 64 * h, _B64)
        qh = builder.gep(wp, [ir.Constant(ir.IntType(64), 128 + 32 * h)])
        highs = (_bits_to(builder, qh, (0, 2), 4, 0x30), _bits_to(builder, qh, (4, 6), 4, 0x30))  # bits 2q, 2q+1 at 4, 5
        lows = (builder.and_(ql, lo4), builder.and_(builder.lshr(ql, _splat(builder, _B64, 4)), lo4))
        for c in (0, 1):  # weights 128h + 64c + b for byte b
            code = builder.or_(lows[c], highs[c])
            x = _load(builder, xp, 128 * h + 64 * c, _B64)
            picks = [8 * h + 4 * c + l // 4 for l in range(16)]
            part[h] = _scaled_dot(builder, part[h], code, x, builder.shuffle_vector(sc16, sc16, ir.Constant(_V16, picks)))
    isum = builder.add(part[0], part[1])
    bs = builder.sext(_load(builder, bp, 0, _H16), _V16)
    corr = _times_small(builder, bs, sc16)  # lane g: sc[g] * (sum of group g)
    return builder.sub(isum, builder.shl(corr, _splat(builder, _V16, 5))), zero


def _q6k_block(builder, acc, wp, xp, bp, dd, dm):
    """acc (float32) after one Q6_K super-block against one activation row (dm unused)."""
    tot, _ = _reduce_pair(builder, *_q6k_ints(builder, wp, xp, bp))
    return builder.fadd(acc, builder.fmul(dd, builder.sitofp(tot, ir.FloatType())))


def _reduce_quad(builder, isums, msums):
    """The lane sums of four isum and four msum vectors (four elements' partial sums), as two
    <4 x i32>: one shuffle tree for all eight (exact in any order)."""
    def combine(a, b, lo, step):
        return builder.add(builder.shuffle_vector(a, b, ir.Constant(_V16, lo)),
                           builder.shuffle_vector(a, b, ir.Constant(_V16, [i + step for i in lo])))

    halves = list(range(8)) + list(range(16, 24))
    v = [combine(isums[0], isums[1], halves, 8), combine(isums[2], isums[3], halves, 8),
         combine(msums[0], msums[1], halves, 8), combine(msums[2], msums[3], halves, 8)]
    quarters = [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]
    w = [combine(v[0], v[1], quarters, 4), combine(v[2], v[3], quarters, 4)]
    u = combine(w[0], w[1], [0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29], 2)
    v8 = ir.VectorType(_I32, 8)
    t = builder.add(builder.shuffle_vector(u, u, ir.Constant(v8, list(range(0, 16, 2)))),
                    builder.shuffle_vector(u, u, ir.Constant(v8, list(range(1, 16, 2)))))
    v4 = ir.VectorType(_I32, 4)
    return (builder.shuffle_vector(t, t, ir.Constant(v4, [0, 1, 2, 3])),
            builder.shuffle_vector(t, t, ir.Constant(v4, [4, 5, 6, 7])))


def _block_product(name, emit):
    """An intrinsic (acc, w, wo, xq, xo, bs, bo, dd, dm) -> acc after the super-block at byte
    wo of the uint8 C-array w, against the int8 activations xq.flat[xo : xo + 256] (C-array)
    with their int16 sums of 16 at bs.flat[bo : bo + 16]; dd = dx * d and dm = dx * dmin
    (float32). `emit(builder, acc, wp, xp, bp, dd, dm)` writes the block's arithmetic."""

    def typer(typingctx, acc, w, wo, xq, xo, bs, bo, dd, dm):
        if not (acc == types.float32 and _is_c_array(w, types.uint8) and _is_c_array(xq, types.int8)
                and _is_c_array(bs, types.int16) and all(isinstance(a, types.Integer) for a in (wo, xo, bo))
                and dd == types.float32 and dm == types.float32):
            return None

        def codegen(context, builder, sig, args):
            a, wv, wov, xv, xov, bv, bov, ddv, dmv = args
            wp = _element_ptr(context, builder, sig.args[1], wv, sig.args[2], wov)
            xp = _element_ptr(context, builder, sig.args[3], xv, sig.args[4], xov)
            bp = _element_ptr(context, builder, sig.args[5], bv, sig.args[6], bov)
            return emit(builder, a, wp, xp, bp, ddv, dmv)

        return types.float32(acc, w, wo, xq, xo, bs, bo, dd, dm), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


def _block_product4(name, ints, q6):
    """An intrinsic (acc, w, wo, rb, xq, xo, bs, bo, dd, dm) -> acc, for four columns at once
    (acc, dd, dm: 4-tuples of float32): the super-blocks at bytes wo, wo + rb, wo + 2 rb,
    wo + 3 rb of w against one activation row, as `_block_product` (the same integers and
    float steps; the four elements' lanes reduced together, their float steps in 4 lanes)."""
    quad = types.UniTuple(types.float32, 4)

    def typer(typingctx, acc, w, wo, rb, xq, xo, bs, bo, dd, dm):
        if not (acc == quad and dd == quad and dm == quad and _is_c_array(w, types.uint8)
                and _is_c_array(xq, types.int8) and _is_c_array(bs, types.int16)
                and all(isinstance(a, types.Integer) for a in (wo, rb, xo, bo))):
            return None

        def codegen(context, builder, sig, args):
            a, wv, wov, rbv, xv, xov, bv, bov, ddv, dmv = args
            xp = _element_ptr(context, builder, sig.args[4], xv, sig.args[5], xov)
            bp = _element_ptr(context, builder, sig.args[6], bv, sig.args[7], bov)
            base = context.cast(builder, wov, sig.args[2], types.intp)
            step = context.cast(builder, rbv, sig.args[3], types.intp)
            parts = []
            for i in range(4):
                off = builder.add(base, builder.mul(step, ir.Constant(step.type, i)))
                parts.append(ints(builder, _element_ptr(context, builder, sig.args[1], wv, types.intp, off), xp, bp))
            isum, msum = _reduce_quad(builder, [p[0] for p in parts], [p[1] for p in parts])
            f4 = ir.VectorType(ir.FloatType(), 4)

            def vec(t):
                v = ir.Constant(f4, None)
                for i in range(4):
                    v = builder.insert_element(v, builder.extract_value(t, i), ir.Constant(_I32, i))
                return v

            acc, dd = vec(a), vec(ddv)
            if q6:
                acc = builder.fadd(acc, builder.fmul(dd, builder.sitofp(isum, f4)))
            else:
                acc = _float_step(builder, acc, dd, isum, vec(dmv), msum)
            return context.make_tuple(builder, quad, [builder.extract_element(acc, ir.Constant(_I32, i))
                                                      for i in range(4)])

        return quad(acc, w, wo, rb, xq, xo, bs, bo, dd, dm), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


q4k_block4 = _block_product4("q4k_block4", _q4k_ints, False)  # four Q4_K columns
q5k_block4 = _block_product4("q5k_block4", lambda *a: _q4k_ints(*a, q5=True), False)  # four Q5_K columns
q6k_block4 = _block_product4("q6k_block4", _q6k_ints, True)  # four Q6_K columns
q4k_block = _block_product("q4k_block", _q4k_block)  # a Q4_K block (144 bytes)
q5k_block = _block_product("q5k_block", lambda *a: _q4k_block(*a, q5=True))  # a Q5_K block (176 bytes)
q6k_block = _block_product("q6k_block", _q6k_block)  # a Q6_K block (210 bytes; dm unused)


@njit(inline="always", **_JIT)
def quantize_row_q8k(x, m, xq, xd, xs):
    """Row m of x (float32 [M, K], K a multiple of 256) as llama.cpp's Q8_K: per block of 256,
    iscale = -127 / (the value of largest magnitude, the first one), q = min(127,
    round-half-even(iscale * x)), d = 1 / iscale (0 and q = 0 for an all-zero block); xq
    int8 [M, K], xd float32 [M, K / 256], xs int16 [M, K / 16] (sums of 16 q)."""
    K = x.shape[1]
    for b in range(K // QK):
        o = b * QK
        amax, mx = np.float32(0.0), np.float32(0.0)
        for j in range(o, o + QK):
            ax = abs(x[m, j])
            if ax > amax:
                amax, mx = ax, x[m, j]
        if amax == 0:
            xd[m, b] = np.float32(0.0)
            for j in range(o, o + QK):
                xq[m, j] = 0
        else:
            iscale = np.float32(-127.0) / mx
            for j in range(o, o + QK):
                xq[m, j] = min(127, np.int32(np.rint(iscale * x[m, j])))
            xd[m, b] = np.float32(1.0) / iscale
        for g in range(o // 16, (o + QK) // 16):
            s = np.int32(0)
            for j in range(16 * g, 16 * g + 16):
                s += np.int32(xq[m, j])
            xs[m, g] = s


def reference_q8k(x: np.ndarray):
    """numpy's `quantize_row_q8k` of every row: (xq int8 [M, K], xd float32 [M, K/256],
    xs int16 [M, K/16])."""
    M, K = x.shape
    xb = x.reshape(M, K // QK, QK)
    first = np.abs(xb).argmax(-1)  # argmax takes the first of equal magnitudes, as the loop
    mx = np.take_along_axis(xb, first[..., None], -1)[..., 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx == 0, np.float32(0), np.float32(-127.0) / mx).astype(np.float32)
        q = np.minimum(127, np.rint(iscale[..., None] * xb)).astype(np.int8)
        d = np.where(mx == 0, np.float32(0), np.float32(1.0) / iscale).astype(np.float32)
    q = q.reshape(M, K)
    return q, d, q.reshape(M, K // 16, 16).astype(np.int32).sum(-1).astype(np.int16)


def _q4k_codes_scales(blocks: np.ndarray, N: int, nsb: int, q5=False):
    """The codes int64 [N, nsb, 256] (weight order), scales and mins int64 [N, nsb, 8] of
    Q4_K (q5: Q5_K) blocks, as gguf dequantizes them."""
    b = blocks.reshape(N, nsb, 176 if q5 else 144)
    qs = b[..., 48 if q5 else 16:]
    codes = np.empty((N, nsb, QK), np.int64)
    for g in range(4):
        codes[..., 64 * g:64 * g + 32] = qs[..., 32 * g:32 * g + 32] & 15
        codes[..., 64 * g + 32:64 * g + 64] = qs[..., 32 * g:32 * g + 32] >> 4
    if q5:
        qh = b[..., 16:48].astype(np.int64)
        for j in range(8):
            codes[..., 32 * j:32 * j + 32] |= ((qh >> j) & 1) << 4
    s = b[..., 4:16].astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return codes, sc, mn


def _integer_sums(xq: np.ndarray, weighted: np.ndarray) -> np.ndarray:
    """int64 [M, N, nsb]: sum over each super-block's 256 weights of weighted * xq (exact)."""
    M, K = xq.shape
    N, nsb, _ = weighted.shape
    xb = xq.reshape(M, nsb, QK).astype(np.int64)
    return np.stack([xb[:, s] @ weighted[:, s].T for s in range(nsb)], -1)


def reference_q4_k(x: np.ndarray, blocks: np.ndarray, d: np.ndarray, dmin: np.ndarray, q5=False) -> np.ndarray:
    """The module's arithmetic in numpy: x float32 [M, K] times Q4_K `blocks` [N, K/256*144]
    (d, dmin float32 [N, K/256]) -> float32 [M, N], bit for bit what the kernels give.
    q5: Q5_K blocks (176 bytes)."""
    M, K = x.shape
    N, nsb = d.shape
    xq, xd, xs = reference_q8k(x)
    codes, sc, mn = _q4k_codes_scales(blocks, N, nsb, q5)
    isum = _integer_sums(xq, codes * np.repeat(sc, 32, -1))
    x32 = xs.reshape(M, nsb, 8, 2).astype(np.int64).sum(-1)  # the activations' sum of each sub-block
    msum = np.einsum("nsj,msj->mns", mn, x32)
    acc = np.zeros((M, N), np.float32)
    for s in range(nsb):
        dd = xd[:, s, None] * d[None, :, s]  # float32 products
        dm = xd[:, s, None] * dmin[None, :, s]
        acc = (acc + dd * isum[..., s].astype(np.float32)) - dm * msum[..., s].astype(np.float32)
    return acc


@njit(inline="always", **_JIT)
def _q4k_sb(acc, w, wd, wdm, xq, xd, xs, m, n, s):
    """acc after super-block s of Q4_K weight row n against activation row m."""
    K, dx = xq.shape[1], xd[m, s]
    return q4k_block(acc, w, n * w.shape[1] + s * 144, xq, m * K + s * QK, xs, m * (K // 16) + s * 16,
                     dx * wd[n, s], dx * wdm[n, s])


@njit(inline="always", **_JIT)
def _q5k_sb(acc, w, wd, wdm, xq, xd, xs, m, n, s):
    """acc after super-block s of Q5_K weight row n against activation row m."""
    K, dx = xq.shape[1], xd[m, s]
    return q5k_block(acc, w, n * w.shape[1] + s * 176, xq, m * K + s * QK, xs, m * (K // 16) + s * 16,
                     dx * wd[n, s], dx * wdm[n, s])


@njit(inline="always", **_JIT)
def _q6k_sb(acc, w, wd, wdm, xq, xd, xs, m, n, s):
    """acc after super-block s of Q6_K weight row n against activation row m."""
    K = xq.shape[1]
    return q6k_block(acc, w, n * w.shape[1] + s * 210, xq, m * K + s * QK, xs, m * (K // 16) + s * 16,
                     xd[m, s] * wd[n, s], np.float32(0.0))


@njit(inline="always", **_JIT)
def _prefetch_next(w, n, rb, s, step):
    """Prefetch super-block s of the next tile's four weight rows (a line of each 64 bytes;
    never faults): the first row pass streams the weights from memory."""
    for r in range(4, 8):
        for b in range(0, step, 64):
            prefetch(w, (n + r) * rb + s * step + b)


@njit(inline="always", **_JIT)
def _sb4(acc, w, wd, wdm, xq, xd, xs, m, n, s, step, block4):
    """acc (4 columns) after super-block s (`step` bytes) of weight rows n..n+3 against
    activation row m, by `block4` (a `_block_product4`)."""
    K, dx = xq.shape[1], xd[m, s]
    dd = (dx * wd[n, s], dx * wd[n + 1, s], dx * wd[n + 2, s], dx * wd[n + 3, s])
    dm = (dx * wdm[n, s], dx * wdm[n + 1, s], dx * wdm[n + 2, s], dx * wdm[n + 3, s])
    return block4(acc, w, n * w.shape[1] + s * step, w.shape[1], xq, m * K + s * QK, xs, m * (K // 16) + s * 16,
                  dd, dm)


@njit(inline="always", **_JIT)
def _q4k_sb4(acc, w, wd, wdm, xq, xd, xs, m, n, s):
    """`_sb4` for Q4_K."""
    return _sb4(acc, w, wd, wdm, xq, xd, xs, m, n, s, 144, q4k_block4)


@njit(inline="always", **_JIT)
def _q5k_sb4(acc, w, wd, wdm, xq, xd, xs, m, n, s):
    """`_sb4` for Q5_K."""
    return _sb4(acc, w, wd, wdm, xq, xd, xs, m, n, s, 176, q5k_block4)


@njit(inline="always", **_JIT)
def _q6k_sb4(acc, w, wd, wdm, xq, xd, xs, m, n, s):
    """`_sb4` for Q6_K (wdm unused: its products with dx are passed and never read)."""
    return _sb4(acc, w, wd, wdm, xq, xd, xs, m, n, s, 210, q6k_block4)


@njit(inline="always", **_JIT)
def _zero4():
    z = np.float32(0.0)
    return (z, z, z, z)


@njit(inline="always", **_JIT)
def _store4(out, m, n, a):
    out[m, n], out[m, n + 1], out[m, n + 2], out[m, n + 3] = a[0], a[1], a[2], a[3]


@njit(inline="always", **_JIT)
def _cols4(w, wd, wdm, xq, xd, xs, out, m, n, sb4):
    """out[m, n:n+4]: one activation row against four weight rows (x loads shared)."""
    a = _zero4()
    rb, step = w.shape[1], w.shape[1] // wd.shape[1]
    for s in range(wd.shape[1]):
        if m == 0:
            _prefetch_next(w, n, rb, s, step)
        a = sb4(a, w, wd, wdm, xq, xd, xs, m, n, s)
    _store4(out, m, n, a)


@njit(inline="always", **_JIT)
def _cols4x2(w, wd, wdm, xq, xd, xs, out, m, n, sb4):
    """out[m:m+2, n:n+4]: the codes and scales of four weight rows decoded once for two
    activation rows (the compiler shares what both rows' calls compute alike)."""
    a = b = _zero4()
    rb, step = w.shape[1], w.shape[1] // wd.shape[1]
    for s in range(wd.shape[1]):
        if m == 0:
            _prefetch_next(w, n, rb, s, step)
        a, b = sb4(a, w, wd, wdm, xq, xd, xs, m, n, s), sb4(b, w, wd, wdm, xq, xd, xs, m + 1, n, s)
    _store4(out, m, n, a)
    _store4(out, m + 1, n, b)


@njit(inline="always", **_JIT)
def _cols4x4(w, wd, wdm, xq, xd, xs, out, m, n, sb4):
    """out[m:m+4, n:n+4]: `_cols4x2` for four activation rows (each block decoded once for
    four: a Q6_K verify step's 4 + 1 rows cost 17-30% less than in pairs or by panels)."""
    a = b = c = e = _zero4()
    rb, step = w.shape[1], w.shape[1] // wd.shape[1]
    for s in range(wd.shape[1]):
        if m == 0:
            _prefetch_next(w, n, rb, s, step)
        a, b = sb4(a, w, wd, wdm, xq, xd, xs, m, n, s), sb4(b, w, wd, wdm, xq, xd, xs, m + 1, n, s)
        c, e = sb4(c, w, wd, wdm, xq, xd, xs, m + 2, n, s), sb4(e, w, wd, wdm, xq, xd, xs, m + 3, n, s)
    _store4(out, m, n, a)
    _store4(out, m + 1, n, b)
    _store4(out, m + 2, n, c)
    _store4(out, m + 3, n, e)


@njit(inline="always", **_JIT)
def _col1(w, wd, wdm, xq, xd, xs, out, m, n, sb):
    """out[m, n] alone (the columns past the last whole 4)."""
    a = np.float32(0.0)
    for s in range(wd.shape[1]):
        a = sb(a, w, wd, wdm, xq, xd, xs, m, n, s)
    out[m, n] = a


ROW_CHUNK = 64  # activation rows a column range passes at a time: their int8 rows stay in L2


@njit(inline="always", **_JIT)
def _columns(w, wd, wdm, xq, xd, xs, out, c0, c1, sb, sb4):
    """out[:, c0:c1]: chunks of ROW_CHUNK rows; in each, every four columns against four
    rows at a time, then two, then one. The tiles choose only which elements are computed
    together, never an element's arithmetic: a row's bits do not depend on M."""
    M = out.shape[0]
    c4 = c0 + (c1 - c0) // 4 * 4
    for m0 in range(0, M, ROW_CHUNK):
        m1 = min(M, m0 + ROW_CHUNK)
        for n in range(c0, c4, 4):
            m = m0
            while m + 4 <= m1:
                _cols4x4(w, wd, wdm, xq, xd, xs, out, m, n, sb4)
                m += 4
            while m + 2 <= m1:
                _cols4x2(w, wd, wdm, xq, xd, xs, out, m, n, sb4)
                m += 2
            if m < m1:
                _cols4(w, wd, wdm, xq, xd, xs, out, m, n, sb4)
        for n in range(c4, c1):
            for m in range(m0, m1):
                _col1(w, wd, wdm, xq, xd, xs, out, m, n, sb)


@njit(inline="always", **_JIT)
def q4k_row_columns(w, wd, wdm, xq, xd, xs, out, c0, c1):
    """out[:, c0:c1] for Q4_K weights w (uint8 [N, K/256*144]; d, dmin float32 [N, K/256]) and
    every row's Q8_K activations (`quantize_row_q8k`): four columns at a time, each row in
    turn (the four rows' bytes stay in L1 while every row passes)."""
    _columns(w, wd, wdm, xq, xd, xs, out, c0, c1, _q4k_sb, _q4k_sb4)


@njit(inline="always", **_JIT)
def q5k_row_columns(w, wd, wdm, xq, xd, xs, out, c0, c1):
    """`q4k_row_columns` for Q5_K weights (uint8 [N, K/256*176])."""
    _columns(w, wd, wdm, xq, xd, xs, out, c0, c1, _q5k_sb, _q5k_sb4)


@njit(inline="always", **_JIT)
def q6k_row_columns(w, wd, wdm, xq, xd, xs, out, c0, c1):
    """`q4k_row_columns` for Q6_K weights (uint8 [N, K/256*210]; d float32 [N, K/256], wdm unused)."""
    _columns(w, wd, wdm, xq, xd, xs, out, c0, c1, _q6k_sb, _q6k_sb4)


@njit(inline="always", **_JIT)
def quantized_rows(x):
    """Every row of x as Q8_K: (xq, xd, xs) of `quantize_row_q8k`."""
    M, K = x.shape
    xq, xd, xs = np.empty((M, K), np.int8), np.empty((M, K // QK), np.float32), np.empty((M, K // 16), np.int16)
    for m in range(M):
        quantize_row_q8k(x, m, xq, xd, xs)
    return xq, xd, xs


Q8K_COLS = 16  # output columns a parallel task computes (a multiple of the 4-column tile)


@njit(inline="always", **_JIT)
def q8k_linear_driver(x, ws, wds, wdms, outs, count, columns):
    """outs[j] = x @ W_j.T for the first `count` (1..3) weights of the 3-tuples (as
    `block_linear.block_linear_driver`), by `columns` (a type's column-range product over
    Q8_K activations): x quantized once (rows in parallel), then one parallel region over
    column tasks."""
    M, K = x.shape
    xq, xd, xs = np.empty((M, K), np.int8), np.empty((M, K // QK), np.float32), np.empty((M, K // 16), np.int16)
    for m in prange(M):
        quantize_row_q8k(x, m, xq, xd, xs)
    cols = Q8K_COLS
    t1, t2, t3 = column_tasks(outs, count, cols)
    for t in prange(t3):
        j, n0 = column_task(t, t1, t2, cols)
        out = outs[j]
        columns(ws[j], wds[j], wdms[j], xq, xd, xs, out, n0, min(n0 + cols, out.shape[1]))


def reference_q6_k(x: np.ndarray, blocks: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    """`reference_q4_k` for Q6_K (dmin unused): codes taken unsigned (0..63), the offset 32
    subtracted as 32 * sum_g sc[g] * (sum of activation group g) from the exact sum."""
    M, K = x.shape
    N, nsb = d.shape
    xq, xd, xs = reference_q8k(x)
    b = blocks.reshape(N, nsb, 210).astype(np.int64)
    ql, qh, sc = b[..., :128], b[..., 128:192], b[..., 192:208]
    sc = np.where(sc > 127, sc - 256, sc)
    codes = np.empty((N, nsb, QK), np.int64)
    for h in (0, 1):
        lo, hi = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        o = 128 * h
        codes[..., o:o + 32] = (lo[..., :32] & 15) | ((hi & 3) << 4)
        codes[..., o + 32:o + 64] = (lo[..., 32:] & 15) | (((hi >> 2) & 3) << 4)
        codes[..., o + 64:o + 96] = (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4)
        codes[..., o + 96:o + 128] = (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)
    isum = _integer_sums(xq, codes * np.repeat(sc, 16, -1))
    tot = isum - 32 * np.einsum("nsg,msg->mns", sc, xs.reshape(M, nsb, 16).astype(np.int64))
    acc = np.zeros((M, N), np.float32)
    for s in range(nsb):
        acc = acc + (xd[:, s, None] * d[None, :, s]) * tot[..., s].astype(np.float32)
    return acc


def reference_q5_k(x: np.ndarray, blocks: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    """`reference_q4_k` for Q5_K blocks."""
    return reference_q4_k(x, blocks, d, dmin, q5=True)


REFERENCES = {"Q4_K": reference_q4_k, "Q5_K": reference_q5_k, "Q6_K": reference_q6_k}  # type -> its numpy reference (the kernels' bits)


def reference(qtype: str, x: np.ndarray, blocks: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    """x @ W.T for W the `qtype` blocks (d, dmin: `quant_kernels.superblock_scales`) by the
    int8-activation arithmetic, in numpy: what the kernels of a type with `cpu_q8k` give."""
    return REFERENCES[qtype](np.ascontiguousarray(x, np.float32), blocks, d, dmin)
