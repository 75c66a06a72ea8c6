"""Q4_0, Q4_1 and Q8_0 products in exact integers over weights repacked at load into
records of 16 output columns, against activations rounded to int16 per 32.

A float32 product over these blocks decodes every weight to a float and spends one FMA
per 16 weights and row. Here, at load, the blocks of 16 consecutive output columns are
regrouped block by block into one record each (`repack`: the same bytes, reordered; a
tensor keeps its size; llama.cpp's CPU "repack" of Q4_0 is the same idea):

  record (group g, block b): f16 d[16] | f16 m[16] (Q4_1) | codes
  codes: 8 vectors of 64 bytes (Q8_0: vector j for weights k = 4j..4j+3, byte 4c + i the
         int8 code of column c at k = 4j + i) or 4 (Q4_0, Q4_1: vector j holds, for column
         c, the file's qs bytes 4j..4j+3: low nibbles weights 4j + i, high nibbles
         16 + 4j + i); Q8_0's codes are stored plus 128 (unsigned)

A row's int16 activations are kept as two int8 planes, q = 256 a + b, so a code vector
meets four activations in two `vpdpbusd` (64 products each, codes as the unsigned side):
lane c of every vector is column c, no shuffles, no widening, no per-product decode
(a nibble mask or shift for the 4-bit types), and isum = 256 A + B is exact.

Activations are rounded per row and block of 32 to int16, not to llama.cpp's int8: int8
(its Q8_0 / Q8_1) was tried and moved panechat further from llama.cpp's own answers
(the default model's golden steps 430 -> 425 of 444, with one miss where llama.cpp's
margin is 0.5), since rounding amplifies the small differences upstream; int16 rounds
256 times finer, so the products stay at float32's distance from llama.cpp, and still
cost a third of the float32 ones (docs/benchmarks.md). Per row and block:
amax = max |x|, id = 32639 / amax (0 for an all-zero block), q = rint(x * id) (half to
even; |q| <= 32639 = 127 * 257, so both planes fit int8), dx = amax / 32639, xs = sum of
the 32 q, sx = dx * f32(xs).

Per output element (row m, column n), blocks b in increasing order, acc from 0:

  isum = sum over the block's 32 weights of c[k] * q[k]                       (exact int32)
  Q4_0: acc = acc + (dx * d) * f32(isum - 8 * xs)           (c: the 4-bit code, 0..15)
  Q8_0: acc = acc + (dx * d) * f32(isum - 128 * xs)         (c: the int8 code + 128)
  Q4_1: acc = (acc + (dx * d) * f32(isum)) + m * sx

each a plain IEEE operation; out = acc. Nothing in it depends on other rows or on how many
there are, and the tiles (4 rows, then 1-3) choose only which elements are computed
together: a row's bits are the same alone or in any batch. The integer sums are exact in
any form (VNNI `vpdpbusd`; `q8k_dot`'s `vpmaddubsw` forms for the 4-bit codes on AVX-512
BW and AVX2; LLVM integer vectors elsewhere), so every instruction set gives the same bits. `reference` is the same
arithmetic in numpy (the tests' exact reference). Where AMX tiles may run, `amx_blocks32`
computes Q4_0's and Q8_0's sums for many rows by tile products (registry `cpu_amx`; the
same bits).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from panechat.backends.cpu.decode_attention import HAS_F16C
from panechat.backends.cpu.numpy_kernels import (_JIT, _element_ptr, _is_c_array, block_task, column_tasks, f32vec, lane_max,
                                                  prefetch, splat_value, vzero)
from panechat.backends.cpu.repack import GROUP, LAYOUTS
from panechat.backends.cpu.row_rounding import abs_max16, round_int16_16
from panechat.backends.cpu.q8k_dot import FORM, _B64, _I16, _I32, _F16V, _V16, _dot4, _load, _splat, _splat_f32, dot4_plain

QB = 32  # weights (and activations) a block
ROWS = 4  # activation rows a tile computes together (the record's codes loaded once for them)
PACKED = ("Q4_0", "Q4_1", "Q8_0")  # the types this module repacks

_OFFSET = {"Q4_0": 8, "Q4_1": 0, "Q8_0": 128}  # the code offset subtracted as offset * xs
QMAX = 32639  # the largest activation code: 127 * 256 + 127, so q = 256 a + b with a, b int8
_H16 = ir.VectorType(_I16, 16)
_I64 = ir.IntType(64)


# ---------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------

@njit(**_JIT)
def quantize_row(x, m, xq, xd, xs, sx):
    """Row m of x (float32 [M, K], C-contiguous, K a multiple of 32) rounded to int16 per 32
    (module docstring), as two int8 planes: q = 256 * xq[m, k] + xq[m, K + k] (xq int8
    [M, 2K]); xd float32 [M, K/32], xs int32 [M, K/32] (the codes' sum), sx float32 [M, K/32]
    (dx * f32(xs)). 16 values a vector (`row_rounding`)."""
    K = x.shape[1]
    for b in range(K // QB):
        o = b * QB
        at = m * K + o
        amax = lane_max(abs_max16(x, at + 16, abs_max16(x, at, vzero())))
        iscale = np.float32(QMAX) / amax if amax > 0 else np.float32(0.0)
        qa = 2 * m * K + o
        s = round_int16_16(x, at, iscale, xq, qa, qa + K) + round_int16_16(x, at + 16, iscale, xq, qa + 16, qa + K + 16)
        d = amax / np.float32(QMAX)
        xd[m, b], xs[m, b], sx[m, b] = d, s, d * np.float32(s)


@njit(**_JIT)
def row_arrays(M, K):
    """Empty (xq, xd, xs, sx) for M rounded rows of K activations (`quantize_row`)."""
    B = K // QB
    return (np.empty((M, 2 * K), np.int8), np.empty((M, B), np.float32), np.empty((M, B), np.int32),
            np.empty((M, B), np.float32))


@njit(**_JIT)
def quantized_rows(x):
    """Every row of x rounded as `quantize_row`: (xq, xd, xs, sx)."""
    xq, xd, xs, sx = row_arrays(x.shape[0], x.shape[1])
    for m in range(x.shape[0]):
        quantize_row(x, m, xq, xd, xs, sx)
    return xq, xd, xs, sx


def reference_rows(x: np.ndarray):
    """numpy's `quantized_rows`, the codes as int16 (xq int16 [M, K], xd float32, xs int32,
    sx float32 [M, K/32]); `planes` gives the kernels' two int8 planes of xq."""
    M, K = x.shape
    xb = np.ascontiguousarray(x, np.float32).reshape(M, K // QB, QB)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, np.float32(QMAX) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * iscale[..., None]).astype(np.int32)
    d = (amax / np.float32(QMAX)).astype(np.float32)
    s = q.sum(-1).astype(np.int32)
    return q.astype(np.int16).reshape(M, K), d, s, (d * s.astype(np.float32)).astype(np.float32)


def planes(xq: np.ndarray) -> np.ndarray:
    """int16 codes [M, K] as the kernels keep them: int8 [M, 2K], q = 256 a + b (a first)."""
    q = xq.astype(np.int32)
    low = ((q + 128) & 255) - 128
    return np.concatenate([(q - low) >> 8, low], 1).astype(np.int8)


def reference(qtype: str, x: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """x @ W.T by the module's arithmetic in numpy, W the file's `qtype` blocks [N, K/32 * bytes]
    (not packed): bit for bit what the kernels give."""
    M, K = x.shape
    N = blocks.shape[0]
    B = K // QB
    xq, xd, xs, sx = reference_rows(x)
    b = np.asarray(blocks, np.uint8).reshape(N, B, LAYOUTS[qtype].block_bytes)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, B]
    if qtype == "Q8_0":
        codes = b[..., 2:].view(np.int8).astype(np.int64) + 128
    else:
        qs = b[..., 4:] if qtype == "Q4_1" else b[..., 2:]
        codes = np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64)
    xb = xq.reshape(M, B, QB).astype(np.int64)
    isum = np.einsum("mbk,nbk->mnb", xb, codes) - _OFFSET[qtype] * xs.astype(np.int64)[:, None, :]
    acc = np.zeros((M, N), np.float32)
    if qtype == "Q4_1":
        mins = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    for s in range(B):
        acc = acc + (xd[:, s, None] * d[None, :, s]) * isum[..., s].astype(np.float32)
        if qtype == "Q4_1":
            acc = acc + mins[None, :, s] * sx[:, s, None]
    return acc


