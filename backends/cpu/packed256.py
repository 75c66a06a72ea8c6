"""Q4_K, Q5_K and Q6_K products over super-blocks repacked at load into records of 16 output
columns (`repack.LAYOUTS`), against llama.cpp's Q8_K activations: `q8k_dot`'s arithmetic
(its docstring is the contract), the same bits, in a layout that costs no reductions.

Kernels on the file's blocks (panechat's before the repacking: four columns a tile, 16
lanes of partial sums reduced across lanes at every super-block) cost more at one row than
the block's bytes (15 GB/s on a 30 GB/s machine). Here a 64-byte vector's lane c is
column c (four weights a lane), so a broadcast of four activations meets 16 columns in one
`vpdpbusd`, and each sub-block's sum is scaled in its lane by the column's scale:

  Q4_K: isum = sum_j sc[j] * (sum over sub-block j of c * x)   (j of 32 weights; exact int32)
        msum = sum_j m[j] * (x sum of sub-block j)
        acc  = (acc + (dx * d) * f32(isum)) - (dx * dmin) * f32(msum)
  Q5_K: Q4_K's, c = nibble | fifth bit << 4 (0..31)
  Q6_K: isum = sum_g sc[g] * (sum over group g of c * x - 32 * (x sum of g))   (g of 16)
        acc  = acc + (dx * d) * f32(isum)

with sc, m unpacked in the kernel from the block's 12 scale bytes (ggml's
get_scale_min_k4; Q6_K: its int8 scales), c the unsigned code (Q6_K: ql | qh << 4,
0..63), x the row's int8 codes, dx its super-block scale. These are the integers and float
steps of the contract exactly (integer sums are exact in any order), so a product equals
`q8k_dot.reference`'s bit for bit, whichever of the two kernels computes it, at every row
count, and in every instruction-set form (codes below 64: `q8k_dot._dot4`'s `vpmaddubsw`
forms never saturate). Bounds: |isum| <= 63 * 127 * 256 * 128 < 2**31.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from panechat.backends.cpu import amx_tiles
from panechat.backends.cpu.numpy_kernels import _JIT, _element_ptr, _is_c_array, block_task, column_tasks, f32vec, vzero
from panechat.backends.cpu.packed32 import (ROWS, TASK_GROUPS, _widen_f16, five_rows, high_nibbles, low_nibbles,
                                            prefetch_ahead, splat_i32, store_group)
from panechat.backends.cpu.q8k_dot import (_B16, _B64, _F16V, _H16, _I32, _V16, _dot2, _dot4, _load, _splat, _splat_f32,
                                           quantize_row_q8k)
from panechat.backends.cpu.q8k_dot import reference as q8k_reference
from panechat.backends.cpu.q8k_panel import q5k_record_panel_columns, q6k_record_panel_columns
from panechat.backends.cpu.repack import GROUP
from panechat.backends.quant import registry

QK = 256  # weights a super-block
PACKED = ("Q4_K", "Q5_K", "Q6_K")  # the types this module multiplies
ACTIVATIONS = "q8k"  # the rows its column products take (`q8k_dot.quantized_rows`)
Q5K_PANEL_MIN_ROWS = 24  # Q5_K's (tiles 5-28% faster up to 20 rows, even at 24)
Q6K_PANEL_MIN_ROWS = 20  # Q6_K from this many rows on by panels of its records (16 rows: the tiles 5-12% faster)
AMX_MIN_ROWS = 16  # Q5_K's and Q6_K's AMX forms from this many rows on (below: the record tiles, 1.1-2x faster at 8-12)
Q4K_AMX_MIN_ROWS = 64  # Q4_K's (at 16-32 rows from memory even, or slower when K = 8192; a B=16 step 8% slower)


def reference(qtype: str, x: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """x @ W.T by the contract in numpy, W the file's `qtype` blocks (not packed): bit for
    bit what the kernels give (`q8k_dot.reference` with the blocks' f16 scales widened)."""
    blocks = np.ascontiguousarray(blocks, np.uint8)
    t = registry.get(qtype)
    b = blocks.reshape(blocks.shape[0], -1, t.block_bytes)
    d, dmin = _scales(b, t.f16_at)
    return q8k_reference(qtype, np.ascontiguousarray(x, np.float32), blocks, d, dmin)


def _scales(b: np.ndarray, f16_at: tuple) -> tuple[np.ndarray, np.ndarray]:
    """d and dmin (d twice for a type without dmin) float32 [N, K/256] of blocks [N, K/256, bytes]."""
    f16 = [b[..., o:o + 2].copy().view(np.float16)[..., 0].astype(np.float32) for o in f16_at]
    return f16[0], f16[-1] if len(f16) > 1 else f16[0]


# ---------------------------------------------------------------------------
# One record against rows
# ---------------------------------------------------------------------------

class _Row:
    """Row r of a tile inside a record intrinsic: its int8 activations at the record's first
    weight, its super-block scale dx, and its sums of 16."""

    def __init__(self, context, builder, sig, args, r):
        c = lambda i: context.cast(builder, args[i], sig.args[i], types.intp)  # noqa: E731
        xo, k, so, nb = c(4), c(5), c(8), c(9)
        self._b = builder
        self.x = _element_ptr(context, builder, sig.args[3], args[3], types.intp,
                              builder.add(xo, builder.mul(k, ir.Constant(k.type, r))))
        si = builder.add(so, builder.mul(nb, ir.Constant(nb.type, r)))
        self.dx = builder.load(_element_ptr(context, builder, sig.args[6], args[6], types.intp, si))
        self._sums = _element_ptr(context, builder, sig.args[7], args[7], types.intp,
                                  builder.mul(si, ir.Constant(si.type, QK // 16)))

    def sums32(self, j):
        """The sums of groups 2j and 2j + 1 (the int16 pair, as one int32) in every lane."""
        p = self._b.gep(self._sums, [ir.Constant(ir.IntType(64), 2 * j)])
        return splat_i32(self._b, self._b.load(self._b.bitcast(p, _I32.as_pointer()), align=2))

    def sum16(self, g):
        """The activations' sum over the record's weights 16g..16g+15 (int32)."""
        p = self._b.gep(self._sums, [ir.Constant(ir.IntType(64), g)])
        return self._b.sext(self._b.load(p), _I32)


def _record_q8k(name, nr, emit):
    """An intrinsic (accs, w, wo, xq, xo, K, xd, xs, so, nb) -> accs for `nr` rows: accs
    (float32 vectors of 16 columns) after the record at byte wo of the uint8 C-array w,
    against Q8_K rows whose activations start at xq.flat[xo] (int8, row stride K), their
    scale at xd.flat[so] (row stride nb = K / 256) and sums of 16 at xs.flat[16 so] (int16).
    emit(builder, wp, rows) -> per row (isum, msum or None) of the contract; here the float
    step."""
    accs_t = types.UniTuple(f32vec, nr)

    def typer(typingctx, accs, w, wo, xq, xo, K, xd, xs, so, nb):
        if not (accs == accs_t and _is_c_array(w, types.uint8) and _is_c_array(xq, types.int8)
                and _is_c_array(xd, types.float32) and _is_c_array(xs, types.int16)
                and all(isinstance(i, types.Integer) for i in (wo, xo, K, so, nb))):
            return None

        def codegen(context, builder, sig, args):
            wp = _element_ptr(context, builder, sig.args[1], args[1], sig.args[2], args[2])
            rows = [_Row(context, builder, sig, args, r) for r in range(nr)]
            d, dmin, ints = emit(builder, wp, rows)
            out = []
            for r, (row, (isum, msum)) in enumerate(zip(rows, ints)):
                dx = _splat_f32(builder, row.dx)
                acc = builder.extract_value(args[0], r)
                acc = builder.fadd(acc, builder.fmul(builder.fmul(dx, d), builder.sitofp(isum, _F16V)))
                if msum is not None:
                    acc = builder.fsub(acc, builder.fmul(builder.fmul(dx, dmin), builder.sitofp(msum, _F16V)))
                out.append(acc)
            return context.make_tuple(builder, accs_t, out)

        return accs_t(accs, w, wo, xq, xo, K, xd, xs, so, nb), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


def _dots(builder, xp, at, codes):
    """<16 x i32>: lane c's sum over the code vectors j of codes[j][4c + i] * x[at + 4j + i]
    (i < 4; x the int8 activations at xp), in two chains (exact in any order)."""
    zero = ir.Constant(_V16, None)
    part = [zero, zero]
    for j, code in enumerate(codes):
        p = builder.bitcast(builder.gep(xp, [ir.Constant(ir.IntType(64), at + 4 * j)]), _I32.as_pointer())
        xw = builder.bitcast(splat_i32(builder, builder.load(p, align=1)), _B64)
        part[j & 1] = _dot4(builder, part[j & 1], code, xw)
    return builder.add(part[0], part[1])


def _bytes16(builder, wp, at):
    """16 bytes at wp + at, zero-extended to <16 x i32>."""
    return builder.zext(_load(builder, wp, at, _B16), _V16)


def _q4k(builder, wp, rows):
    """A Q4_K record: d[16] dmin[16] f16 | 12 scale bytes x 16 | qs (vector v: bytes 4v..4v+3
    of each column: low nibbles sub-block 2p = v // 8's weights 4(v % 8) + i, high nibbles
    sub-block 2p + 1's). Each vector is loaded where it is used (a load from L1 is cheaper
    than a register spilled across the record)."""
    return _scaled_sub_blocks(builder, wp, rows, 256, None)


def _q5k(builder, wp, rows):
    """A Q5_K record: `_q4k`'s with qh first (vector u: qh bytes 4u..4u+3 of each column,
    bit j of byte l the fifth bit of sub-block j's weight l) and qs from byte 768. Sub-block
    j's code vector u is its nibble | (bit j of qh vector u) << 4: one shift of 32-bit words
    and a mask (no bit crosses into a neighbouring byte)."""
    return _scaled_sub_blocks(builder, wp, rows, 768, 256)


def _scaled_sub_blocks(builder, wp, rows, qs_at, qh_at):
    """`_q4k` (qh_at None) or `_q5k`: the 8 sub-blocks of 32 weights with their 6-bit scales
    and mins, the nibbles from byte qs_at and the fifth bits from byte qh_at."""
    m63, m15 = _splat(builder, _V16, 63), _splat(builder, _V16, 15)
    six, four = _splat(builder, _V16, 6), _splat(builder, _V16, 4)
    zero = ir.Constant(_V16, None)
    isum, msum = [zero] * len(rows), [zero] * len(rows)
    for j in range(8):
        s = lambda t: _bytes16(builder, wp, 64 + 16 * t)  # noqa: E731 (scale byte t of each column)
        if j < 4:  # get_scale_min_k4
            sc, mn = builder.and_(s(j), m63), builder.and_(s(j + 4), m63)
        else:
            sc = builder.or_(builder.and_(s(j + 4), m15), builder.shl(builder.lshr(s(j - 4), six), four))
            mn = builder.or_(builder.lshr(s(j + 4), four), builder.shl(builder.lshr(s(j), six), four))
        mn2 = builder.or_(mn, builder.shl(mn, _splat(builder, _V16, 16)))  # the min in both int16 halves
        raw = [_load(builder, wp, qs_at + 512 * (j // 2) + 64 * v, _B64) for v in range(8)]
        codes = (high_nibbles if j & 1 else low_nibbles)(builder, raw)
        if qh_at is not None:
            bit4 = _splat(builder, _V16, 0x10101010)
            for v in range(8):
                qh = _load(builder, wp, qh_at + 64 * v, _V16)
                top = builder.shl(qh, _splat(builder, _V16, 4 - j)) if j <= 4 else \
                    builder.lshr(qh, _splat(builder, _V16, j - 4))
                codes[v] = builder.or_(codes[v], builder.bitcast(builder.and_(top, bit4), _B64))
        for r, row in enumerate(rows):
            isum[r] = builder.add(isum[r], builder.mul(_dots(builder, row.x, 32 * j, codes), sc))
            msum[r] = _dot2(builder, msum[r], mn2, row.sums32(j))  # m * (sum 2j) + m * (sum 2j + 1)
    d = _widen_f16(builder, _load(builder, wp, 0, _H16))
    dmin = _widen_f16(builder, _load(builder, wp, 32, _H16))
    return d, dmin, list(zip(isum, msum))


def _q6k(builder, wp, rows):
    """A Q6_K record: d[16] f16 | 16 int8 scales x 16 | ql, qh (vector v: bytes 4v..4v+3 of
    each column; qh from vector 32). Half h, quadrant u, vector jj hold weights
    128h + 32u + 4jj + i: ql vector 16h + jj (u = 0, 2) or 16h + 8 + jj (u = 1, 3), its low
    nibble (u < 2) or high, and bits 2u, 2u+1 of qh vector 32 + 8h + jj as bits 4, 5.
    Per group g of 16: isum += sc[g] * (sum c * x - 32 * (x sum of g)), exact."""
    hbits = _splat(builder, _B64, 0x30)
    zero = ir.Constant(_V16, None)
    isum = [zero] * len(rows)
    for j in range(8):  # 32 weights: half h, quadrant u
        h, u = divmod(j, 4)
        ql = [_load(builder, wp, 288 + 64 * (16 * h + 8 * (u & 1) + v), _B64) for v in range(8)]
        qh = [_load(builder, wp, 288 + 64 * (32 + 8 * h + v), _B64) for v in range(8)]
        nib = (low_nibbles if u < 2 else high_nibbles)(builder, ql)
        shift = 4 - 2 * u  # bits 2u, 2u+1 of qh to bits 4, 5
        top = [builder.shl(b, _splat(builder, _B64, shift)) if shift > 0 else
               (builder.lshr(b, _splat(builder, _B64, -shift)) if shift < 0 else b) for b in qh]
        codes = [builder.or_(n, builder.and_(t, hbits)) for n, t in zip(nib, top)]
        for e in range(2):
            g = 2 * j + e
            sc = builder.sext(_load(builder, wp, 32 + 16 * g, _B16), _V16)
            for r, row in enumerate(rows):
                part = _dots(builder, row.x, 16 * g, codes[4 * e:4 * e + 4])
                off = builder.mul(row.sum16(g), ir.Constant(_I32, -32))
                isum[r] = builder.add(isum[r], builder.mul(builder.add(part, splat_i32(builder, off)), sc))
    d = _widen_f16(builder, _load(builder, wp, 0, _H16))
    return d, None, [(i, None) for i in isum]


_EMIT = {"Q4_K": _q4k, "Q5_K": _q5k, "Q6_K": _q6k}
_RECORDS = {(t, r): _record_q8k(f"{t.lower()}_record{r}", r, _EMIT[t]) for t in PACKED for r in (1, 2, 3, 4, 5)}
q4_k_record1, q4_k_record2, q4_k_record3, q4_k_record4, q4_k_record5 = (_RECORDS["Q4_K", r] for r in (1, 2, 3, 4, 5))
q5_k_record1, q5_k_record2, q5_k_record3, q5_k_record4, q5_k_record5 = (_RECORDS["Q5_K", r] for r in (1, 2, 3, 4, 5))
q6_k_record1, q6_k_record2, q6_k_record3, q6_k_record4, q6_k_record5 = (_RECORDS["Q6_K", r] for r in (1, 2, 3, 4, 5))


# ---------------------------------------------------------------------------
# Tiles, column ranges and the parallel product
# ---------------------------------------------------------------------------

@njit(inline="always", **_JIT)
def _tile(w, xq, xd, xs, out, m, g, acc, record):
    """out[m:m+len(acc), 16g:16g+16]: group g's records against rows m.. (acc: zeros)."""
    K = xq.shape[1]
    nb = K // QK
    rec = w.shape[1] * GROUP // nb
    base = g * GROUP * w.shape[1]
    for b in range(nb):
        at = base + b * rec
        if m == 0:
            prefetch_ahead(w, at, rec)
        acc = record(acc, w, at, xq, m * K + b * QK, K, xd, xs, m * nb + b, nb)
    store_group(out, m, g, acc)


@njit(inline="always", **_JIT)
def _row_pair(w, xq, xd, xs, out, g, record):
    """out[0, 16g:16g+32]: one row against groups g and g + 1, a record of each in turn (two
    streams of weights a thread: the 1B Q4_K_M shape's one-row step about 7% faster)."""
    K = xq.shape[1]
    nb = K // QK
    rec = w.shape[1] * GROUP // nb
    base = g * GROUP * w.shape[1]
    base2 = base + GROUP * w.shape[1]
    z = vzero()
    a, c = (z,), (z,)
    for b in range(nb):
        at = base + b * rec
        at2 = base2 + b * rec
        prefetch_ahead(w, at, rec)
        prefetch_ahead(w, at2, rec)
        a = record(a, w, at, xq, b * QK, K, xd, xs, b, nb)
        c = record(c, w, at2, xq, b * QK, K, xd, xs, b, nb)
    store_group(out, 0, g, a)
    store_group(out, 0, g + 1, c)


@njit(inline="never", **_JIT)
def _q4_k_tile5(w, xq, xd, xs, out, m, g):
    """`_tile` of five rows (Q4_K), compiled apart: inlined beside the other tiles, its
    registers cost the one- and four-row tiles 20-40%."""
    z = vzero()
    _tile(w, xq, xd, xs, out, m, g, (z, z, z, z, z), q4_k_record5)


@njit(inline="never", **_JIT)
def _q5_k_tile5(w, xq, xd, xs, out, m, g):
    """`_q4_k_tile5` for Q5_K."""
    z = vzero()
    _tile(w, xq, xd, xs, out, m, g, (z, z, z, z, z), q5_k_record5)


@njit(inline="never", **_JIT)
def _q6_k_tile5(w, xq, xd, xs, out, m, g):
    """`_q4_k_tile5` for Q6_K."""
    z = vzero()
    _tile(w, xq, xd, xs, out, m, g, (z, z, z, z, z), q6_k_record5)


@njit(inline="always", **_JIT)
def _columns(w, xq, xd, xs, out, c0, c1, r1, r2, r3, r4, t5):
    """out[:, c0:c1] (c0 a multiple of 16, c1 too or the last column): each group of 16
    columns against every row, four rows at a time, then the last one to three (eight at
    a time, tried, spilled registers and was no faster); 4k + 1 rows end with five at a
    time (`t5`: a verify step's 4 drafts + 1 decode each record once, 10% cheaper than
    4 + 1); one row against pairs of groups (`_row_pair`)."""
    M = xq.shape[0]
    z = vzero()
    five, stop = five_rows(M)
    g0, g1 = c0 // GROUP, (c1 + GROUP - 1) // GROUP
    if M == 1:
        while g0 + 2 <= g1:
            _row_pair(w, xq, xd, xs, out, g0, r1)
            g0 += 2
    for g in range(g0, g1):
        m = 0
        while m + ROWS <= stop:
            _tile(w, xq, xd, xs, out, m, g, (z, z, z, z), r4)
            m += ROWS
        if five:
            t5(w, xq, xd, xs, out, m, g)
            m += 5
        rest = M - m
        if rest == 3:
            _tile(w, xq, xd, xs, out, m, g, (z, z, z), r3)
        elif rest == 2:
            _tile(w, xq, xd, xs, out, m, g, (z, z), r2)
        elif rest == 1:
            _tile(w, xq, xd, xs, out, m, g, (z,), r1)


@njit(inline="always", **_JIT)
def q4_k_columns(w, xq, xd, xs, out, c0, c1):
    """out[:, c0:c1] for packed Q4_K weights w (uint8 [N', K/256*144]) and every row's Q8_K
    activations (`q8k_dot.quantized_rows`)."""
    _columns(w, xq, xd, xs, out, c0, c1, q4_k_record1, q4_k_record2, q4_k_record3, q4_k_record4, _q4_k_tile5)


@njit(inline="always", **_JIT)
def q5_k_columns(w, xq, xd, xs, out, c0, c1):
    """`q4_k_columns` for packed Q5_K weights (uint8 [N', K/256*176]); from
    Q5K_PANEL_MIN_ROWS rows on by panels decoded from the records (as Q6_K's)."""
    if xq.shape[0] >= Q5K_PANEL_MIN_ROWS:
        q5k_record_panel_columns(w, xq, xd, xs, out, c0, c1)
    else:
        _columns(w, xq, xd, xs, out, c0, c1, q5_k_record1, q5_k_record2, q5_k_record3, q5_k_record4, _q5_k_tile5)


@njit(inline="always", **_JIT)
def q6_k_columns(w, xq, xd, xs, out, c0, c1):
    """`q4_k_columns` for packed Q6_K weights (uint8 [N', K/256*210]); from
    Q6K_PANEL_MIN_ROWS rows on by panels decoded from the records (`q8k_panel`: the same
    bits, each record decoded once for every row instead of once a tile of four)."""
    if xq.shape[0] >= Q6K_PANEL_MIN_ROWS:
        q6k_record_panel_columns(w, xq, xd, xs, out, c0, c1)
    else:
        _columns(w, xq, xd, xs, out, c0, c1, q6_k_record1, q6_k_record2, q6_k_record3, q6_k_record4, _q6_k_tile5)


@njit(inline="always", **_JIT)
def _amx_from(w, xq, xd, xs, out, c0, c1, min_rows, amx, tiles):
    """`amx` (an `amx_tiles` product: the same bits) from `min_rows` rows on, else `tiles`."""
    if xq.shape[0] >= min_rows:
        amx(w, xq, xd, xs, out, c0, c1)
    else:
        tiles(w, xq, xd, xs, out, c0, c1)


@njit(inline="always", **_JIT)
def q4_k_columns_amx(w, xq, xd, xs, out, c0, c1):
    """`q4_k_columns` where AMX tiles may run (`generated.uses_amx`): from Q4K_AMX_MIN_ROWS
    rows on by `amx_tiles`."""
    _amx_from(w, xq, xd, xs, out, c0, c1, Q4K_AMX_MIN_ROWS, amx_tiles.q4k_columns, q4_k_columns)


@njit(inline="always", **_JIT)
def q5_k_columns_amx(w, xq, xd, xs, out, c0, c1):
    """`q5_k_columns` where AMX tiles may run, from AMX_MIN_ROWS rows on."""
    _amx_from(w, xq, xd, xs, out, c0, c1, AMX_MIN_ROWS, amx_tiles.q5k_columns, q5_k_columns)


@njit(inline="always", **_JIT)
def q6_k_columns_amx(w, xq, xd, xs, out, c0, c1):
    """`q6_k_columns` where AMX tiles may run, from AMX_MIN_ROWS rows on."""
    _amx_from(w, xq, xd, xs, out, c0, c1, AMX_MIN_ROWS, amx_tiles.q6k_columns, q6_k_columns)


@njit(inline="always", **_JIT)
def packed_q8k_linear_driver(x, ws, outs, count, columns):
    """outs[j] = x @ W_j.T for the first `count` (1..3) packed weights of the 3-tuple ws, by
    `columns`: x rounded to Q8_K once (rows in parallel), then one parallel region over
    tasks of TASK_GROUPS groups and a block of `task_rows(M, K)` rows, block by block (a
    thread's tasks in a row share the block's activations in its L2: prefill's 2,048 rows
    streamed for every group of 16 columns cost more than the products)."""
    M, K = x.shape
    xq, xd, xs = np.empty((M, K), np.int8), np.empty((M, K // QK), np.float32), np.empty((M, K // 16), np.int16)
    for m in prange(M):
        quantize_row_q8k(x, m, xq, xd, xs)
    cols = TASK_GROUPS * GROUP
    t1, t2, t3 = column_tasks(outs, count, cols)
    rows = task_rows(M, K)
    for t in prange(t3 * ((M + rows - 1) // rows)):
        j, n0, r0, r1 = block_task(t, t1, t2, t3, cols, rows, M)
        out = outs[j]
        columns(ws[j], xq[r0:r1], xd[r0:r1], xs[r0:r1], out[r0:r1], n0, min(n0 + cols, out.shape[1]))


TASK_BYTES = 1 << 18  # int8 activations a task's block of rows holds (an eighth of a core's L2: 1 MiB was 10-40% slower)
WHOLE_ROWS = amx_tiles.ROW_BLOCK  # up to this many rows a task takes them all (one AMX panel decode for them)


@njit(inline="always", **_JIT)
def task_rows(M, K):
    """Rows of a task's block: all M up to WHOLE_ROWS (at K = 8192, blocks of 32 made the
    AMX forms decode each panel for 32 rows, not 128: Q5_K 2048x8192 at M=128 9.3 ms, not
    about 4.5), else TASK_BYTES of K int8 activations, a multiple of 16, at least 16; never
    0 (M = 0: one empty block)."""
    return max(1, M) if M <= WHOLE_ROWS else max(16, TASK_BYTES // K // 16 * 16)
