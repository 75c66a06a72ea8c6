"""Batch-invariant linear kernels reading GGUF weights as stored: K-quant blocks (Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K), IQ4_XS super-blocks, Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/IQ4_NL blocks and 16-bit
floats (F16, BF16).

The weights stay in ggml's block layout (ggml-common.h; one row of blocks per output
row, read from the file's memory map): each kernel dequantizes 16 weights in registers
into exactly the float32 values `gguf.quants.dequantize` gives, then runs the tile code
and fixed-order reduction of `numpy_kernels.linear` (its module docstring is the
numerical contract). So a product here equals, bit for bit, ``linear(x, dequantize(w))``,
and a row's bits never depend on the batch.
Except for a type whose registry entry names a `cpu_packed` product (Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K, Q6_K): its weights are repacked at load (`repack`) and multiplied in exact
integers over activations rounded to int16 (`packed32`) or, for the K-quants, to 8 bits
as llama.cpp does (its Q8_K: `q8k_dot`, whose docstring is that contract; `packed256`),
by `linear_packed`. The pair loaders below still describe those types' weights (the
tests, the float32 path of `linear_block32` / `linear_kquant`).

Block layouts (256 weights a super-block, sub-block scales packed in the block):

  Q2_K (84 B): u8 scales[16] (low nibble scale, high nibble min), u8 qs[64], f16 d, f16 dmin
      w = (d * sc[g]) * q - (dmin * m[g]),  g = group of 16, q 2 bits: weight i is bits
      2 * ((i % 128) // 32) of qs[32 * (i // 128) + i % 32]
  Q3_K (110 B): u8 hmask[32], u8 qs[64], u8 scales[12] (16 x 6-bit), f16 d
      w = (d * (sc[g] - 32)) * (q - 4 * (1 - h)),  q the 2 low bits (as Q2_K's), h bit
      i // 32 of hmask[i % 32]; sc[g] = nibble g // 8 of scales[g % 8] | (bits
      2 * (g // 4), +1 of scales[8 + g % 4]) << 4
  Q4_K (144 B): f16 d, f16 dmin, u8 scales[12] (8 x 6-bit scale, 8 x 6-bit min), u8 qs[128]
      w = (d * sc[j]) * q - (dmin * m[j]),  j = sub-block of 32
  Q5_K (176 B): f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]
      the same with q = low nibble | high bit << 4
  Q6_K (210 B): u8 ql[128], u8 qh[64], i8 scales[16], f16 d
      w = (d * sc[i // 16]) * (ql | qh << 4 - 32)
  Q5_0 (22 B, 32 weights): f16 d, u32 qh, u8 qs[16]; w = d * (q - 16)
  Q5_1 (24 B, 32 weights): f16 d, f16 m, u32 qh, u8 qs[16]; w = d * q + m
  IQ4_NL (18 B, 32 weights): f16 d, u8 qs[16] (as Q4_0); w = d * kvalues[q], kvalues
      llama.cpp's fixed non-linear table of 16 int8 values (KVALUES)
  IQ4_XS (136 B): f16 d, u16 scales_h, u8 scales_l[4], u8 qs[128]; sub-block j of 32 has
      the 6-bit ls = (nibble j of scales_l) | (bits 2j, 2j+1 of scales_h) << 4 and its 16
      bytes qs[16j:] as IQ4_NL's; w = (d * (ls - 32)) * kvalues[q]
  F16 / BF16: widened exactly (integer bit moves; F16 by a 2**112 scaling of the bits)

Only the per-super-block f16 `d` (and `dmin`) are converted to float32 at load (4 or 8
bytes per 256 weights, wherever the block keeps them); scales and codes are unpacked
from the mapped bytes in every step.
On AVX-512 targets Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, IQ4_NL and IQ4_XS read each weight from a per-block
table of the block's 16 (32) values, computed by the same expression on iota
(`block_lut`), and the 32-weight types splat their f16 scales with one vector
conversion; elsewhere (and for Q2_K, Q3_K and Q6_K on every ISA) every code is converted
and scaled (an IQ4 code looked up in KVALUES lane by lane, then scaled). Both give the
same floats.
Integer codes become floats exactly and are combined by exact float adds, so the only
roundings in a weight are gguf's (sub-scale product, product with the code, then the
min), in gguf's order. As for numpy_kernels, the bits do not depend on the ISA:
all seven types gave identical products on AVX-512, NUMBA_CPU_NAME=haswell and generic
(checked 2026-11-30); IQ4_NL and IQ4_XS gave gguf's products (M 1, 3, 5, 33) on AVX-512 and
with AVX-512 off (haswell, and generic without F16C: the lane-by-lane lookup), 2026-12-01.
Q2_K and Q3_K (one loader on every ISA) gave gguf's weights on AVX-512, haswell and generic,
2026-12-01.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import config
from numba.extending import intrinsic

from panechat.backends.cpu.block_linear import block_linear_driver
from panechat.backends.cpu.block_lut import (HAS_LUT, vfma_exact, viota, vlut16_bits, vlut16_nibbles, vlut32_bits, vlut32_q5,
                        vsplat_f16_pair)
from panechat.backends.cpu.generated import (bind_loader, cacheable, kernel_name, loader_of, packed_activations,
                                            packed_columns_of, uses_amx)
from panechat.backends.cpu.packed32 import GROUP, packed_linear_driver
from panechat.backends.cpu.packed256 import packed_q8k_linear_driver
from panechat.backends.quant import registry
from panechat.backends.cpu.numpy_kernels import (
    _JIT,
    LANES,
    _element_ptr,
    _i32_bits_as_f32,
    _is_c_array,
    _linear_driver,
    _require,
    f32vec,
    vadd,
    vmul,
    vsplat,
)

__all__ = ["kernels", "linear_kquant", "superblock_scales", "linear_half", "linear_block32", "linear_block32_many",
           "linear_kquant_many", "linear_q5", "linear_packed", "linear_packed_many"]

_VEC = ir.VectorType(ir.FloatType(), LANES)
_U8VEC = ir.VectorType(ir.IntType(8), LANES)


@intrinsic
def vload_bits(typingctx, arr, i, shift, mask):
    """float32 vector of ``(arr.flat[i : i + 16] >> shift) & mask`` (uint8 C-array; exact)."""
    if not (_is_c_array(arr, types.uint8) and isinstance(i, types.Integer)
            and isinstance(shift, types.Integer) and isinstance(mask, types.Integer)):
        return None

    def splat8(context, builder, ty, val):
        b = context.cast(builder, val, ty, types.uint8)
        v = builder.insert_element(ir.Constant(_U8VEC, None), b, ir.Constant(ir.IntType(32), 0))
        zeros = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        return builder.shuffle_vector(v, v, zeros)

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        q = builder.load(builder.bitcast(p, _U8VEC.as_pointer()), align=1, typ=_U8VEC)
        q = builder.lshr(q, splat8(context, builder, sig.args[2], args[2]))
        q = builder.and_(q, splat8(context, builder, sig.args[3], args[3]))
        return builder.uitofp(q, _VEC)

    return f32vec(arr, i, shift, mask), codegen


@intrinsic
def vload_nibbles(typingctx, arr, i):
    """(low nibbles, high nibbles) of the bytes ``arr.flat[i : i + 16]`` as two float32
    vectors (uint8 C-array; exact): each byte widened to 32 bits once, then masked and
    shifted there (x86 has no 8-bit vector shift)."""
    if not (_is_c_array(arr, types.uint8) and isinstance(i, types.Integer)):
        return None
    pair = types.UniTuple(f32vec, 2)

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        q = builder.zext(builder.load(builder.bitcast(p, _U8VEC.as_pointer()), align=1, typ=_U8VEC), _I32VEC)
        lo = builder.uitofp(builder.and_(q, _splat32(0x0F)), _VEC)
        hi = builder.uitofp(builder.lshr(q, _splat32(4)), _VEC)
        return context.make_tuple(builder, sig.return_type, [lo, hi])

    return pair(arr, i), codegen


@intrinsic
def vload_s8(typingctx, arr, i):
    """float32 vector of the bytes ``arr.flat[i : i + 16]`` read as int8 (uint8 C-array; exact)."""
    if not (_is_c_array(arr, types.uint8) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        q = builder.load(builder.bitcast(p, _U8VEC.as_pointer()), align=1, typ=_U8VEC)
        return builder.sitofp(q, _VEC)

    return f32vec(arr, i), codegen


@intrinsic
def vsub(typingctx, a, b):
    """Lane-wise a - b."""

    def codegen(context, builder, sig, args):
        return builder.fsub(args[0], args[1])

    return f32vec(f32vec, f32vec), codegen


#: llama.cpp's kvalues_iq4nl (ggml-common.h; gguf.quants.IQ4_NL.kvalues): the 16 weight
#: levels of IQ4_NL and IQ4_XS codes.
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@intrinsic
def vkvalues(typingctx):
    """The float32 vector KVALUES (lane q: the level of code q; exact)."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VEC, [float(v) for v in KVALUES])

    return f32vec(), codegen