# ---------------------------------------------------------------------------
# One record against rows
# ---------------------------------------------------------------------------

def _widen_f16(builder, h):
    """float32 <16 x float> of 16 f16 bit patterns <16 x i16>, exactly: vcvtph2ps with F16C,
    else the bits moved into a float32 and scaled by 2**112 (normal and subnormal halves)."""
    if HAS_F16C:
        return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 16)), _F16V)
    w = builder.zext(h, _V16)
    mag = builder.bitcast(builder.shl(builder.and_(w, _splat(builder, _V16, 0x7FFF)), _splat(builder, _V16, 13)), _F16V)
    mag = builder.fmul(mag, ir.Constant(_F16V, [2.0 ** 112] * 16))
    sign = builder.shl(builder.and_(w, _splat(builder, _V16, 0x8000)), _splat(builder, _V16, 16))
    return builder.bitcast(builder.or_(builder.bitcast(mag, _V16), sign), _F16V)


def _dot4_wide(builder, acc, u8, s8):
    """acc[l] + sum_{i<4} u8[4l+i] * s8[4l+i] for any u8 (Q8_0's codes reach 255, where
    vpmaddubsw would saturate): vpdpbusd with VNNI, plain LLVM integer vectors elsewhere."""
    if FORM == "vnni":
        return _dot4(builder, acc, u8, s8)
    return dot4_plain(builder, acc, u8, s8)


