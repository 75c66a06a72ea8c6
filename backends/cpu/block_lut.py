"""Lookup-table weight loading for 4- and 5-bit blocks (AVX-512 permutes).

A Q4_0 / Q4_1 block, or a Q4_K 32-weight sub-block, has only 16 distinct weight values
(a Q5_0 / Q5_1 block 32): the float32 expression gguf's dequantization applies to code q,
with the block's scales, for q = 0..15 (0..31). The pair loaders in `quant_kernels`
evaluate that expression once per block on the vector iota = (0, 1, ..., 15) -- the same
operations, on the same operands, in the same order as they apply to a vector of codes,
so table[q] is bit for bit the weight -- and then fetch each 16-weight chunk from the
table by its codes with one permute:

  vlut16:  vpermps (llvm.x86.avx512.permvar.sf.512): lane l = table[idx[l] & 15]; the
           index is the zero-extended code byte shifted right, never masked (the
           instruction reads the low 4 bits only);
  vlut32:  vpermt2ps (llvm.x86.avx512.vpermi2var.ps.512): lane l = (t0 ++ t1)[idx[l] & 31],
           the index the low nibble | the fifth bit << 4.

Only where a weight float comes from changes, never its value nor the reduction, so
`block_linear`'s contract holds unchanged. These intrinsics exist only on AVX-512 targets
(`HAS_LUT`); elsewhere the loaders convert and scale every code as before, with the same
results (tests compare both paths bit for bit).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from panechat.backends.cpu.numpy_kernels import LANES, _WIDE, _element_ptr, _is_c_array, f32vec

HAS_LUT = _WIDE  # vpermps / vpermt2ps on 16 float lanes: AVX-512F

_VEC = ir.VectorType(ir.FloatType(), LANES)
_I32VEC = ir.VectorType(ir.IntType(32), LANES)
_U8VEC = ir.VectorType(ir.IntType(8), LANES)
_I32 = ir.IntType(32)


def _splat(builder, value, ty=_I32VEC):
    v = builder.insert_element(ir.Constant(ty, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, ty.count), [0] * ty.count))


def _bytes_i32(context, builder, arrty, arr, idxty, idx):
    """The 16 bytes at arr.flat[idx], zero-extended to 16 x i32."""
    p = _element_ptr(context, builder, arrty, arr, idxty, idx)
    q = builder.load(builder.bitcast(p, _U8VEC.as_pointer()), align=1, typ=_U8VEC)
    return builder.zext(q, _I32VEC)


def _permvar(builder, table, idx):
    fnty = ir.FunctionType(_VEC, [_VEC, _I32VEC])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.permvar.sf.512")
    return builder.call(fn, [table, idx])


def _permvar2(builder, t0, idx, t1):
    fnty = ir.FunctionType(_VEC, [_VEC, _I32VEC, _VEC])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.vpermi2var.ps.512")
    return builder.call(fn, [t0, idx, t1])


@intrinsic
def viota(typingctx):
    """The float32 vector (0, 1, ..., 15): every 4-bit code, in lane order."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VEC, [float(i) for i in range(LANES)])

    return f32vec(), codegen


@intrinsic
def vlut16_nibbles(typingctx, table, arr, i):
    """(table[low nibble], table[high nibble]) of the bytes ``arr.flat[i : i + 16]``
    (uint8 C-array): the weights of a Q4_0 / Q4_1 block from its 16-entry table."""
    if not (table == f32vec and _is_c_array(arr, types.uint8) and isinstance(i, types.Integer)):
        return None
    pair = types.UniTuple(f32vec, 2)

    def codegen(context, builder, sig, args):
        q = _bytes_i32(context, builder, sig.args[1], args[1], sig.args[2], args[2])
        lo = _permvar(builder, args[0], q)
        hi = _permvar(builder, args[0], builder.lshr(q, ir.Constant(_I32VEC, [4] * LANES)))
        return context.make_tuple(builder, sig.return_type, [lo, hi])

    return pair(table, arr, i), codegen