@intrinsic
def vtable16_bits(typingctx, table, arr, i, shift):
    """table[(b >> shift) & 15] for the bytes b of ``arr.flat[i : i + 16]`` (uint8 C-array),
    lane by lane (a variable-index extract each: any ISA; `block_lut.vlut16_bits` is the
    one-permute AVX-512 form)."""
    if not (table == f32vec and _is_c_array(arr, types.uint8) and isinstance(i, types.Integer)
            and isinstance(shift, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[1], args[1], sig.args[2], args[2])
        q = builder.zext(builder.load(builder.bitcast(p, _U8VEC.as_pointer()), align=1, typ=_U8VEC), _I32VEC)
        s = context.cast(builder, args[3], sig.args[3], types.int32)
        sv = builder.insert_element(ir.Constant(_I32VEC, None), s, ir.Constant(ir.IntType(32), 0))
        sv = builder.shuffle_vector(sv, sv, ir.Constant(_I32VEC, [0] * LANES))
        idx = builder.and_(builder.lshr(q, sv), _splat32(0x0F))
        out = ir.Constant(_VEC, None)
        for lane in range(LANES):
            at = ir.Constant(ir.IntType(32), lane)
            out = builder.insert_element(out, builder.extract_element(args[0], builder.extract_element(idx, at)), at)
        return out

    return f32vec(table, arr, i, shift), codegen


_I16VEC = ir.VectorType(ir.IntType(16), LANES)
_I32VEC = ir.VectorType(ir.IntType(32), LANES)


def _splat32(value):
    return ir.Constant(_I32VEC, [value] * LANES)


def _load_u16(context, builder, sig, args):
    p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
    h = builder.load(builder.bitcast(p, _I16VEC.as_pointer()), align=2, typ=_I16VEC)
    return builder.zext(h, _I32VEC)


@intrinsic
def vload_f16(typingctx, arr, i):
    """IEEE half ``arr.flat[i : i + 16]`` (uint16 bits, C-array) as float32, exactly.

    Integer arithmetic, not LLVM's fpext (a libcall without F16C): the magnitude's bits
    shifted into float32 position and scaled by 2**112 give every normal and subnormal
    half exactly; inf and NaN keep an all-ones exponent."""
    if not (_is_c_array(arr, types.uint16) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        h = _load_u16(context, builder, sig, args)
        sign = builder.shl(builder.and_(h, _splat32(0x8000)), _splat32(16))
        mag = builder.and_(h, _splat32(0x7FFF))
        scaled = builder.fmul(builder.bitcast(builder.shl(mag, _splat32(13)), _VEC),
                              ir.Constant(_VEC, [2.0 ** 112] * LANES))
        special = builder.or_(builder.shl(mag, _splat32(13)), _splat32(0x7F800000))  # inf, NaN
        is_special = builder.icmp_unsigned(">=", mag, _splat32(0x7C00))
        bits = builder.select(is_special, special, builder.bitcast(scaled, _I32VEC))
        return builder.bitcast(builder.or_(bits, sign), _VEC)

    return f32vec(arr, i), codegen


@intrinsic
def vload_bf16(typingctx, arr, i):
    """bfloat16 ``arr.flat[i : i + 16]`` (uint16 bits, C-array) as float32 (bits << 16)."""
    if not (_is_c_array(arr, types.uint16) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.shl(_load_u16(context, builder, sig, args), _splat32(16)), _VEC)

    return f32vec(arr, i), codegen


@njit(inline="always", **_JIT)
def _load_f16(w, ws, wm, n, k):
    return vload_f16(w, n * w.shape[1] + k)


@njit(inline="always", **_JIT)
def _load_bf16(w, ws, wm, n, k):
    return vload_bf16(w, n * w.shape[1] + k)


@njit(parallel=True, **_JIT)
def _linear_f16(x, w, out):
    _linear_driver(x, w, w, w, out, _load_f16)


@njit(parallel=True, **_JIT)
def _linear_bf16(x, w, out):
    _linear_driver(x, w, w, w, out, _load_bf16)


def linear_half(x: np.ndarray, bits: np.ndarray, qtype: str, out: np.ndarray) -> np.ndarray:
    """out[M, N] = x[M, K] @ W.T for W stored as F16 or BF16 (`qtype`): `bits` uint16 [N, K]
    (C-contiguous, K a multiple of 16), the stored values viewed as integers. Bit-identical
    to ``linear(x, W as float32, out)``. Returns out."""
    _require("x", x, np.float32, 2)
    _require("bits", bits, np.uint16, 2)
    _require("out", out, np.float32, 2)
    M, K = x.shape
    if bits.shape[1] != K or K % LANES or out.shape != (M, bits.shape[0]):
        raise ValueError(f"linear_half: shapes x{x.shape} {qtype} w{bits.shape} out{out.shape} do not "
                         f"match (K a multiple of {LANES})")
    {"F16": _linear_f16, "BF16": _linear_bf16}[qtype](x, bits, out)
    return out


@intrinsic
def vload_bit_lanes(typingctx, arr, i, first):
    """float32 vector whose lane l is bit ``first + l`` of the little-endian uint32 at byte
    ``arr.flat[i]`` (uint8 C-array): the fifth bits of Q5_0/Q5_1."""
    if not (_is_c_array(arr, types.uint8) and isinstance(i, types.Integer) and isinstance(first, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        word = builder.load(builder.bitcast(p, ir.IntType(32).as_pointer()), align=1, typ=ir.IntType(32))
        f = context.cast(builder, args[2], sig.args[2], types.int32)
        v = builder.insert_element(ir.Constant(_I32VEC, None), word, ir.Constant(ir.IntType(32), 0))
        v = builder.shuffle_vector(v, v, ir.Constant(_I32VEC, [0] * LANES))
        fv = builder.insert_element(ir.Constant(_I32VEC, None), f, ir.Constant(ir.IntType(32), 0))
        fv = builder.shuffle_vector(fv, fv, ir.Constant(_I32VEC, [0] * LANES))
        shifts = builder.add(fv, ir.Constant(_I32VEC, list(range(LANES))))
        return builder.uitofp(builder.and_(builder.lshr(v, shifts), _splat32(1)), _VEC)

    return f32vec(arr, i, first), codegen


def _target_has_f16c() -> bool:
    """Whether numba compiles for a CPU with F16C (honours NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)."""
    feats = config.CPU_FEATURES
    if feats is None:
        feats = llvm.get_host_cpu_features().flatten()
    return "+f16c" in feats.split(",")


_F16C = _target_has_f16c()  # without it LLVM's half -> float is a libcall: use integer moves


@intrinsic
def _half_at(typingctx, arr, i):
    """The IEEE half at bytes ``arr.flat[i : i + 2]`` (uint8 C-array) as float32 by the CPU's
    own conversion (F16C vcvtph2ps: exact, like every half -> float widening)."""
    if not (_is_c_array(arr, types.uint8) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        h = builder.load(builder.bitcast(p, ir.IntType(16).as_pointer()), align=1, typ=ir.IntType(16))
        return builder.fpext(builder.bitcast(h, ir.HalfType()), ir.FloatType())

    return types.float32(arr, i), codegen


@njit(inline="always", **_JIT)
def _f16_at(w, n, o):
    """The IEEE half at bytes w[n, o:o+2] as float32, exactly (as vload_f16, one value):
    one vcvtph2ps with F16C, else integer bit moves."""
    if _F16C:
        return _half_at(w, n * w.shape[1] + o)
    h = np.int32(w[n, o]) | (np.int32(w[n, o + 1]) << 8)
    mag = h & 0x7FFF
    if mag >= 0x7C00:
        v = np.float32(np.inf) if mag == 0x7C00 else np.float32(np.nan)
    else:
        v = _i32_bits_as_f32(mag << 13) * np.float32(2.0 ** 112)
    return -v if h & 0x8000 else v


@njit(inline="always", **_JIT)
def _q5_codes(w, n, qh_at, qs_at, half):
    """The 5-bit codes of half `half` (0: weights 0-15, 1: 16-31) of a 32-weight block of
    row n, as floats (exact)."""
    base = n * w.shape[1]
    lo = vload_bits(w, base + qs_at, half * 4, 0x0F)
    hi = vload_bit_lanes(w, base + qh_at, half * 16)
    return vadd(lo, vmul(hi, vsplat(np.float32(16.0))))


# Pair loaders (block_linear): (w[n, k:k+16], w[n, k+16:k+32]) for k a multiple of 32,
# dequantized exactly as gguf does; a block's scales are decoded once for both halves.

@njit(inline="always", **_JIT)
def _arith_q8_0(w, wd, wdm, n, k):
    """Q8_0 (34 B: f16 d, i8 q[32]): d * q."""
    rb = (k >> 5) * 34
    base = n * w.shape[1] + rb
    d = vsplat(_f16_at(w, n, rb))
    return vmul(vload_s8(w, base + 2), d), vmul(vload_s8(w, base + 18), d)


@njit(inline="always", **_JIT)
def _arith_q4_0(w, wd, wdm, n, k):
    """Q4_0 (18 B: f16 d, u8 qs[16]): d * (q - 8); byte j holds weights j and j + 16."""
    rb = (k >> 5) * 18
    base = n * w.shape[1] + rb + 2
    d, eight = vsplat(_f16_at(w, n, rb)), vsplat(np.float32(-8.0))
    lo, hi = vload_nibbles(w, base)
    return vmul(vadd(lo, eight), d), vmul(vadd(hi, eight), d)


@njit(inline="always", **_JIT)
def _arith_q4_1(w, wd, wdm, n, k):
    """Q4_1 (20 B: f16 d, f16 m, u8 qs[16]): d * q + m."""
    rb = (k >> 5) * 20
    base = n * w.shape[1] + rb + 4
    d, m = vsplat(_f16_at(w, n, rb)), vsplat(_f16_at(w, n, rb + 2))
    lo, hi = vload_nibbles(w, base)
    return vadd(vmul(lo, d), m), vadd(vmul(hi, d), m)


@njit(inline="always", **_JIT)
def _arith_q5_0(w, wd, wdm, n, k):
    """Q5_0 (22 B: f16 d, u32 qh, u8 qs[16]): d * (q - 16)."""
    rb = (k >> 5) * 22
    d, sixteen = vsplat(_f16_at(w, n, rb)), vsplat(np.float32(-16.0))
    return (vmul(d, vadd(_q5_codes(w, n, rb + 2, rb + 6, 0), sixteen)),
            vmul(d, vadd(_q5_codes(w, n, rb + 2, rb + 6, 1), sixteen)))


@njit(inline="always", **_JIT)
def _arith_q5_1(w, wd, wdm, n, k):
    """Q5_1 (24 B: f16 d, f16 m, u32 qh, u8 qs[16]): d * q + m."""
    rb = (k >> 5) * 24
    d, m = vsplat(_f16_at(w, n, rb)), vsplat(_f16_at(w, n, rb + 2))
    return (vadd(vmul(d, _q5_codes(w, n, rb + 4, rb + 8, 0)), m),
            vadd(vmul(d, _q5_codes(w, n, rb + 4, rb + 8, 1)), m))


# Lookup-table twins (block_lut): the block's 16 (32) weight values computed once by the
# expression above on iota, then each 16 weights fetched by their codes with one permute.

@njit(inline="always", **_JIT)
def _lut_q4_0(w, wd, wdm, n, k):
    """Q4_0 by table: table[q] = d * (q - 8), as `_arith_q4_0`."""
    rb = (k >> 5) * 18
    d = vsplat_f16_pair(w, n * w.shape[1] + rb)[0]  # (d, the first code byte): d
    table = vmul(vadd(viota(), vsplat(np.float32(-8.0))), d)
    return vlut16_nibbles(table, w, n * w.shape[1] + rb + 2)


@njit(inline="always", **_JIT)
def _lut_q4_1(w, wd, wdm, n, k):
    """Q4_1 by table: table[q] = d * q + m, as `_arith_q4_1` (d * q is exact, so the
    fused multiply-add rounds where the add does)."""
    rb = (k >> 5) * 20
    d, m = vsplat_f16_pair(w, n * w.shape[1] + rb)
    table = vfma_exact(viota(), d, m)
    return vlut16_nibbles(table, w, n * w.shape[1] + rb + 4)


@njit(inline="always", **_JIT)
def _lut_q5_0(w, wd, wdm, n, k):
    """Q5_0 by a 32-entry table: d * (q - 16), as `_arith_q5_0` (q - 16 is exact)."""
    rb = (k >> 5) * 22
    base = n * w.shape[1] + rb
    d, iota = vsplat_f16_pair(w, base)[0], viota()  # (d, the low half of qh): d
    t0, t1 = vmul(d, vadd(iota, vsplat(np.float32(-16.0)))), vmul(d, iota)
    return vlut32_q5(t0, t1, w, base + 6, base + 2, 0), vlut32_q5(t0, t1, w, base + 6, base + 2, 1)


@njit(inline="always", **_JIT)
def _lut_q5_1(w, wd, wdm, n, k):
    """Q5_1 by a 32-entry table: d * q + m, as `_arith_q5_1` (d * q exact: fused)."""
    rb = (k >> 5) * 24
    base = n * w.shape[1] + rb
    (d, m), iota = vsplat_f16_pair(w, base), viota()
    t0, t1 = vfma_exact(d, iota, m), vfma_exact(d, vadd(iota, vsplat(np.float32(16.0))), m)
    return vlut32_q5(t0, t1, w, base + 8, base + 4, 0), vlut32_q5(t0, t1, w, base + 8, base + 4, 1)


@njit(inline="always", **_JIT)
def _wide_q8_0(w, wd, wdm, n, k):
    """Q8_0 as `_arith_q8_0`, d splatted by one broadcast load and one vector conversion."""
    rb = (k >> 5) * 34
    base = n * w.shape[1] + rb
    d = vsplat_f16_pair(w, base)[0]  # (d, the first two codes): d
    return vmul(vload_s8(w, base + 2), d), vmul(vload_s8(w, base + 18), d)


@njit(inline="always", **_JIT)
def _arith_iq4_nl(w, wd, wdm, n, k):
    """IQ4_NL (18 B: f16 d, u8 qs[16], bytes as Q4_0's): d * kvalues[q]."""
    rb = (k >> 5) * 18
    base = n * w.shape[1] + rb + 2
    d, kv = vsplat(_f16_at(w, n, rb)), vkvalues()
    return vmul(d, vtable16_bits(kv, w, base, 0)), vmul(d, vtable16_bits(kv, w, base, 4))


@njit(inline="always", **_JIT)
def _lut_iq4_nl(w, wd, wdm, n, k):
    """IQ4_NL by table: table[q] = d * kvalues[q], as `_arith_iq4_nl`."""
    rb = (k >> 5) * 18
    d = vsplat_f16_pair(w, n * w.shape[1] + rb)[0]  # (d, the first code byte): d
    return vlut16_nibbles(vmul(d, vkvalues()), w, n * w.shape[1] + rb + 2)


# The loaders the kernels use: tables where the permutes exist, arithmetic elsewhere.
_pair_q8_0 = _wide_q8_0 if HAS_LUT else _arith_q8_0
_pair_q4_0 = _lut_q4_0 if HAS_LUT else _arith_q4_0
_pair_q4_1 = _lut_q4_1 if HAS_LUT else _arith_q4_1
_pair_q5_0 = _lut_q5_0 if HAS_LUT else _arith_q5_0
_pair_q5_1 = _lut_q5_1 if HAS_LUT else _arith_q5_1
_pair_iq4_nl = _lut_iq4_nl if HAS_LUT else _arith_iq4_nl


def linear_q5(x: np.ndarray, blocks: np.ndarray, qtype: str, out: np.ndarray) -> np.ndarray:
    """`linear_block32` for Q5_0/Q5_1."""
    return linear_block32(x, blocks, qtype, out)


@njit(inline="always", **_JIT)
def _scale_min(w, n, o, j):
    """6-bit (scale, min) of sub-block j from the 12 packed bytes at w[n, o:] (ggml
    get_scale_min_k4)."""
    if j < 4:
        return w[n, o + j] & 63, w[n, o + j + 4] & 63
    sc = (w[n, o + j + 4] & 0x0F) | ((w[n, o + j - 4] >> 6) << 4)
    mn = (w[n, o + j + 4] >> 4) | ((w[n, o + j] >> 6) << 4)
    return sc, mn


@njit(inline="always", **_JIT)
def _arith_q4_k(w, wd, wdm, n, k):
    """Q4_K sub-block of 32 at k (wd, wdm: float32 d, dmin per super-block):
    (d * sc) * q - (dmin * m), the 6-bit sc and m unpacked once for the 32 weights."""
    sb, i = k >> 8, k & 255
    rb = sb * 144
    sc, mn = _scale_min(w, n, rb + 4, i >> 5)
    ds, dm = vsplat(wd[n, sb] * np.float32(sc)), vsplat(wdm[n, sb] * np.float32(mn))
    q = n * w.shape[1] + rb + 16 + (i >> 6) * 32
    shift = ((i >> 5) & 1) * 4
    return (vsub(vmul(vload_bits(w, q, shift, 0x0F), ds), dm),
            vsub(vmul(vload_bits(w, q + 16, shift, 0x0F), ds), dm))


@njit(inline="always", **_JIT)
def _lut_q4_k(w, wd, wdm, n, k):
    """Q4_K sub-block by table: table[q] = (d * sc) * q - (dmin * m), as `_arith_q4_k`."""
    sb, i = k >> 8, k & 255
    rb = sb * 144
    sc, mn = _scale_min(w, n, rb + 4, i >> 5)
    ds, dm = vsplat(wd[n, sb] * np.float32(sc)), vsplat(wdm[n, sb] * np.float32(mn))
    table = vsub(vmul(viota(), ds), dm)
    q = n * w.shape[1] + rb + 16 + (i >> 6) * 32
    shift = ((i >> 5) & 1) * 4
    return vlut16_bits(table, w, q, shift), vlut16_bits(table, w, q + 16, shift)


_pair_q4_k = _lut_q4_k if HAS_LUT else _arith_q4_k


@njit(inline="always", **_JIT)
def _q5_k_codes(w, base, i):
    """The 5-bit codes of Q5_K weights i..i+15 of the super-block at byte `base` (exact)."""
    lo = vload_bits(w, base + 48 + (i >> 6) * 32 + (i & 31), ((i >> 5) & 1) * 4, 0x0F)
    hi = vload_bits(w, base + 16 + (i & 31), i >> 5, 0x01)
    return vadd(lo, vmul(hi, vsplat(np.float32(16.0))))  # exact: small integers


@njit(inline="always", **_JIT)
def _arith_q5_k(w, wd, wdm, n, k):
    """Q5_K sub-block of 32 at k: as Q4_K with a fifth bit from qh."""
    sb, i = k >> 8, k & 255
    rb = sb * 176
    base = n * w.shape[1] + rb
    sc, mn = _scale_min(w, n, rb + 4, i >> 5)
    ds, dm = vsplat(wd[n, sb] * np.float32(sc)), vsplat(wdm[n, sb] * np.float32(mn))
    return (vsub(vmul(_q5_k_codes(w, base, i), ds), dm),
            vsub(vmul(_q5_k_codes(w, base, i + 16), ds), dm))


@njit(inline="always", **_JIT)
def _lut_q5_k(w, wd, wdm, n, k):
    """Q5_K sub-block by a 32-entry table: (d * sc) * q - (dmin * m), as `_arith_q5_k`
    (the codes 16..31 are iota + 16, exactly)."""
    sb, i = k >> 8, k & 255
    rb = sb * 176
    base = n * w.shape[1] + rb
    sc, mn = _scale_min(w, n, rb + 4, i >> 5)
    ds, dm, iota = vsplat(wd[n, sb] * np.float32(sc)), vsplat(wdm[n, sb] * np.float32(mn)), viota()
    t0, t1 = vsub(vmul(iota, ds), dm), vsub(vmul(vadd(iota, vsplat(np.float32(16.0))), ds), dm)
    lo, shift = base + 48 + (i >> 6) * 32, ((i >> 5) & 1) * 4
    return (vlut32_bits(t0, t1, w, lo, shift, base + 16, i >> 5),
            vlut32_bits(t0, t1, w, lo + 16, shift, base + 32, i >> 5))


_pair_q5_k = _lut_q5_k if HAS_LUT else _arith_q5_k


@njit(inline="always", **_JIT)
def _q6_k_half(w, wd, n, sb, rb, i):
    """Dequantised Q6_K weights i..i+15 of super-block sb (at byte rb of row n)."""
    base = n * w.shape[1] + rb
    r = i & 127
    lo = vload_bits(w, base + (i >> 7) * 64 + (r & 63), (r >> 6) * 4, 0x0F)
    hi = vload_bits(w, base + 128 + (i >> 7) * 32 + (r & 31), (r >> 5) * 2, 0x03)
    q = vadd(vadd(lo, vmul(hi, vsplat(np.float32(16.0)))), vsplat(np.float32(-32.0)))  # exact
    ds = wd[n, sb] * np.float32(np.int8(w[n, rb + 192 + (i >> 4)]))
    return vmul(q, vsplat(ds))


@njit(inline="always", **_JIT)
def _pair_q6_k(w, wd, wdm, n, k):
    """Q6_K weights k..k+31: two 16-weight groups, each with its own 8-bit scale."""
    sb, i = k >> 8, k & 255
    rb = sb * 210
    return _q6_k_half(w, wd, n, sb, rb, i), _q6_k_half(w, wd, n, sb, rb, i + 16)


@njit(inline="always", **_JIT)
def _iq4_xs_scale(w, wd, n, sb, rb, j):
    """d * (ls - 32) of IQ4_XS sub-block j (float32, gguf's one rounding): ls = nibble j of
    scales_l | (bits 2j, 2j+1 of the little-endian u16 scales_h) << 4."""
    low = (np.int64(w[n, rb + 4 + (j >> 1)]) >> ((j & 1) * 4)) & 0x0F
    high = ((np.int64(w[n, rb + 2]) | (np.int64(w[n, rb + 3]) << 8)) >> (2 * j)) & 0x03
    return wd[n, sb] * np.float32((low | (high << 4)) - 32)


@njit(inline="always", **_JIT)
def _arith_iq4_xs(w, wd, wdm, n, k):
    """IQ4_XS sub-block of 32 at k (wd: float32 d per super-block): (d * (ls - 32)) *
    kvalues[q], the scale decoded once for the 32 weights."""
    sb, j = k >> 8, (k & 255) >> 5
    rb = sb * 136
    dl, kv = vsplat(_iq4_xs_scale(w, wd, n, sb, rb, j)), vkvalues()
    q = n * w.shape[1] + rb + 8 + j * 16
    return vmul(dl, vtable16_bits(kv, w, q, 0)), vmul(dl, vtable16_bits(kv, w, q, 4))


@njit(inline="always", **_JIT)
def _lut_iq4_xs(w, wd, wdm, n, k):
    """IQ4_XS sub-block by table: table[q] = (d * (ls - 32)) * kvalues[q], as `_arith_iq4_xs`."""
    sb, j = k >> 8, (k & 255) >> 5
    rb = sb * 136
    table = vmul(vsplat(_iq4_xs_scale(w, wd, n, sb, rb, j)), vkvalues())
    return vlut16_nibbles(table, w, n * w.shape[1] + rb + 8 + j * 16)


_pair_iq4_xs = _lut_iq4_xs if HAS_LUT else _arith_iq4_xs


@njit(inline="always", **_JIT)
def _q2_k_group(w, wd, wdm, n, sb, rb, i):
    """Q2_K weights i..i+15 (one group of 16) of super-block sb at byte rb of row n:
    (d * sc) * q - (dmin * m), sc and m the nibbles of scales[i // 16], as gguf."""
    s = w[n, rb + (i >> 4)]
    ds, dm = vsplat(wd[n, sb] * np.float32(s & 0x0F)), vsplat(wdm[n, sb] * np.float32(s >> 4))
    q = vload_bits(w, n * w.shape[1] + rb + 16 + (i >> 7) * 32 + (i & 31), ((i & 127) >> 5) * 2, 0x03)
    return vsub(vmul(q, ds), dm)


@njit(inline="always", **_JIT)
def _pair_q2_k(w, wd, wdm, n, k):
    """Q2_K weights k..k+31 (wd, wdm: float32 d, dmin per super-block): two groups of 16."""
    sb, i = k >> 8, k & 255
    rb = sb * 84
    return _q2_k_group(w, wd, wdm, n, sb, rb, i), _q2_k_group(w, wd, wdm, n, sb, rb, i + 16)


@njit(inline="always", **_JIT)
def _q3_k_scale(w, wd, n, sb, rb, g):
    """d * (sc - 32) of Q3_K group g of 16 (float32, gguf's one rounding): the 6-bit sc is
    nibble g // 8 of scales[g % 8] | (bits 2 * (g // 4), +1 of scales[8 + g % 4]) << 4."""
    low = (np.int64(w[n, rb + 96 + (g & 7)]) >> ((g >> 3) * 4)) & 0x0F
    high = (np.int64(w[n, rb + 104 + (g & 3)]) >> ((g >> 2) * 2)) & 0x03
    return wd[n, sb] * np.float32((low | (high << 4)) - 32)


@njit(inline="always", **_JIT)
def _q3_k_group(w, wd, n, sb, rb, i):
    """Q3_K weights i..i+15 of super-block sb at byte rb of row n: (d * (sc - 32)) * q, the
    3-bit q = low bits - 4 where the hmask bit is clear (exact small integers)."""
    base = n * w.shape[1] + rb
    lo = vload_bits(w, base + 32 + (i >> 7) * 32 + (i & 31), ((i & 127) >> 5) * 2, 0x03)
    hi = vload_bits(w, base + (i & 31), i >> 5, 0x01)
    four = vsplat(np.float32(4.0))
    q = vadd(lo, vsub(vmul(hi, four), four))  # lo - 4 * (1 - h)
    return vmul(q, vsplat(_q3_k_scale(w, wd, n, sb, rb, i >> 4)))


@njit(inline="always", **_JIT)
def _pair_q3_k(w, wd, wdm, n, k):
    """Q3_K weights k..k+31 (wd: float32 d per super-block): two groups of 16."""
    sb, i = k >> 8, k & 255
    rb = sb * 110
    return _q3_k_group(w, wd, n, sb, rb, i), _q3_k_group(w, wd, n, sb, rb, i + 16)


_load2 = None  # the templates' pair loader, bound per type by `generated.bind_loader`


def _linear_in_block(x, ws, outs, count):
    """Template: a product over 1-3 weights of a type whose kernel reads its scales in the blocks."""
    block_linear_driver(x, ws, ws, ws, outs, count, _load2)


def _linear_at_load(x, ws, wds, wdms, outs, count):
    """Template: a product over 1-3 weights with float32 scales taken at load (`superblock_scales`)."""
    block_linear_driver(x, ws, wds, wdms, outs, count, _load2)


def _linear_packed(x, ws, outs, count):
    """Template: a product over 1-3 weights repacked at load (registry `cpu_packed`, its column
    product bound as `_load2`): `packed32`'s arithmetic at every row count."""
    packed_linear_driver(x, ws, outs, count, _load2)


def _linear_packed_q8k(x, ws, outs, count):
    """`_linear_packed` for a column product over Q8_K rows (`packed256`: ACTIVATIONS "q8k")."""
    packed_q8k_linear_driver(x, ws, outs, count, _load2)


# One kernel a type, parallel: on one numba thread (NUMBA_NUM_THREADS=1, or the governor's
# choice while other processes hold the cores) its prange runs on that thread. A serial twin
# used to skip that launch (15-20% of a 135M model's B=1 products op by op), but decode now
# runs in the one-call step, which calls the range functions directly, and each twin cost a
# third of its type's compile time in every cold start and test run.
_BUILT: dict[str, tuple] = {}  # qtype -> (registry entry, kernel)


def kernel(qtype: str):
    """The numba product kernel of `qtype`, made from its registry entry on first use
    (`generated`: "_linear_q4_k", its pair loader bound in)."""
    t = registry.get(qtype)
    built = _BUILT.get(qtype)
    if built is None or built[0] is not t:
        if t is None or not t.cpu_loader:
            raise ValueError(f"no CPU block kernel reads {qtype}")
        template = _linear_at_load if t.scales_at_load else _linear_in_block
        f = bind_loader(template, kernel_name("_linear", t), loader_of(t))
        built = _BUILT[qtype] = (t, njit(parallel=True, **dict(_JIT, cache=cacheable(t)))(f))
    return built[1]


_PACKED_BUILT: dict[str, tuple] = {}  # qtype -> (registry entry, kernel over packed weights)


def packed_kernel(qtype: str):
    """The numba product kernel over `qtype` weights repacked at load (`packed32.pack`),
    made from its registry entry's `cpu_packed` on first use ("_packed_q4_0")."""
    t = registry.get(qtype)
    built = _PACKED_BUILT.get(qtype)
    if built is None or built[0] is not t:
        columns = packed_columns_of(t) if t is not None else None
        if columns is None:
            raise ValueError(f"no CPU product reads {qtype} weights repacked")
        template = _linear_packed_q8k if packed_activations(t) == "q8k" else _linear_packed
        f = bind_loader(template, kernel_name("_packed", t, uses_amx(t)), columns)
        built = _PACKED_BUILT[qtype] = (t, njit(parallel=True, **dict(_JIT, cache=cacheable(t)))(f))
    return built[1]


def _check_packed(x, packed, qtype, out):
    _require("x", x, np.float32, 2)
    _require("packed", packed, np.uint8, 2)
    _require("out", out, np.float32, 2)
    M, K = x.shape
    t = registry.get(qtype)
    if t is None or not t.cpu_packed:
        raise ValueError(f"{qtype} is not a type of linear_packed")
    N = out.shape[1]
    if (not t.fits(K) or packed.shape[1] != t.row_bytes(K) or packed.shape[0] != -(-N // GROUP) * GROUP
            or out.shape[0] != M):
        raise ValueError(f"linear_packed: shapes x{x.shape} {qtype} packed{packed.shape} out{out.shape} "
                         f"do not match (K a multiple of {t.block_weights}, packed rows N rounded up to {GROUP})")


def linear_packed(x: np.ndarray, packed: np.ndarray, qtype: str, out: np.ndarray) -> np.ndarray:
    """out[M, N] = x[M, K] @ W.T for W of a `cpu_packed` type (Q4_0, Q4_1, Q8_0) repacked by
    `packed32.pack` (uint8 [N', K/32 * bytes], N' = N rounded up to 16), over the activations
    rounded to int16 per 32: bit-identical to `packed32.reference` on W's blocks. Returns out."""
    _check_packed(x, packed, qtype, out)
    packed_kernel(qtype)(x, (packed,) * 3, (out,) * 3, 1)
    return out


def linear_packed_many(x: np.ndarray, packed: list[np.ndarray], qtype: str, cols: list[int]) -> list[np.ndarray]:
    """[x @ W.T for W in packed] (1 to 3 repacked weights of one type, same K; `cols` their
    columns N) in one parallel region; each product bit-identical to `linear_packed`'s."""
    outs = [np.empty((x.shape[0], n), np.float32) for n in cols]
    for p, o in zip(packed, outs):
        _check_packed(x, p, qtype, o)
    packed_kernel(qtype)(x, _three(packed), _three(outs), len(packed))
    return outs


def _entry(qtype: str, at_load: bool) -> registry.QuantType:
    t = registry.get(qtype)
    if t is None or not t.cpu_loader or t.scales_at_load != at_load:
        raise ValueError(f"{qtype} is not a type of {'linear_kquant' if at_load else 'linear_block32'}")
    return t


def _check_block32(x, blocks, qtype, out):
    _require("x", x, np.float32, 2)
    _require("blocks", blocks, np.uint8, 2)
    _require("out", out, np.float32, 2)
    M, K = x.shape
    t = _entry(qtype, False)
    if not t.fits(K) or blocks.shape[1] != t.row_bytes(K) or out.shape != (M, blocks.shape[0]):
        raise ValueError(f"linear_block32: shapes x{x.shape} {qtype} blocks{blocks.shape} out{out.shape} "
                         f"do not match (K a multiple of {t.block_weights})")


def linear_block32(x: np.ndarray, blocks: np.ndarray, qtype: str, out: np.ndarray) -> np.ndarray:
    """out[M, N] = x[M, K] @ W.T for W stored as blocks of `qtype` whose kernel reads the scales
    in the blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL), uint8 [N, K/32 * bytes] (C-contiguous;
    a memory-map view is fine); the f16 scales are widened in the kernel. Bit-identical to
    ``linear(x, gguf.quants.dequantize(blocks, qtype), out)``. Returns out."""
    _check_block32(x, blocks, qtype, out)
    kernel(qtype)(x, (blocks, blocks, blocks), (out, out, out), 1)
    return out


def _three(items: list) -> tuple:
    """`items` (1..3) padded to a 3-tuple by repeating the first: the kernels' arity."""
    if not 1 <= len(items) <= 3:
        raise ValueError(f"a fused linear takes 1 to 3 weights, got {len(items)}")
    return tuple(items) + (items[0],) * (3 - len(items))


def linear_block32_many(x: np.ndarray, blocks: list[np.ndarray], qtype: str) -> list[np.ndarray]:
    """[x @ W.T for W in blocks] (1 to 3 weights of one 32-weight `qtype`, same K) in one
    parallel region; each product bit-identical to `linear_block32`'s."""
    outs = [np.empty((x.shape[0], b.shape[0]), np.float32) for b in blocks]
    for b, o in zip(blocks, outs):
        _check_block32(x, b, qtype, o)
    kernel(qtype)(x, _three(blocks), _three(outs), len(blocks))
    return outs


def superblock_scales(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The f16 d and dmin of every block as float32 [N, K / block weights] each, exactly (f16 ->
    f32 is exact), from the bytes the registry names; a type without dmin (Q3_K, Q6_K,
    IQ4_XS) returns its d array twice."""
    t = _entry(qtype, True)
    n = blocks.shape[0]
    b = np.asarray(blocks, dtype=np.uint8).reshape(n, -1, t.block_bytes)

    def f16_at(o):
        return b[..., o:o + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    d = f16_at(t.f16_at[0])
    return (d, d) if len(t.f16_at) == 1 else (d, f16_at(t.f16_at[1]))


def _check_kquant(x, blocks, qtype, d, dmin, out):
    _require("x", x, np.float32, 2)
    _require("blocks", blocks, np.uint8, 2)
    _require("out", out, np.float32, 2)
    _require("d", d, np.float32, 2)
    _require("dmin", dmin, np.float32, 2)
    M, K = x.shape
    N, nbytes = blocks.shape
    t = _entry(qtype, True)
    if not t.fits(K) or nbytes != t.row_bytes(K) or out.shape != (M, N):
        raise ValueError(f"linear_kquant: shapes x{x.shape} {qtype} blocks{blocks.shape} "
                         f"out{out.shape} do not match (K a multiple of {t.block_weights})")
    if d.shape != (N, K // t.block_weights) or dmin.shape != d.shape:
        raise ValueError(f"linear_kquant: d and dmin must be float32 [N, K/{t.block_weights}]")


def linear_kquant(x: np.ndarray, blocks: np.ndarray, qtype: str, d: np.ndarray, dmin: np.ndarray,
                  out: np.ndarray) -> np.ndarray:
    """out[M, N] = x[M, K] @ W.T for W stored as `qtype` blocks whose scales are taken at load
    (the K-quants, IQ4_XS): uint8 [N, K/256 * bytes] (C-contiguous; a memory-map view is fine),
    with `d`, `dmin` from `superblock_scales`. Bit-identical to
    ``linear(x, gguf.quants.dequantize(blocks, qtype), out)``. Returns out."""
    _check_kquant(x, blocks, qtype, d, dmin, out)
    kernel(qtype)(x, (blocks,) * 3, (d,) * 3, (dmin,) * 3, (out,) * 3, 1)
    return out


def linear_kquant_many(x: np.ndarray, weights: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                       qtype: str) -> list[np.ndarray]:
    """[x @ W.T for W in weights] (1 to 3 (blocks, d, dmin) of one K-quant `qtype`, same K)
    in one parallel region; each product bit-identical to `linear_kquant`'s."""
    outs = [np.empty((x.shape[0], b.shape[0]), np.float32) for b, _, _ in weights]
    for (b, d, dm), o in zip(weights, outs):
        _check_kquant(x, b, qtype, d, dm, o)
    kernel(qtype)(x, _three([w[0] for w in weights]), _three([w[1] for w in weights]),
                 _three([w[2] for w in weights]), _three(outs), len(weights))
    return outs