class RecordRow:
    """Row r of a tile inside a record intrinsic's code: its activation planes (int8 pointers
    `a`, `b`) at the record's first weight, and loads of its block scalars."""

    def __init__(self, context, builder, sig, args, r):
        self._c, self._b, self._sig, self._args = context, builder, sig, args
        xo = context.cast(builder, args[4], sig.args[4], types.intp)
        k = context.cast(builder, args[5], sig.args[5], types.intp)
        so = context.cast(builder, args[9], sig.args[9], types.intp)
        bstride = context.cast(builder, args[10], sig.args[10], types.intp)
        row = builder.add(xo, builder.mul(k, ir.Constant(k.type, 2 * r)))  # a plane; b plane K later
        self.a = _element_ptr(context, builder, sig.args[3], args[3], types.intp, row)
        self.b = _element_ptr(context, builder, sig.args[3], args[3], types.intp, builder.add(row, k))
        self._si = builder.add(so, builder.mul(bstride, ir.Constant(bstride.type, r)))  # its 32-block

    def _at(self, arg):
        return self._b.load(_element_ptr(self._c, self._b, self._sig.args[arg], self._args[arg], types.intp, self._si))

    def dx(self):
        """The block's scale (float32)."""
        return self._at(6)

    def xs(self):
        """The codes' sum over the block (int32)."""
        return self._at(7)

    def sx(self):
        """dx * f32(xs) (float32)."""
        return self._at(8)


def record_intrinsic(name, nr, emit):
    """An intrinsic (accs, w, wo, xq, xo, K, xd, xs, sx, so, B) -> accs for `nr` rows: accs
    (float32 vectors of 16 columns) after the record at byte wo of the uint8 C-array w,
    against rows whose a plane starts at xq.flat[xo] (int8; b plane K further, row stride
    2K) and whose block scalars start at xd/xs/sx.flat[so] (row stride B).
    emit(builder, wp, rows, accs) -> the new accs: the type's arithmetic, wp the record's
    uint8 pointer, rows a `RecordRow` each."""
    accs_t = types.UniTuple(f32vec, nr)

    def typer(typingctx, accs, w, wo, xq, xo, K, xd, xs, sx, so, B):
        if not (accs == accs_t and _is_c_array(w, types.uint8) and _is_c_array(xq, types.int8)
                and _is_c_array(xd, types.float32) and _is_c_array(xs, types.int32) and _is_c_array(sx, types.float32)
                and all(isinstance(i, types.Integer) for i in (wo, xo, K, so, B))):
            return None

        def codegen(context, builder, sig, args):
            wp = _element_ptr(context, builder, sig.args[1], args[1], sig.args[2], args[2])
            rows = [RecordRow(context, builder, sig, args, r) for r in range(nr)]
            accs = [builder.extract_value(args[0], r) for r in range(nr)]
            return context.make_tuple(builder, accs_t, emit(builder, wp, rows, accs))

        return accs_t(accs, w, wo, xq, xo, K, xd, xs, sx, so, B), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


