"""Q4_0 and Q8_0 products for many rows on AMX tiles: `packed32`'s arithmetic (its docstring
is the contract), the integer sums of each block from tile products.

`packed32`'s record tiles meet a row's activations one `vpdpbusd` (16 columns x 4 weights)
at a time, twice (q = 256 a + b: two int8 planes); at prefill that is the whole cost.
Here, per group of 16 columns and block of 32 weights, the record's codes are a B tile
(8 rows of 64 bytes: row r weights 4r..4r+3, byte 4c + i column c's weight 4r + i, the
record's own order, `repack`), each less its offset (Q4_0: c - 8; Q8_0: c + 128 - 128, the
file's int8 code), so the contract's - off * xs is already in the sum; the A tiles are up
to 16 rows' 32 activations of the block in the a and b planes as they lie (row stride
2K). Two `tdpbssd` give, exactly (|a plane sum| <= 32 * 128 * 128),

    isum = 256 * sum_k a * c' + sum_k b * c'       (= the contract's isum - off * xs)

and the float step is the contract's, lane by lane, per row and block in increasing order.
Integer sums are exact in any order, so a row's bits are those of `packed32`'s record
tiles, whichever computes it and beside whichever rows.

A block's sums must leave the tiles before the next block's (each block has its own
scales): a pass of 16 rows stores 2 KiB of sums a block, and those stores, not the
products, bound it. So passes are software-pipelined: a pass's tile sums are stored while
the float steps of the pass before read theirs. A panel (the signed codes of PAIR blocks
and their d widened to float32) is decoded once for a block of rows (`packed32.task_rows`:
their activations stay in L2 while they meet every group).

Q4_1 has no form here: its float step (+ m * sx) made it no faster than the record tiles
(128 rows: 12.5 vs 12.1 ms at 8192x2048).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from panechat.backends.cpu import packed32
from panechat.backends.cpu.amx_tiles import _PTR, TILE_ROWS, _c64, _call, _imm, _ptr, tile_config_of, tile_release
from panechat.backends.cpu.numpy_kernels import _JIT, _is_c_array
from panechat.backends.cpu.packed32 import QB, _widen_f16, high_nibbles, low_nibbles, prefetch_ahead, task_rows
from panechat.backends.cpu.q8k_dot import _B64, _F16V, _H16, _V16, _load, _splat, _splat_f32
from panechat.backends.cpu.repack import GROUP

Q4_0_MIN_ROWS = 16  # Q4_0's tile products from this many rows on (1B shape: S_TG B=16 148-155 tok/s, record tiles 129-132)
Q8_0_MIN_ROWS = 12  # Q8_0's (12 rows: 1.15-1.3x the record tiles, 10: 0.93-1.14x; S_TG B=12 122 vs 103-108 tok/s)
PAIR = 2  # blocks a pass sums (2 x PAIR C tiles of the 8)
CODES = QB * GROUP  # bytes of a block's B tile: 512
SLOT = 2 * PAIR * 256  # int32 sums a pass stores
_A, _B = 0, 1  # tile registers (`tile_config32`); the C tiles from 2: block j's a plane 2 + 2j, its b plane 3 + 2j


# passes of n rows: A (n rows of 32 int8), B (8 rows of 64), the C sums (n rows of 16 int32)
tile_config32 = tile_config_of("amx_tile_config32", ((QB, None), (64, QB // 4)) + ((64, None),) * (2 * PAIR))


def _record_panel(name, qtype):
    """An intrinsic (w, at, p, pd, j, k): the record at byte `at` of w as block j of the
    panel: its signed codes (module docstring) into p[512 j:512 (j + 1)], its 16 d widened
    to float32 into pd[16 k:16 (k + 1)]."""

    def typer(typingctx, w, at, p, pd, j, k):
        if not (_is_c_array(w, types.uint8) and _is_c_array(p, types.int8) and _is_c_array(pd, types.float32)
                and all(isinstance(a, types.Integer) for a in (at, j, k))):
            return None

        def codegen(context, builder, sig, args):
            wp, pp, dp = [context.make_array(sig.args[k])(context, builder, args[k]).data for k in (0, 2, 3)]
            rp = builder.gep(wp, [context.cast(builder, args[1], sig.args[1], types.int64)])
            j_, k_ = [context.cast(builder, args[i], sig.args[i], types.int64) for i in (4, 5)]
            pp = builder.gep(pp, [builder.mul(j_, _c64(CODES))])
            builder.store(_widen_f16(builder, _load(builder, rp, 0, _H16)),
                          builder.bitcast(builder.gep(dp, [builder.mul(k_, _c64(GROUP))]), _F16V.as_pointer()),
                          align=4)
            if qtype == "Q8_0":  # c + 128 -> the file's int8 code
                rows = [builder.xor(_load(builder, rp, 32 + 64 * r, _B64), _splat(builder, _B64, 0x80))
                        for r in range(8)]
            else:  # Q4_0, vector r: low nibbles weights 4r + i, high nibbles 16 + 4r + i
                raw = [_load(builder, rp, 32 + 64 * r, _B64) for r in range(4)]
                rows = [builder.sub(v, _splat(builder, _B64, 8)) for v in low_nibbles(builder, raw)
                        + high_nibbles(builder, raw)]
            for r, v in enumerate(rows):
                builder.store(v, builder.bitcast(builder.gep(pp, [_c64(64 * r)]), _B64.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(w, at, p, pd, j, k), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


panel_q4_0 = _record_panel("amx_panel_q4_0", "Q4_0")
panel_q8_0 = _record_panel("amx_panel_q8_0", "Q8_0")


@intrinsic
def tile_sums(typingctx, p, xq, cs, m0, b, cslot):
    """A pass's sums: rows m0.. (as many as configured) of the int16 rows xq int8 [M, 2K],
    blocks b..b + PAIR - 1, against the panel's codes p, stored to cs[cslot] (int32
    [2, SLOT]; block j's a plane sums at 512 j, its b plane's at 512 j + 256, a row 16)."""
    if not (_is_c_array(p, types.int8) and _is_c_array(xq, types.int8) and _is_c_array(cs, types.int32)
            and all(isinstance(a, types.Integer) for a in (m0, b, cslot))):
        return None

    def codegen(context, builder, sig, args):
        xa = context.make_array(sig.args[1])(context, builder, args[1])
        pp, cp = [context.make_array(sig.args[k])(context, builder, args[k]).data for k in (0, 2)]
        K2 = builder.extract_value(xa.shape, 1)  # the row stride
        m0_, b_, cs_ = [context.cast(builder, args[k], sig.args[k], types.int64) for k in (3, 4, 5)]
        cp = builder.bitcast(builder.gep(cp, [builder.mul(cs_, _c64(SLOT))]), _PTR)
        xrow = builder.gep(xa.data, [builder.add(builder.mul(m0_, K2), builder.mul(b_, _c64(QB)))])
        half = builder.udiv(K2, _c64(2))  # the b plane: K past the a plane
        for t in range(2 * PAIR):
            _call(builder, "llvm.x86.tilezero", _imm(2 + t))
        for j in range(PAIR):
            _call(builder, "llvm.x86.tileloadd64", _imm(_B), _ptr(builder, pp, _c64(CODES * j)), _c64(64))
            for plane in range(2):
                at = _c64(QB * j) if plane == 0 else builder.add(half, _c64(QB * j))
                _call(builder, "llvm.x86.tileloadd64", _imm(_A), _ptr(builder, xrow, at), K2)
                _call(builder, "llvm.x86.tdpbssd", _imm(2 + 2 * j + plane), _imm(_A), _imm(_B))
        for t in range(2 * PAIR):
            _call(builder, "llvm.x86.tilestored64", _imm(2 + t), _ptr(builder, cp, _c64(1024 * t)), _c64(64))
        return context.get_dummy_value()

    return types.void(p, xq, cs, m0, b, cslot), codegen


@intrinsic
def float_steps(typingctx, acc, cs, pd, xd, m0, r0, n, b, first, pslot, cslot):
    """Rows m0 + first..m0 + n - 1 of the accumulators (acc float32 [M', 16], a row's at row
    - r0) after blocks b..b + PAIR - 1: their sums in cs[cslot] (`tile_sums`), the panels'
    d in pd[pslot * PAIR..], the rows' scales in xd float32 [M, K/32]; each row's
    (acc + (dx * d) * f32(isum)) a block. Rows before `first` are computed and left as they
    were (a last pass of 16 that overlaps the one before); rows past n (a pass of fewer)
    are computed from undefined sums and must not be read."""
    if not (_is_c_array(acc, types.float32) and _is_c_array(cs, types.int32) and _is_c_array(pd, types.float32)
            and _is_c_array(xd, types.float32)
            and all(isinstance(a, types.Integer) for a in (m0, r0, n, b, first, pslot, cslot))):
        return None

    def codegen(context, builder, sig, args):
        arrays = [context.make_array(sig.args[k])(context, builder, args[k]) for k in range(4)]
        ap, cp, dp, xdp = [a.data for a in arrays]
        nb = builder.extract_value(arrays[3].shape, 1)
        m0_, r0_, n_, b_, first_, ps, cs_ = [context.cast(builder, args[k], sig.args[k], types.int64)
                                             for k in range(4, 11)]
        cp = builder.gep(cp, [builder.mul(cs_, _c64(SLOT))])
        dp = builder.gep(dp, [builder.mul(ps, _c64(PAIR * GROUP))])

        def vec(p, offset, ty=_V16):
            return builder.load(builder.bitcast(builder.gep(p, [offset]), ty.as_pointer()), align=4)

        d = [vec(dp, _c64(GROUP * j), _F16V) for j in range(PAIR)]
        last = builder.sub(n_, _c64(1))
        eight = _splat(builder, _V16, 8)
        for r in range(TILE_ROWS):
            row = builder.add(m0_, builder.select(builder.icmp_signed("<", _c64(r), n_), _c64(r), last))
            at = builder.mul(builder.add(builder.sub(m0_, r0_), _c64(r)), _c64(GROUP))
            a0 = a = vec(ap, at, _F16V)
            for j in range(PAIR):
                dx = _splat_f32(builder, builder.load(builder.gep(xdp, [builder.add(builder.mul(row, nb),
                                                                                    builder.add(b_, _c64(j)))])))
                isum = builder.add(builder.shl(vec(cp, _c64(512 * j + 16 * r)), eight),
                                   vec(cp, _c64(512 * j + 256 + 16 * r)))
                a = builder.fadd(a, builder.fmul(builder.fmul(dx, d[j]), builder.sitofp(isum, _F16V)))
            a = builder.select(builder.icmp_signed("<", _c64(r), first_), a0, a)
            builder.store(a, builder.bitcast(builder.gep(ap, [at]), _F16V.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(acc, cs, pd, xd, m0, r0, n, b, first, pslot, cslot), codegen


@njit(inline="always", **_JIT)
def _columns(w, xq, xd, out, c0, c1, panel):
    """out[:, c0:c1] (c0 a multiple of 16, c1 too or the last column) for records of 32-weight
    blocks (uint8 [N', K/32 * bytes], K/32 a multiple of PAIR): per block of `task_rows`
    rows (a remainder under 16 joins the block before), group of 16 columns and PAIR
    blocks, their panel, then the block's rows against it 16 at a time (the last pass
    overlapping the one before: one tile configuration), each pass's float steps one pass
    late (two slots of sums and of d, the codes' panel rewritten only after the tile loads
    that read it; loads right after the tile stores they read made a 128-row product 30%
    slower)."""
    M = xq.shape[0]
    nb = xd.shape[1]
    rb = w.shape[1]
    rec = rb * GROUP // nb
    R = task_rows(M, nb * QB)
    p = np.empty(PAIR * CODES, np.int8)
    pd = np.empty(2 * PAIR * GROUP, np.float32)
    cs = np.empty((2, SLOT), np.int32)
    acc = np.empty(((min(M, R + TILE_ROWS) + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS, GROUP), np.float32)
    n = min(M, TILE_ROWS)
    tile_config32(n)
    r0 = 0
    while r0 < M:
        r1 = M if r0 + R + TILE_ROWS > M else r0 + R
        for g in range(c0 // GROUP, (c1 + GROUP - 1) // GROUP):
            base = g * GROUP * rb
            acc[:] = 0
            k = 0  # passes so far in this group
            pm0, pb, pfirst, pps = 0, 0, 0, 0  # the pass before's
            for b in range(0, nb, PAIR):
                ps = (b // PAIR) & 1
                for j in range(PAIR):
                    at = base + (b + j) * rec
                    if r0 == 0:
                        prefetch_ahead(w, at, rec)
                    panel(w, at, p, pd, j, ps * PAIR + j)
                for m in range(r0, r1, TILE_ROWS):
                    m0 = min(m, r1 - n)
                    tile_sums(p, xq, cs, m0, b, k & 1)
                    if k > 0:
                        float_steps(acc, cs, pd, xd, pm0, r0, n, pb, pfirst, pps, (k - 1) & 1)
                    pm0, pb, pfirst, pps = m0, b, m - m0, ps
                    k += 1
            float_steps(acc, cs, pd, xd, pm0, r0, n, pb, pfirst, pps, (k - 1) & 1)
            n0 = g * GROUP
            for r in range(r0, r1):
                for c in range(min(n0 + GROUP, c1) - n0):
                    out[r, n0 + c] = acc[r - r0, c]
        r0 = r1
    tile_release()


@njit(inline="always", **_JIT)
def q4_0_columns(w, xq, xd, xs, sx, out, c0, c1):
    """out[:, c0:c1] for packed Q4_0 weights and int16 rows (`packed32.q4_0_columns`'s
    arguments; xs and sx unused: the offset is in the codes), K/32 a multiple of PAIR."""
    _columns(w, xq, xd, out, c0, c1, panel_q4_0)


@njit(inline="always", **_JIT)
def q8_0_columns(w, xq, xd, xs, sx, out, c0, c1):
    """`q4_0_columns` for packed Q8_0 weights."""
    _columns(w, xq, xd, out, c0, c1, panel_q8_0)


@njit(inline="always", **_JIT)
def q4_0_columns_amx(w, xq, xd, xs, sx, out, c0, c1):
    """`packed32.q4_0_columns` where AMX tiles may run (registry `cpu_amx`): from
    Q4_0_MIN_ROWS rows on (K/32 a multiple of PAIR) by tile products, else the record tiles."""
    if xq.shape[0] >= Q4_0_MIN_ROWS and xd.shape[1] % PAIR == 0:
        q4_0_columns(w, xq, xd, xs, sx, out, c0, c1)
    else:
        packed32.q4_0_columns(w, xq, xd, xs, sx, out, c0, c1)


@njit(inline="always", **_JIT)
def q8_0_columns_amx(w, xq, xd, xs, sx, out, c0, c1):
    """`q4_0_columns_amx` for Q8_0, from Q8_0_MIN_ROWS rows on."""
    if xq.shape[0] >= Q8_0_MIN_ROWS and xd.shape[1] % PAIR == 0:
        q8_0_columns(w, xq, xd, xs, sx, out, c0, c1)
    else:
        packed32.q8_0_columns(w, xq, xd, xs, sx, out, c0, c1)
