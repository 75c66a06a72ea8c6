"""The Q8_K contract: K-quant products over activations rounded to 8 bits, as llama.cpp
computes them, and the integer-product instructions of the kernels that keep it.

A float32 product over dequantized K-quant weights costs more in arithmetic than its bytes
cost in memory (a weight decoded, scaled and multiplied per lane). llama.cpp instead
rounds each activation row to int8 in blocks of 256 (its Q8_K: one float scale a block,
`quantize_row_q8_K_ref`; here `quantize_row_q8k`, every row: `quantized_rows`), and
multiplies integer codes by integer activations: exact integer sums, one float
multiply-add per super-block. So do panechat's Q4_K, Q5_K and Q6_K products.

Per output element (row m, column n), super-block s in increasing order:

  isum = sum over the 256 weights k of sc[j(k)] * q[k] * xq[k]               (exact int32)
  msum = sum over the 8 sub-blocks j of m[j] * (xq sum of sub-block j)        (exact int32)
  acc  = (acc + (dx * d) * f32(isum)) - (dx * dmin) * f32(msum)               (float32)

with dx the row's block scale, d and dmin the super-block's; out = acc after the last
super-block (Q6_K: one integer, isum - 32 * sum_g sc[g] * (xq sum of group g), and
acc + (dx * d) * f32(it)). Integer sums are exact, so how they are formed is free: the
kernels (`packed256` over weights repacked into records of 16 columns, by record tiles or
`q8k_panel`'s panels; `amx_tiles` on AMX tiles) choose only which elements are computed
together, never an element's arithmetic. Nothing in it depends on other rows or on how
many there are: a row's bits are the same alone or in any batch, and by any kernel.
`reference` is the same arithmetic in numpy on the file's blocks (the tests' exact
reference; `reference_q8k` the rounding's).

The integer products are built here (`_dot4`, `_dot2`; `_float_step` the float step) in
the form the compile target's instruction set allows (`target_form`, chosen when numba
compiles: NUMBA_CPU_NAME / NUMBA_CPU_FEATURES pick another target): VNNI (`vpdpbusd`: 64
u8 x s8 products an instruction, `vpdpwssd` for int16 pairs), AVX-512 BW without VNNI or
AVX2 (`vpmaddubsw` / `vpmaddwd`, as llama.cpp's AVX2 code; codes below 64 never reach its
saturation), and plain LLVM integer vectors anywhere else (ARM servers); `packed32` uses
them too. Integer sums are exact, so every form gives the same integers and the same floats.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit
from numba.core import config

from panechat.backends.cpu.numpy_kernels import _JIT, LANES, call_llvm, lane_max, splat_value, vzero
from panechat.backends.cpu.row_rounding import abs_max16, first_of_magnitude16, round_q8k16

QK = 256  # weights (and activations) a super-block

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_B64 = ir.VectorType(_I8, 64)
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
        return call_llvm(builder, "llvm.x86.avx512.pmaddw.d.512", _V16, builder.bitcast(a, _H32), builder.bitcast(b, _H32))
    if FORM == "avx2":
        pa, pb = _halves(builder, builder.bitcast(a, _H32), 16), _halves(builder, builder.bitcast(b, _H32), 16)
        return _join(builder, *[call_llvm(builder, "llvm.x86.avx2.pmadd.wd", _V8, x, y) for x, y in zip(pa, pb)])
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
        return _join(builder, *[call_llvm(builder, "llvm.x86.avx2.pmadd.ub.sw", _H16, x, y) for x, y in zip(hu, hs)])
    return call_llvm(builder, "llvm.x86.avx512.pmaddubs.w.512", _H32, u8, s8)


def _dot4(builder, acc, u8, s8):
    """acc[l] + sum_{i<4} u8[4l+i] * s8[4l+i] for 16 int32 lanes (u8 below 64; exact)."""
    u8, s8 = builder.bitcast(u8, _B64), builder.bitcast(s8, _B64)
    if FORM == "vnni":
        return call_llvm(builder, "llvm.x86.avx512.vpdpbusd.512", _V16, acc, builder.bitcast(u8, _V16),
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
        return call_llvm(builder, "llvm.x86.avx512.vpdpwssd.512", _V16, acc, a, b)
    return builder.add(acc, _madd_words(builder, a, b))


def _splat_f32(builder, s):
    return splat_value(builder, s, _F16V)


def _float_step(builder, acc, dd, isum, dm, msum):
    """The contract's float step: (acc + dd * f32(isum)) - dm * f32(msum), each a plain IEEE
    operation, lane by lane (a vector of columns or of elements)."""
    f32 = acc.type
    acc = builder.fadd(acc, builder.fmul(dd, builder.sitofp(isum, f32)))
    return builder.fsub(acc, builder.fmul(dm, builder.sitofp(msum, f32)))


@njit(inline="always", **_JIT)
def quantize_row_q8k(x, m, xq, xd, xs):
    """Row m of x (float32 [M, K], C-contiguous, K a multiple of 256) as llama.cpp's Q8_K:
    per block of 256, iscale = -127 / (the value of largest magnitude, the first one), q =
    min(127, round-half-even(iscale * x)), d = 1 / iscale (0 and q = 0 for an all-zero
    block); xq int8 [M, K], xd float32 [M, K / 256], xs int16 [M, K / 16] (sums of 16 q).
    16 values a vector (`row_rounding`)."""
    K = x.shape[1]
    for b in range(K // QK):
        o = b * QK
        at = m * K + o
        v = abs_max16(x, at, vzero())
        for t in range(LANES, QK, LANES):
            v = abs_max16(x, at + t, v)
        amax = lane_max(v)
        if amax == 0:
            xd[m, b] = np.float32(0.0)
            for j in range(o, o + QK):
                xq[m, j] = 0
            for g in range(o // 16, (o + QK) // 16):
                xs[m, g] = 0
        else:
            t = 0
            while True:  # the first value of that magnitude (it is there)
                lane = first_of_magnitude16(x, at + t, amax)
                if lane < LANES:
                    break
                t += LANES
            iscale = np.float32(-127.0) / x[m, o + t + lane]
            for g in range(QK // 16):
                xs[m, o // 16 + g] = round_q8k16(x, at + 16 * g, iscale, xq, at + 16 * g)
            xd[m, b] = np.float32(1.0) / iscale


@njit(inline="always", **_JIT)
def quantized_rows(x):
    """Every row of x as Q8_K: (xq, xd, xs) of `quantize_row_q8k`."""
    M, K = x.shape
    xq, xd, xs = np.empty((M, K), np.int8), np.empty((M, K // QK), np.float32), np.empty((M, K // 16), np.int16)
    for m in range(M):
        quantize_row_q8k(x, m, xq, xd, xs)
    return xq, xd, xs


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
    contract's arithmetic, in numpy: what the kernels give (`packed256.reference`: the same
    from the blocks alone)."""
    return REFERENCES[qtype](np.ascontiguousarray(x, np.float32), blocks, d, dmin)