def _block32(qtype):
    """The emit of a Q4_0 / Q4_1 / Q8_0 record (module docstring)."""
    q4 = qtype != "Q8_0"
    mins = qtype == "Q4_1"
    off = _OFFSET[qtype]

    def emit(builder, wp, rows, accs):
        d = _widen_f16(builder, _load(builder, wp, 0, _H16))
        m16 = _widen_f16(builder, _load(builder, wp, 32, _H16)) if mins else None
        at = 64 if mins else 32
        if q4:  # vector j: low nibbles weights 4j + i, high nibbles 16 + 4j + i
            raw = [_load(builder, wp, at + 64 * j, _B64) for j in range(4)]
            codes = low_nibbles(builder, raw) + high_nibbles(builder, raw)
        else:  # vector j: weights 4j..4j+3
            codes = [_load(builder, wp, at + 64 * j, _B64) for j in range(8)]
        dot = _dot4 if q4 else _dot4_wide
        out = []
        for row, acc in zip(rows, accs):
            isum = plane_dots(builder, row.a, row.b, 0, codes, dot)
            if off:  # the codes' offset: - off * xs in every lane
                isum = builder.add(isum, splat_i32(builder, builder.mul(row.xs(), ir.Constant(_I32, -off))))
            acc = builder.fadd(acc, builder.fmul(builder.fmul(_splat_f32(builder, row.dx()), d), builder.sitofp(isum, _F16V)))
            if mins:
                acc = builder.fadd(acc, builder.fmul(m16, _splat_f32(builder, row.sx())))
            out.append(acc)
        return out

    return emit


def low_nibbles(builder, raw):
    lo4 = _splat(builder, _B64, 0x0F)
    return [builder.and_(r, lo4) for r in raw]


def high_nibbles(builder, raw):
    return [builder.lshr(r, _splat(builder, _B64, 4)) for r in raw]  # a byte's high nibble: 0..15


def plane_dots(builder, xa, xb, at, codes, dot):
    """int32 <16 x i32>: lane c's sum over the code vectors of codes[j][4c + i] * q[at + 4j + i]
    (i < 4), q = 256 a + b the activations whose planes start at the int8 pointers xa, xb:
    (A << 8) + B, each plane's sum in two chains of `dot` (exact in any order)."""
    zero = ir.Constant(_V16, None)
    hi, lo = [zero, zero], [zero, zero]
    for j, code in enumerate(codes):  # four activations of each plane, broadcast
        for plane, parts in ((xa, hi), (xb, lo)):
            p = builder.bitcast(builder.gep(plane, [ir.Constant(_I64, at + 4 * j)]), _I32.as_pointer())
            xw = builder.load(p, align=1)
            parts[j & 1] = dot(builder, parts[j & 1], code, builder.bitcast(splat_i32(builder, xw), _B64))
    return builder.add(builder.shl(builder.add(hi[0], hi[1]), _splat(builder, _V16, 8)), builder.add(lo[0], lo[1]))


def splat_i32(builder, s):
    return splat_value(builder, s, _V16)


_BLOCKS = {(t, r): record_intrinsic(f"{t.lower()}_record{r}", r, _block32(t)) for t in PACKED for r in (1, 2, 3, 4, 5)}
q4_0_record1, q4_0_record2, q4_0_record3, q4_0_record4, q4_0_record5 = (_BLOCKS["Q4_0", r] for r in (1, 2, 3, 4, 5))
q4_1_record1, q4_1_record2, q4_1_record3, q4_1_record4, q4_1_record5 = (_BLOCKS["Q4_1", r] for r in (1, 2, 3, 4, 5))
q8_0_record1, q8_0_record2, q8_0_record3, q8_0_record4, q8_0_record5 = (_BLOCKS["Q8_0", r] for r in (1, 2, 3, 4, 5))


# ---------------------------------------------------------------------------
# Tiles and column ranges
# ---------------------------------------------------------------------------

PREFETCH_AHEAD = 1024  # bytes past a record at which the first row tile asks for its lines


@njit(inline="always", **_JIT)
def prefetch_ahead(w, at, rec):
    """Prefetch into L1 the `rec` bytes PREFETCH_AHEAD past byte `at` of the records (never
    faults). The first row tile streams a group's records from memory, and the hardware
    prefetcher alone kept too few lines in flight: with all of a record's lines asked for a
    little ahead, one row reads 1B-shape matrices 4-19% faster (Q4_0 8192x2048 4%, its
    49152x2048 head 14%; Q8_0 13-17%; Q4_K 13-19%: in one process, alternating, on the
    480 MiB-L3 Xeon)."""
    for o in range(0, rec, 64):
        prefetch(w, at + PREFETCH_AHEAD + o)


