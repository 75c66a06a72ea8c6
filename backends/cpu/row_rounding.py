"""Activation rows rounded to integers 16 values a vector: the steps `q8k_dot.quantize_row_q8k`
(llama.cpp's Q8_K, int8) and `packed32.quantize_row` (int16 in two int8 planes) take over
a block.

Written as plain loops, the rounding cost 1.4 (Q8_K) and 1.9 (int16) ns a value on the
480 MiB-L3 Xeon: the largest magnitude is a loop-carried compare that LLVM does not
vectorise without fast-math, and the rounding loops stored int8 codes beside float32
reads it had to check for overlap. In the one-call decode step every thread rounds every
row for each product, so at 5 rows of a 1B model that was about 2 ms of a 36 ms step
(docs/benchmarks.md). Here each step is explicit `<16 x ...>` LLVM vector code. Every value
is the plain loops': the largest magnitude is the same value in any order (a NaN is
skipped, as the loops' `>` skips it), the first value of that magnitude is found in order,
and each code is the same IEEE multiply, round-half-even (`llvm.rint`, the default
rounding mode) and conversion lane by lane; the codes' sums are exact integers.
(tests/backends/test_q8k_dot.py and test_repacked.py: the numpy references' bits.)

All arrays are C-contiguous; `i` indexes their flat data. No bounds checks.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from panechat.backends.cpu.numpy_kernels import LANES, _element_ptr, _is_c_array, call_llvm, f32vec, splat_value

_F32 = ir.FloatType()
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_VF = ir.VectorType(_F32, LANES)
_VI = ir.VectorType(_I32, LANES)
_VB = ir.VectorType(_I8, LANES)


def _ptr(context, builder, sig, args, k):
    """Pointer to element args[k + 1] of array args[k]."""
    return _element_ptr(context, builder, sig.args[k], args[k], sig.args[k + 1], args[k + 1])


def _load16(builder, p):
    return builder.load(builder.bitcast(p, _VF.as_pointer()), align=4, typ=_VF)


def _abs(builder, v):
    mask = ir.Constant(_VI, [0x7FFFFFFF] * LANES)
    return builder.bitcast(builder.and_(builder.bitcast(v, _VI), mask), _VF)


def _codes(builder, context, sig, args, scaled_first):
    """fptosi(rint(x[i:i+16] * s)) as <16 x i32>: x is args 0, 1 and s arg 2."""
    x = _load16(builder, _ptr(context, builder, sig, args, 0))
    s = splat_value(builder, args[2], _VF)
    prod = builder.fmul(s, x) if scaled_first else builder.fmul(x, s)
    return builder.fptosi(call_llvm(builder, "llvm.rint.v16f32", _VF, prod), _VI)


def _sum(builder, v):
    return call_llvm(builder, "llvm.vector.reduce.add.v16i32", _I32, v)


@intrinsic
def abs_max16(typingctx, x, i, m):
    """Lane l: |x[i + l]| if it is greater than m[l], else m[l] (float32 vectors)."""
    if not (_is_c_array(x, types.float32) and isinstance(i, types.Integer) and m == f32vec):
        return None

    def codegen(context, builder, sig, args):
        a = _abs(builder, _load16(builder, _ptr(context, builder, sig, args, 0)))
        return builder.select(builder.fcmp_ordered(">", a, args[2]), a, args[2])

    return f32vec(x, i, m), codegen


@intrinsic
def first_of_magnitude16(typingctx, x, i, a):
    """The first l < 16 with |x[i + l]| == a, else 16."""
    if not (_is_c_array(x, types.float32) and isinstance(i, types.Integer) and isinstance(a, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        v = _abs(builder, _load16(builder, _ptr(context, builder, sig, args, 0)))
        a32 = context.cast(builder, args[2], sig.args[2], types.float32)
        hits = builder.bitcast(builder.fcmp_ordered("==", v, splat_value(builder, a32, _VF)), _I16)
        word = builder.or_(builder.zext(hits, _I32), ir.Constant(_I32, 1 << LANES))
        return builder.sext(call_llvm(builder, "llvm.cttz.i32", _I32, word, ir.Constant(ir.IntType(1), 0)),
                            ir.IntType(64))

    return types.int64(x, i, a), codegen


@intrinsic
def round_q8k16(typingctx, x, i, iscale, xq, j):
    """xq[j:j+16] = min(127, rint(iscale * x[i:i+16])) as int8; returns their sum (int32)."""
    if not (_is_c_array(x, types.float32) and _is_c_array(xq, types.int8) and iscale == types.float32
            and isinstance(i, types.Integer) and isinstance(j, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        q = _codes(builder, context, sig, args, True)
        top = ir.Constant(_VI, [127] * LANES)
        q = builder.select(builder.icmp_signed("<", q, top), q, top)
        builder.store(builder.trunc(q, _VB), builder.bitcast(_ptr(context, builder, sig, args, 3), _VB.as_pointer()),
                      align=1)
        return _sum(builder, q)

    return types.int32(x, i, iscale, xq, j), codegen


@intrinsic
def round_int16_16(typingctx, x, i, iscale, xq, ja, jb):
    """q = rint(x[i:i+16] * iscale) (|q| <= 127 * 257) as two int8 planes, q = 256 a + b:
    b = ((q + 128) & 255) - 128 at xq[jb:jb+16], a = (q - b) >> 8 at xq[ja:ja+16]; returns
    the sum of the 16 q (int32)."""
    if not (_is_c_array(x, types.float32) and _is_c_array(xq, types.int8) and iscale == types.float32
            and all(isinstance(t, types.Integer) for t in (i, ja, jb))):
        return None

    def codegen(context, builder, sig, args):
        q = _codes(builder, context, sig, args, False)
        c128, c255 = ir.Constant(_VI, [128] * LANES), ir.Constant(_VI, [255] * LANES)
        low = builder.sub(builder.and_(builder.add(q, c128), c255), c128)
        high = builder.ashr(builder.sub(q, low), ir.Constant(_VI, [8] * LANES))
        xa = _element_ptr(context, builder, sig.args[3], args[3], sig.args[4], args[4])
        xb = _element_ptr(context, builder, sig.args[3], args[3], sig.args[5], args[5])
        builder.store(builder.trunc(high, _VB), builder.bitcast(xa, _VB.as_pointer()), align=1)
        builder.store(builder.trunc(low, _VB), builder.bitcast(xb, _VB.as_pointer()), align=1)
        return _sum(builder, q)

    return types.int32(x, i, iscale, xq, ja, jb), codegen