@intrinsic
def vlut16_bits(typingctx, table, arr, i, shift):
    """table[(b >> shift) & 15] for the bytes b of ``arr.flat[i : i + 16]`` (uint8
    C-array, shift 0 or 4): a Q4_K half sub-block from its 16-entry table."""
    if not (table == f32vec and _is_c_array(arr, types.uint8) and isinstance(i, types.Integer)
            and isinstance(shift, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        q = _bytes_i32(context, builder, sig.args[1], args[1], sig.args[2], args[2])
        s = context.cast(builder, args[3], sig.args[3], types.int32)
        return _permvar(builder, args[0], builder.lshr(q, _splat(builder, s)))

    return f32vec(table, arr, i, shift), codegen


@intrinsic
def vlut32_q5(typingctx, t0, t1, arr, qs_at, qh_at, half):
    """Weights 16*half .. 16*half + 15 of a Q5_0 / Q5_1 block from its 32-entry table
    (t0: codes 0-15, t1: 16-31): code = ((qs[j] >> 4*half) & 15) | (bit 16*half + j of
    the little-endian u32 qh) << 4, for the bytes qs = arr.flat[qs_at : qs_at + 16]."""
    if not (t0 == f32vec and t1 == f32vec and _is_c_array(arr, types.uint8)
            and all(isinstance(a, types.Integer) for a in (qs_at, qh_at, half))):
        return None

    def codegen(context, builder, sig, args):
        t0v, t1v, arr_v, qs_v, qh_v, half_v = args
        q = _bytes_i32(context, builder, sig.args[2], arr_v, sig.args[3], qs_v)
        h = context.cast(builder, half_v, sig.args[5], types.int32)
        nib = builder.and_(builder.lshr(q, _splat(builder, builder.shl(h, ir.Constant(_I32, 2)))),
                           ir.Constant(_I32VEC, [15] * LANES))
        p = _element_ptr(context, builder, sig.args[2], arr_v, sig.args[4], qh_v)
        word = builder.load(builder.bitcast(p, _I32.as_pointer()), align=1, typ=_I32)
        first = builder.shl(h, ir.Constant(_I32, 4))
        shifts = builder.add(_splat(builder, first), ir.Constant(_I32VEC, list(range(LANES))))
        bit = builder.and_(builder.shl(builder.lshr(_splat(builder, word), shifts), ir.Constant(_I32VEC, [4] * LANES)),
                           ir.Constant(_I32VEC, [16] * LANES))
        return _permvar2(builder, t0v, builder.or_(nib, bit), t1v)

    return f32vec(t0, t1, arr, qs_at, qh_at, half), codegen


@intrinsic
def vfma_exact(typingctx, a, b, c):
    """Lane-wise a * b + c rounded once (llvm.fma). Only for a * b exact in float32 (a
    4- or 5-bit code times an f16 scale: at most 16 significant bits, never below
    float32's normal range), where it is bit for bit the rounded multiply then add."""
    if not (a == f32vec and b == f32vec and c == f32vec):
        return None

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_VEC, [_VEC, _VEC, _VEC])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.v16f32")
        return builder.call(fn, list(args))

    return f32vec(a, b, c), codegen


@intrinsic
def vsplat_f16_pair(typingctx, arr, i):
    """(splat(a), splat(b)) for the two IEEE halves a, b at bytes ``arr.flat[i : i + 4]``
    (uint8 C-array), widened exactly: one 32-bit broadcast load and one vcvtph2ps for
    both (an F16C / AVX-512 target), then the even and odd lanes duplicated."""
    if not (_is_c_array(arr, types.uint8) and isinstance(i, types.Integer)):
        return None
    pair = types.UniTuple(f32vec, 2)

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        word = builder.load(builder.bitcast(p, _I32.as_pointer()), align=1, typ=_I32)
        v = _splat(builder, word, ir.VectorType(_I32, LANES // 2))  # 8 x (a, b)
        h = builder.bitcast(v, ir.VectorType(ir.HalfType(), LANES))
        f = builder.fpext(h, _VEC)  # (a, b, a, b, ...)
        even = ir.Constant(_I32VEC, [i & ~1 for i in range(LANES)])
        odd = ir.Constant(_I32VEC, [i | 1 for i in range(LANES)])
        return context.make_tuple(builder, sig.return_type,
                                  [builder.shuffle_vector(f, f, even), builder.shuffle_vector(f, f, odd)])

    return pair(arr, i), codegen


@intrinsic
def vlut32_bits(typingctx, t0, t1, arr, lo_at, lo_shift, hi_at, hi_shift):
    """(t0 ++ t1)[code] for code = ((lo >> lo_shift) & 15) | ((hi >> hi_shift) & 1) << 4,
    lo and hi the bytes ``arr.flat[lo_at : lo_at + 16]`` and ``arr.flat[hi_at : hi_at + 16]``
    (uint8 C-array): a Q5_K half sub-block from its 32-entry table."""
    if not (t0 == f32vec and t1 == f32vec and _is_c_array(arr, types.uint8)
            and all(isinstance(a, types.Integer) for a in (lo_at, lo_shift, hi_at, hi_shift))):
        return None

    def codegen(context, builder, sig, args):
        t0v, t1v, arr_v, lo_v, los_v, hi_v, his_v = args
        lo = _bytes_i32(context, builder, sig.args[2], arr_v, sig.args[3], lo_v)
        hi = _bytes_i32(context, builder, sig.args[2], arr_v, sig.args[5], hi_v)
        los = _splat(builder, context.cast(builder, los_v, sig.args[4], types.int32))
        his = _splat(builder, context.cast(builder, his_v, sig.args[6], types.int32))
        nib = builder.and_(builder.lshr(lo, los), ir.Constant(_I32VEC, [15] * LANES))
        bit = builder.and_(builder.shl(builder.lshr(hi, his), ir.Constant(_I32VEC, [4] * LANES)),
                           ir.Constant(_I32VEC, [16] * LANES))
        return _permvar2(builder, t0v, builder.or_(nib, bit), t1v)

    return f32vec(t0, t1, arr, lo_at, lo_shift, hi_at, hi_shift), codegen