@njit(inline="always", **_JIT)
def _tile(w, xq, xd, xs, sx, out, m, g, acc, record):
    """out[m:m+len(acc), 16g:16g+16]: group g's records against rows m.. (acc: zeros)."""
    K = xq.shape[1] // 2
    B = K // QB
    rec = w.shape[1] * GROUP // B
    base = g * GROUP * w.shape[1]
    for b in range(B):
        at = base + b * rec
        if m == 0:
            prefetch_ahead(w, at, rec)
        acc = record(acc, w, at, xq, 2 * m * K + b * QB, K, xd, xs, sx, m * B + b, B)
    store_group(out, m, g, acc)


@njit(inline="always", **_JIT)
def _row_pair(w, xq, xd, xs, sx, out, g, record):
    """out[0, 16g:16g+32]: one row against groups g and g + 1, a record of each in turn: two
    streams of weights a thread (1B-shape matrices at one row, alternating with one stream
    on the 480 MiB-L3 Xeon: Q4_0 14-30% faster, Q8_0 4-20%, their heads within the noise)."""
    K = xq.shape[1] // 2
    B = K // QB
    rec = w.shape[1] * GROUP // B
    base = g * GROUP * w.shape[1]
    base2 = base + GROUP * w.shape[1]
    z = vzero()
    a, c = (z,), (z,)
    for b in range(B):
        at, at2 = base + b * rec, base2 + b * rec
        prefetch_ahead(w, at, rec)
        prefetch_ahead(w, at2, rec)
        a = record(a, w, at, xq, b * QB, K, xd, xs, sx, b, B)
        c = record(c, w, at2, xq, b * QB, K, xd, xs, sx, b, B)
    store_group(out, 0, g, a)
    store_group(out, 0, g + 1, c)


@njit(inline="always", **_JIT)
def store_group(out, m, g, acc):
    """out[m + r, 16g:16g+16] = acc[r], the columns past out's last left out."""
    n0, N = g * GROUP, out.shape[1]
    if n0 + GROUP <= N:
        _store(out, m, n0, acc)
    else:  # the last group of a weight whose columns are not a multiple of 16
        tmp = np.empty((len(acc), GROUP), np.float32)
        _store(tmp, 0, 0, acc)
        for r in range(len(acc)):
            for c in range(N - n0):
                out[m + r, n0 + c] = tmp[r, c]


