"""K-quant products for many rows over repacked records: each group of 16 columns
decoded once into a panel, 16 columns a vector.

At prefill and in large batches every weight record meets many activation rows, and
`packed256`'s record tiles decode a record's codes, scales and mins again for every few
rows they compute. Here a task decodes a group's records (16 weight rows: output
columns) once into a panel laid out for the integer dot products: lane c of a vector is
column c, its four bytes four consecutive weights of that column. Then every activation
row passes the panel, eight rows at a time, then four; per row, sub-block and vector of 16
columns: one `vpdpbusd` per four weights against the row's four activations broadcast,
one multiply by the 16 columns' sub-block scales, `vpdpwssd` for the mins against the
row's sums of 16, and one float step for 16 columns at once. `packed256` takes them for
Q5_K and Q6_K from its Q5K_PANEL_MIN_ROWS and Q6K_PANEL_MIN_ROWS rows on.

The integers are `q8k_dot`'s contract, isum and msum of each (row, column, super-block),
exact, and the float step is the same IEEE operations lane by lane, so a panel's bits are
the record tiles' bits: which of the two computes a product (by its row count) never
shows in a row's result, and a row's bits stay those it has alone.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from panechat.backends.cpu.numpy_kernels import _JIT, _is_c_array
from panechat.backends.cpu.packed32 import _widen_f16, prefetch_ahead
from panechat.backends.cpu.q8k_dot import QK, _B16, _F16V, _H16, _I32, _V16, _dot2, _dot4, _float_step, _load, _splat, _splat_f32

PANEL_COLS = 16  # columns a panel holds: one int32 / float32 lane each
GROUPS = QK // 4  # groups of four weights a super-block (one vpdpbusd lane's bytes)
ROW_GROUP = 4  # activation rows a panel pass computes together (the codes loaded once for them)
WIDE_ROWS = 8  # rows of the wide passes, taken first (per row 9-15% cheaper than four at a time)
SUB_UNROLL = 2  # sub-blocks an iteration of a pass's inner loop computes

_I64 = ir.IntType(64)


def _c64(v):
    return ir.Constant(_I64, v)


def _panel_rows(name, nsub, nr=ROW_GROUP):
    """An intrinsic (tmp, codes, scales, pairs, pd, pdm, xq, xs, xd, r0, r1, r2, r3, K, nsb):
    tmp float32 [nr, 16] <- rows r0..r(nr-1) of the activations (the rest of r0..r3 unread;
    nr = 8: rows r0..r0+7, r1..r3 unread)
    against a decoded panel, every super-block in order. nsub: sub-blocks a super-block (8 of 32 weights: Q5_K, whose
    msum is the mins' part; 16 of 16: Q6_K, whose pairs are its scales, msum the offset
    32's correction, and the float step acc + dd * f32(isum - 32 * msum))."""
    gps = GROUPS // nsub
    q6 = nsub == 16

    def typer(typingctx, tmp, codes, scales, pairs, pd, pdm, xq, xs, xd, r0, r1, r2, r3, K, nsb):
        arrays = ((tmp, types.float32), (codes, types.uint32), (scales, types.int32), (pairs, types.int32),
                  (pd, types.float32), (pdm, types.float32), (xq, types.int8), (xs, types.int16),
                  (xd, types.float32))
        if not (all(_is_c_array(a, t) for a, t in arrays)
                and all(isinstance(i, types.Integer) for i in (r0, r1, r2, r3, K, nsb))):
            return None

        def codegen(context, builder, sig, args):
            data = [context.make_array(sig.args[k])(context, builder, args[k]).data for k in range(9)]
            tp, cp, sp, pp, dp, mp, xqp, xsp, xdp = data
            ints = [context.cast(builder, args[k], sig.args[k], types.int64) for k in range(9, 15)]
            Kv, nsbv = ints[4], ints[5]
            rows = ints[:nr] if nr <= 4 else [builder.add(ints[0], _c64(i)) for i in range(nr)]  # eight: r0..r0+7
            xrow = [builder.gep(xqp, [builder.mul(r, Kv)]) for r in rows]
            srow = [builder.gep(xsp, [builder.mul(r, builder.lshr(Kv, _c64(4)))]) for r in rows]
            drow = [builder.gep(xdp, [builder.mul(r, nsbv)]) for r in rows]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_F16V, None)) for _ in rows]
            isums = [cgutils.alloca_once(builder, _V16) for _ in rows]
            zero = ir.Constant(_V16, None)

            def vec(ptr, offset, ty=_V16):
                p = builder.gep(ptr, [offset]) if not isinstance(offset, int) or offset else ptr
                return builder.load(builder.bitcast(p, ty.as_pointer()), align=4)

            def word(ptr, offset):  # a dword broadcast to 16 lanes
                offset = _c64(offset) if isinstance(offset, int) else offset
                v = builder.load(builder.bitcast(builder.gep(ptr, [offset]), _I32.as_pointer()), align=1)
                return builder.shuffle_vector(builder.insert_element(zero, v, ir.Constant(_I32, 0)), zero,
                                              ir.Constant(_V16, [0] * 16))

            with cgutils.for_range(builder, nsbv) as loop:
                s = loop.index
                cs = builder.gep(cp, [builder.mul(s, _c64(GROUPS * 16))])
                ss = builder.gep(sp, [builder.mul(s, _c64(nsub * 16))])
                ps = builder.gep(pp, [builder.mul(s, _c64(8 * 16))])
                xs_ = [builder.gep(x, [builder.mul(s, _c64(QK))]) for x in xrow]
                bs_ = [builder.gep(b, [builder.mul(s, _c64(16))]) for b in srow]
                # a loop over pairs of sub-blocks, not all of them unrolled: a super-block's
                # code unrolled outran the decoded-instruction cache (10-15% slower)
                for r in range(nr):
                    builder.store(zero, isums[r])
                with cgutils.for_range(builder, _c64(nsub // SUB_UNROLL)) as jl:
                    for jj in range(SUB_UNROLL):
                        j = builder.add(builder.mul(jl.index, _c64(SUB_UNROLL)), _c64(jj))
                        sc = vec(ss, builder.mul(j, _c64(16)))
                        isub = [zero] * nr
                        for k in range(gps):
                            g = builder.add(builder.mul(j, _c64(gps)), _c64(k))
                            code = vec(cs, builder.mul(g, _c64(16)))
                            for r in range(nr):
                                isub[r] = _dot4(builder, isub[r], code, word(xs_[r], builder.mul(g, _c64(4))))
                        for r in range(nr):
                            builder.store(builder.add(builder.load(isums[r]), builder.mul(isub[r], sc)), isums[r])
                isum = [builder.load(isums[r]) for r in range(nr)]
                msum = [zero] * nr
                for p in range(8):
                    pv = vec(ps, _c64(16 * p))
                    msum = [_dot2(builder, msum[r], pv, word(bs_[r], 2 * p)) for r in range(nr)]
                d = vec(builder.gep(dp, [builder.mul(s, _c64(16))]), 0, _F16V)
                dm = vec(builder.gep(mp, [builder.mul(s, _c64(16))]), 0, _F16V)
                for r in range(nr):
                    dx = _splat_f32(builder, builder.load(builder.gep(drow[r], [s])))
                    acc = builder.load(accs[r])
                    if q6:
                        tot = builder.sub(isum[r], builder.shl(msum[r], _splat(builder, _V16, 5)))
                        acc = builder.fadd(acc, builder.fmul(builder.fmul(dx, d), builder.sitofp(tot, _F16V)))
                    else:
                        acc = _float_step(builder, acc, builder.fmul(dx, d), isum[r], builder.fmul(dx, dm), msum[r])
                    builder.store(acc, accs[r])
            for r in range(nr):
                builder.store(builder.load(accs[r]), builder.bitcast(builder.gep(tp, [_c64(16 * r)]), _F16V.as_pointer()),
                              align=4)
            return context.get_dummy_value()

        return types.void(tmp, codes, scales, pairs, pd, pdm, xq, xs, xd, r0, r1, r2, r3, K, nsb), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


panel_rows8_8 = _panel_rows("panel_rows8_8", 8, WIDE_ROWS)  # Q5_K panels: eight consecutive rows
panel_rows8 = _panel_rows("panel_rows8", 8)  # Q5_K panels (8 sub-blocks of 32), four rows
panel_rows8_2 = _panel_rows("panel_rows8_2", 8, 2)  # the last two rows of an M = 4k + 2
panel_rows8_1 = _panel_rows("panel_rows8_1", 8, 1)  # the last row of an M = 4k + 1
panel_rows16_8 = _panel_rows("panel_rows16_8", 16, WIDE_ROWS)
panel_rows16 = _panel_rows("panel_rows16", 16)  # Q6_K panels (16 sub-blocks of 16)
panel_rows16_2 = _panel_rows("panel_rows16_2", 16, 2)
panel_rows16_1 = _panel_rows("panel_rows16_1", 16, 1)


def _words(builder, bp, offset, n):
    """<n x i32>: the n little-endian words at byte offset of the record at bp (unaligned)."""
    ty = ir.VectorType(_I32, n)
    return builder.load(builder.bitcast(builder.gep(bp, [_c64(offset)]), ty.as_pointer()), align=1)


def _q6k_panel(builder, t0, t1, th, sc, codes, scales, pairs):
    """A Q6_K super-block's panel from its words with lane = column: t0, t1 the ql words
    0-15, 16-31, th the qh words, sc the 16 scales (int32 lanes, sign-extended). The
    `codes`, `scales`, `pairs` callbacks (index, vector) store vector i of each array."""
    def k(v):
        return _splat(builder, _V16, v)

    m4, m2 = k(0x0F0F0F0F), k(0x03030303)
    for h, th_ in enumerate((t0, t1)):
        for t in range(8):
            a, b, hq, g = th_[t], th_[8 + t], th[8 * h + t], 32 * h + t
            for i, (low, sh) in enumerate(((builder.and_(a, m4), 0), (builder.and_(b, m4), 2),
                                           (builder.and_(builder.lshr(a, k(4)), m4), 4),
                                           (builder.and_(builder.lshr(b, k(4)), m4), 6))):
                high = builder.and_(builder.lshr(hq, k(sh)) if sh else hq, m2)
                codes(g + 8 * i, builder.or_(low, builder.shl(high, k(4))))
    for q in range(16):
        scales(q, sc[q])
    for p in range(8):
        pairs(p, builder.or_(builder.and_(sc[2 * p], k(0xFFFF)), builder.shl(sc[2 * p + 1], k(16))))


def _k4_panel(builder, t, tq, u, codes, scales, pairs):
    """A Q5_K super-block's panel (Q4_K's layout, a fifth bit a code) from its words with
    lane = column: t the 32 qs words, tq the 8 qh words, u the 3 words of the 12 scale bytes.
    The `codes`, `scales`, `pairs` callbacks (index, vector) store vector i of each array."""
    def k(v):
        return _splat(builder, _V16, v)

    m4, ones = k(0x0F0F0F0F), k(0x01010101)
    for wt in range(32):
        g, kk = wt // 8, wt % 8
        lo, hi = builder.and_(t[wt], m4), builder.and_(builder.lshr(t[wt], k(4)), m4)
        # weight 32j + l has bit j of qh[l]: group 8j + k takes bit j of qh word k
        lo = builder.or_(lo, builder.shl(builder.and_(builder.lshr(tq[kk], k(2 * g)), ones), k(4)))
        hi = builder.or_(hi, builder.shl(builder.and_(builder.lshr(tq[kk], k(2 * g + 1)), ones), k(4)))
        codes(16 * g + kk, lo)
        codes(16 * g + 8 + kk, hi)
    u0, u1, u2 = u
    for j in range(4):  # llama.cpp's get_scale_min_k4, on 16 columns' words at once
        sh = 8 * j
        sc_lo, m_lo = builder.and_(builder.lshr(u0, k(sh)), k(63)), builder.and_(builder.lshr(u1, k(sh)), k(63))
        sc_hi = builder.or_(builder.and_(builder.lshr(u2, k(sh)), k(15)),
                            builder.shl(builder.and_(builder.lshr(u0, k(sh + 6)), k(3)), k(4)))
        m_hi = builder.or_(builder.and_(builder.lshr(u2, k(sh + 4)), k(15)),
                           builder.shl(builder.and_(builder.lshr(u1, k(sh + 6)), k(3)), k(4)))
        for jj, scv, mv in ((j, sc_lo, m_lo), (j + 4, sc_hi, m_hi)):
            scales(jj, scv)
            pairs(jj, builder.or_(mv, builder.shl(mv, k(16))))


def _record_decoder(name, kind):
    """An intrinsic (w, at, codes, co, scales, so, pairs, po, pd, pdm, pdo): the panel of the
    repacked record at byte `at` of w (one super-block of 16 columns; `repack.LAYOUTS`:
    vector v of its code bytes already holds word v of every column, its scale bytes one a
    column, so no transposes) into codes[co:] (uint32 [64, 16]), scales[so:] (int32
    [nsub, 16]) and pairs[po:] (int32 [8, 16]), split with the same lane-wise operations
    for all 16 columns, and its 16 d (and dmin) widened to float32 into pd[pdo:]
    (pdm[pdo:]). kind: "q5k" or "q6k"."""

    def typer(typingctx, w, at, codes, co, scales, so, pairs, po, pd, pdm, pdo):
        if not (_is_c_array(w, types.uint8) and _is_c_array(codes, types.uint32) and _is_c_array(scales, types.int32)
                and _is_c_array(pairs, types.int32) and _is_c_array(pd, types.float32)
                and _is_c_array(pdm, types.float32) and all(isinstance(a, types.Integer) for a in (at, co, so, po, pdo))):
            return None

        def codegen(context, builder, sig, args):
            wp, cp, sp, pp, dp, mp = [context.make_array(sig.args[k])(context, builder, args[k]).data
                                      for k in (0, 2, 4, 6, 8, 9)]
            at_, co_, so_, po_, pdo_ = [context.cast(builder, args[k], sig.args[k], types.int64) for k in (1, 3, 5, 7, 10)]
            rp = builder.gep(wp, [at_])

            def store(ptr, off, index, v, ty=_V16):
                p = builder.gep(ptr, [builder.add(off, _c64(16 * index))])
                builder.store(v, builder.bitcast(p, ty.as_pointer()), align=4)

            def byte(at):  # byte `at` of each column's block (a field of unit 1), as int32 lanes
                return builder.zext(_load(builder, rp, at, _B16), _V16)

            codes_, scales_, pairs_ = (lambda i, v: store(cp, co_, i, v), lambda q, v: store(sp, so_, q, v),
                                       lambda p, v: store(pp, po_, p, v))
            store(dp, pdo_, 0, _widen_f16(builder, _load(builder, rp, 0, _H16)), _F16V)
            if kind == "q6k":  # d | 16 int8 scales from 32 | ql, qh words from 288
                words = [_words(builder, rp, 288 + 64 * v, 16) for v in range(48)]
                sc = [builder.sext(_load(builder, rp, 32 + 16 * q, _B16), _V16) for q in range(16)]
                _q6k_panel(builder, words[:16], words[16:32], words[32:], sc, codes_, scales_, pairs_)
                return context.get_dummy_value()
            # q5k: d dmin | 12 scale bytes from 64 | qh words from 256 | qs words from 768
            store(mp, pdo_, 0, _widen_f16(builder, _load(builder, rp, 32, _H16)), _F16V)
            t = [_words(builder, rp, 768 + 64 * v, 16) for v in range(32)]
            tq = [_words(builder, rp, 256 + 64 * v, 16) for v in range(8)]
            u = []
            for i in range(3):  # scale word i: bytes 4i..4i+3 of each column
                v = byte(64 + 16 * 4 * i)
                for b in range(1, 4):
                    v = builder.or_(v, builder.shl(byte(64 + 16 * (4 * i + b)), _splat(builder, _V16, 8 * b)))
                u.append(v)
            _k4_panel(builder, t, tq, u, codes_, scales_, pairs_)
            return context.get_dummy_value()

        return types.void(w, at, codes, co, scales, so, pairs, po, pd, pdm, pdo), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


decode_q5k_record = _record_decoder("decode_q5k_record", "q5k")
decode_q6k_record = _record_decoder("decode_q6k_record", "q6k")


@njit(inline="always", **_JIT)
def _scratch(nsb, nsub):
    """A panel's arrays (codes, scales, pairs, pd, pdm) and a pass's rows (tmp)."""
    return (np.empty((nsb, GROUPS, PANEL_COLS), np.uint32), np.empty((nsb, nsub, PANEL_COLS), np.int32),
            np.empty((nsb, 8, PANEL_COLS), np.int32), np.empty((nsb, PANEL_COLS), np.float32),
            np.empty((nsb, PANEL_COLS), np.float32), np.empty((WIDE_ROWS, PANEL_COLS), np.float32))


@njit(inline="always", **_JIT)
def _passes(panel, xq, xd, xs, out, n0, n1, rows8, rows, rows2, rows1):
    """out[:, n0:n1] from a decoded panel (`_scratch`'s arrays): every row against it, eight
    at a time (`rows8`), then four (`rows`; a last group of three repeats its last row,
    stored once), a last two or one by `rows2` / `rows1` (a verify step's 4 + 1 rows pays
    for 5, not 8)."""
    codes, scales, pairs, pd, pdm, tmp = panel
    M, K, nsb = out.shape[0], xq.shape[1], pd.shape[0]
    tail = M % ROW_GROUP if M % ROW_GROUP < 3 else 0  # rows left to rows2 / rows1
    wide = (M - tail) // WIDE_ROWS * WIDE_ROWS  # rows of the wide passes
    for m in range(0, wide, WIDE_ROWS):
        rows8(tmp, codes, scales, pairs, pd, pdm, xq, xs, xd, m, m, m, m, K, nsb)
        _store_rows(out, tmp, m, WIDE_ROWS, n0, n1)
    for m in range(wide, M - tail, ROW_GROUP):
        rows(tmp, codes, scales, pairs, pd, pdm, xq, xs, xd, m, min(m + 1, M - 1), min(m + 2, M - 1),
             min(m + 3, M - 1), K, nsb)
        _store_rows(out, tmp, m, min(ROW_GROUP, M - m), n0, n1)
    m = M - tail
    if tail == 2:
        rows2(tmp, codes, scales, pairs, pd, pdm, xq, xs, xd, m, m + 1, m + 1, m + 1, K, nsb)
    elif tail == 1:
        rows1(tmp, codes, scales, pairs, pd, pdm, xq, xs, xd, m, m, m, m, K, nsb)
    _store_rows(out, tmp, m, tail, n0, n1)


@njit(inline="always", **_JIT)
def _record_panel_columns(w, xq, xd, xs, out, c0, c1, decode, rows8, rows, rows2, rows1, nsub):
    """out[:, c0:c1] (c0 a multiple of 16, c1 too or the last column) for repacked weights
    (`repack.pack`: uint8 [N', K/256 * bytes]) by panels, one a group of 16 columns, each
    decoded from its records (`decode`: a `_record_decoder`), their lines asked for as the
    record tiles do (`prefetch_ahead`; 1-5% faster than the next group's record, from memory,
    at 24-128 rows), then `_passes`."""
    nsb = xq.shape[1] // QK
    rb = w.shape[1]
    rec = rb * PANEL_COLS // nsb
    panel = _scratch(nsb, nsub)
    codes, scales, pairs, pd, pdm, _ = panel
    for g in range(c0 // PANEL_COLS, (c1 + PANEL_COLS - 1) // PANEL_COLS):
        base = g * PANEL_COLS * rb
        for s in range(nsb):
            at = base + s * rec
            prefetch_ahead(w, at, rec)
            decode(w, at, codes, s * GROUPS * PANEL_COLS, scales, s * nsub * PANEL_COLS, pairs,
                   s * 8 * PANEL_COLS, pd, pdm, s * PANEL_COLS)
        _passes(panel, xq, xd, xs, out, g * PANEL_COLS, min(g * PANEL_COLS + PANEL_COLS, c1), rows8, rows, rows2,
                rows1)


@njit(inline="always", **_JIT)
def q5k_record_panel_columns(w, xq, xd, xs, out, c0, c1):
    """`_record_panel_columns` for repacked Q5_K weights (8 sub-blocks of 32)."""
    _record_panel_columns(w, xq, xd, xs, out, c0, c1, decode_q5k_record, panel_rows8_8, panel_rows8, panel_rows8_2,
                          panel_rows8_1, 8)


@njit(inline="always", **_JIT)
def q6k_record_panel_columns(w, xq, xd, xs, out, c0, c1):
    """`_record_panel_columns` for repacked Q6_K weights (16 sub-blocks of 16)."""
    _record_panel_columns(w, xq, xd, xs, out, c0, c1, decode_q6k_record, panel_rows16_8, panel_rows16,
                          panel_rows16_2, panel_rows16_1, 16)


@njit(inline="always", **_JIT)
def _store_rows(out, tmp, m, n, n0, n1):
    """out[m:m+n, n0:n1] = tmp[:n, :n1-n0]: a pass's rows, the panel's columns that exist."""
    for r in range(n):
        for c in range(n1 - n0):
            out[m + r, n0 + c] = tmp[r, c]