@intrinsic
def _store(typingctx, out, m, n, accs):
    """out[m + r, n:n+16] = accs[r] for each r (float32 C-array)."""
    if not (_is_c_array(out, types.float32) and isinstance(accs, types.UniTuple) and accs.dtype == f32vec):
        return None
    nr = accs.count

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        stride = builder.extract_value(arr.shape, 1)
        mm = context.cast(builder, args[1], sig.args[1], types.intp)
        nn = context.cast(builder, args[2], sig.args[2], types.intp)
        for r in range(nr):
            row = builder.add(mm, ir.Constant(mm.type, r))
            p = builder.gep(arr.data, [builder.add(builder.mul(row, stride), nn)])
            builder.store(builder.extract_value(args[3], r), builder.bitcast(p, _F16V.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(out, m, n, accs), codegen


@njit(inline="always", **_JIT)
def five_rows(M):
    """Whether M rows end with a tile of five (4k + 1 rows, k >= 1: a verify step's decode
    row and 4 drafts read each record once, not in a tile of four and another of one),
    and the rows the four-row tiles cover."""
    five = M >= 5 and M % ROWS == 1
    return five, (M - 5 if five else M)


@njit(inline="never", **_JIT)
def _q4_0_tile5(w, xq, xd, xs, sx, out, m, g):
    """`_tile` of five rows (Q4_0), compiled apart, as `packed256`'s (inlined beside the
    other tiles, its registers would cost them)."""
    z = vzero()
    _tile(w, xq, xd, xs, sx, out, m, g, (z, z, z, z, z), q4_0_record5)


@njit(inline="never", **_JIT)
def _q4_1_tile5(w, xq, xd, xs, sx, out, m, g):
    """`_q4_0_tile5` for Q4_1."""
    z = vzero()
    _tile(w, xq, xd, xs, sx, out, m, g, (z, z, z, z, z), q4_1_record5)


@njit(inline="never", **_JIT)
def _q8_0_tile5(w, xq, xd, xs, sx, out, m, g):
    """`_q4_0_tile5` for Q8_0."""
    z = vzero()
    _tile(w, xq, xd, xs, sx, out, m, g, (z, z, z, z, z), q8_0_record5)


@njit(inline="always", **_JIT)
def _columns(w, xq, xd, xs, sx, out, c0, c1, r1, r2, r3, r4, t5):
    """out[:, c0:c1] (c0 a multiple of 16, c1 too or the last column): each group of 16
    columns against every row, four rows at a time, then the last one to three; 4k + 1 rows
    end with five at a time (`t5`; the default model's 5-row products 6-13% cheaper than 4 +
    1); one row against pairs of groups (`_row_pair`)."""
    M = xq.shape[0]
    z = vzero()
    five, stop = five_rows(M)
    g0, g1 = c0 // GROUP, (c1 + GROUP - 1) // GROUP
    if M == 1:
        while g0 + 2 <= g1:
            _row_pair(w, xq, xd, xs, sx, out, g0, r1)
            g0 += 2
    for g in range(g0, g1):
        m = 0
        while m + ROWS <= stop:
            _tile(w, xq, xd, xs, sx, out, m, g, (z, z, z, z), r4)
            m += ROWS
        if five:
            t5(w, xq, xd, xs, sx, out, m, g)
            m += 5
        rest = M - m
        if rest == 3:
            _tile(w, xq, xd, xs, sx, out, m, g, (z, z, z), r3)
        elif rest == 2:
            _tile(w, xq, xd, xs, sx, out, m, g, (z, z), r2)
        elif rest == 1:
            _tile(w, xq, xd, xs, sx, out, m, g, (z,), r1)


@njit(inline="always", **_JIT)
def q4_0_columns(w, xq, xd, xs, sx, out, c0, c1):
    """out[:, c0:c1] for packed Q4_0 weights w (uint8 [N, K/32*18]) and every row's int16
    activations (`quantized_rows`)."""
    _columns(w, xq, xd, xs, sx, out, c0, c1, q4_0_record1, q4_0_record2, q4_0_record3, q4_0_record4, _q4_0_tile5)


@njit(inline="always", **_JIT)
def q4_1_columns(w, xq, xd, xs, sx, out, c0, c1):
    """`q4_0_columns` for packed Q4_1 weights (uint8 [N, K/32*20])."""
    _columns(w, xq, xd, xs, sx, out, c0, c1, q4_1_record1, q4_1_record2, q4_1_record3, q4_1_record4, _q4_1_tile5)


@njit(inline="always", **_JIT)
def q8_0_columns(w, xq, xd, xs, sx, out, c0, c1):
    """`q4_0_columns` for packed Q8_0 weights (uint8 [N, K/32*34])."""
    _columns(w, xq, xd, xs, sx, out, c0, c1, q8_0_record1, q8_0_record2, q8_0_record3, q8_0_record4, _q8_0_tile5)


TASK_GROUPS = 2  # groups of 16 columns a parallel task computes
TASK_BYTES = 1 << 19  # int16 activations (both planes) a task's block of rows holds


@njit(inline="always", **_JIT)
def task_rows(M, K):
    """Rows of a task's block: all M while their 2K-byte rows fit TASK_BYTES, else that many,
    a multiple of 16, at least 16; never 0 (M = 0: one empty block). A thread's tasks in a row share the block's activations
    in its L2 (`amx_blocks32`: at K = 8192 a prefill's 128 rows, 2 MiB, came from L3 for
    every group: 2048x8192 at 128 rows 14.1 ms, in blocks of 32 8.7)."""
    return max(1, M) if M * 2 * K <= TASK_BYTES else max(16, TASK_BYTES // (2 * K) // 16 * 16)


@njit(inline="always", **_JIT)
def packed_linear_driver(x, ws, outs, count, columns):
    """outs[j] = x @ W_j.T for the first `count` (1..3) packed weights of the 3-tuple ws, by
    `columns` (a type's column-range product): x rounded once (rows in parallel), then one
    parallel region over tasks of TASK_GROUPS groups and a block of `task_rows(M, K)` rows,
    block by block."""
    M, K = x.shape
    xq, xd, xs, sx = row_arrays(M, K)
    for m in prange(M):
        quantize_row(x, m, xq, xd, xs, sx)
    cols = TASK_GROUPS * GROUP
    t1, t2, t3 = column_tasks(outs, count, cols)
    rows = task_rows(M, K)
    for t in prange(t3 * ((M + rows - 1) // rows)):
        j, n0, r0, r1 = block_task(t, t1, t2, t3, cols, rows, M)
        out = outs[j]
        columns(ws[j], xq[r0:r1], xd[r0:r1], xs[r0:r1], sx[r0:r1], out[r0:r1], n0, min(n0 + cols, out.shape[1]))
