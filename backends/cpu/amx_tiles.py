"""Q4_K, Q5_K and Q6_K products for many rows on AMX tiles (Intel's Advanced Matrix
Extensions: `tdpbsud`, 16 rows x 16 columns x 64 int8 products an instruction).

`q8k_panel`'s panels pass the activations one `vpdpbusd` (16 columns x 4 weights) at a time:
at prefill that is the whole cost (a 128-row Q5_K product ran at 57 int8 products a
cycle a core). A tile product does 1,024 a cycle, but it sums over 64 weights, and a
K-quant's 32 (Q6_K: 16) weights of a sub-block each have their own scale, which a sum
must apply before it meets the next sub-block's. So the scales go into the weights: a
panel holds, per weight, v = sc * c (Q6_K: sc * (c - 32)), exact in 16 bits, split into a
low byte (unsigned) and a high byte (unsigned for Q4_K / Q5_K, whose v <= 63 * 31; signed
for Q6_K), and a third plane with each weight's sub-block min m (Q4_K, Q5_K). Then per
super-block and pass of up to 16 rows, three tile products sum exactly

    isum = sum_k x * lo + 256 * sum_k x * hi    (= sum_j sc[j] * (sum over j of c * x))
    msum = sum_k x * m                          (= sum_j m[j] * (x sum of j))

the contract's integers (`packed256`'s docstring), then the same float step lane by lane
(`q8k_dot._float_step`; Q6_K: acc + (dx * d) * f32(isum)). Integer sums are exact in any
order, so a row's bits are those of `packed256`'s record tiles and of `q8k_panel`'s panels,
whichever computes it and beside whichever rows. Bounds: |sum x * lo| <= 256 * 255 * 128,
|256 * sum x * hi| <= 256 * 256 * 16 * 128, both < 2**31.

A panel is decoded from the repacked records (`repack.LAYOUTS`) of one group of 16
columns: per super-block four chunks of 64 weights, each a 1 KiB tile of 16 rows (four
weights, `vpdpbusd`'s order) x 16 columns, the B operand; the activations are the A
operand as they lie (16 rows x 64 int8 at the row stride). A column range loads one tile
configuration (rows: min(M, 16)) and ends with `tilerelease`.

Linux lets a process use AMX only after asking (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
`enabled()` asks once and says whether these kernels may run: the compile target has
AMX-INT8 and the kernel granted it, and PANECHAT_AMX is not "0". Elsewhere nothing here is
compiled (`packed256` keeps its panels).
"""

from __future__ import annotations

import ctypes
import os
import platform

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from panechat.backends.cpu.numpy_kernels import _JIT, _is_c_array, call_llvm
from panechat.backends.cpu.packed32 import _widen_f16, high_nibbles, low_nibbles, prefetch_ahead
from panechat.backends.cpu.q8k_dot import _B16, _B64, _H16, _F16V, _I32, _V16, _float_step, _load, _splat, _splat_f32

QK = 256  # weights a super-block
COLS = 16  # columns a panel (a record's group)
TILE_ROWS = 16  # activation rows a pass computes (the tiles' most)
ROW_BLOCK = 128  # rows that meet a super-block's planes in turn (their accumulators: 8 KiB)
CHUNK = 64  # weights a tile product sums (its K)
PLANE = QK // CHUNK * CHUNK * COLS  # bytes of a super-block's plane in a panel: 4 KiB

_I8, _I16, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(64)
_W32 = ir.VectorType(_I16, 32)
_PTR = ir.PointerType(_I8)
_VOID = ir.VoidType()

_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158  # linux x86_64


def target_has_amx(features: str | None = None) -> bool:
    """Whether the compile target (numba's, as `q8k_dot.target_form` reads it; or an LLVM
    feature string) has AMX tiles and their int8 products."""
    if features is None:
        features = config.CPU_FEATURES
        if features is None:
            if config.CPU_NAME not in (None, "host"):
                return False  # a named target: assume only its baseline
            features = llvm.get_host_cpu_features().flatten()
    return {"+amx-tile", "+amx-int8"} <= set(features.split(","))


_ENABLED: bool | None = None


def enabled() -> bool:
    """Whether the AMX kernels may run in this process: PANECHAT_AMX is not "0", the target
    has AMX-INT8, and Linux granted the tile state (asked once, for every thread)."""
    global _ENABLED
    if _ENABLED is None:
        _ENABLED = (os.environ.get("PANECHAT_AMX", "1") != "0" and platform.system() == "Linux"
                    and platform.machine() in ("x86_64", "AMD64") and target_has_amx() and _request_tiles())
    return _ENABLED


def _request_tiles() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def _c64(v):
    return ir.Constant(_I64, v)


def _imm(v):
    return ir.Constant(_I8, v)


def _call(builder, name, *args):
    return call_llvm(builder, name, _VOID, *args)


def _ptr(builder, p, offset):
    return builder.bitcast(builder.gep(p, [offset]), _PTR)


# ---------------------------------------------------------------------------
# Panels: a record's weights times their sub-block scales, as tile planes
# ---------------------------------------------------------------------------

def _scale_words(builder, sc):
    """<32 x i16>: each column's scale (int32 lane c of sc, |sc| < 2**15) in both 16-bit
    words of its four bytes."""
    low = builder.and_(sc, _splat(builder, _V16, 0xFFFF))
    return builder.bitcast(builder.or_(low, builder.shl(sc, _splat(builder, _V16, 16))), _W32)


def _planes(builder, code, sc2, offset, store_lo, store_hi):
    """Store the low and high bytes of v = code * sc2 - offset (16 bits, exact) of a row of
    64 codes (<64 x i8>, unsigned): the even and odd bytes multiplied as 16-bit words in
    place (no widening across lanes), their products' bytes put back in order. offset:
    <32 x i16> or None."""
    w = builder.bitcast(code, _W32)
    lo8, hi8 = _splat(builder, _W32, 0x00FF), _splat(builder, _W32, 0xFF00)
    eight = _splat(builder, _W32, 8)
    even = builder.mul(builder.and_(w, lo8), sc2)
    odd = builder.mul(builder.lshr(w, eight), sc2)
    if offset is not None:
        even, odd = builder.sub(even, offset), builder.sub(odd, offset)
    store_lo(builder.bitcast(builder.or_(builder.and_(even, lo8), builder.shl(odd, eight)), _B64))
    store_hi(builder.bitcast(builder.or_(builder.lshr(even, eight), builder.and_(odd, hi8)), _B64))


def _record_panel(name, kind):
    """An intrinsic (w, at, lo, hi, mm, pd, pdm): the record at byte `at` of w as tile planes
    lo[:4096], hi[:4096] and (Q4_K, Q5_K) mm[:4096], chunk t of 64 weights at 1024 t, row i
    of it (weights 4i..4i+3 of the chunk) at + 64 i, lane 4c + e column c's weight 4i + e;
    and its 16 d (and dmin) widened to float32 into pd[:16] (pdm[:16]). kind: "q4k", "q5k"
    or "q6k"."""

    def typer(typingctx, w, at, lo, hi, mm, pd, pdm):
        if not (_is_c_array(w, types.uint8) and all(_is_c_array(a, types.uint8) for a in (lo, hi, mm))
                and _is_c_array(pd, types.float32) and _is_c_array(pdm, types.float32)
                and isinstance(at, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            wp, lp, hp, mp, dp, dmp = [context.make_array(sig.args[k])(context, builder, args[k]).data
                                       for k in (0, 2, 3, 4, 5, 6)]
            rp = builder.gep(wp, [context.cast(builder, args[1], sig.args[1], types.int64)])

            def store(p, off, v):
                builder.store(v, builder.bitcast(builder.gep(p, [_c64(off)]), _B64.as_pointer()), align=1)

            def row_at(j, v):  # sub-block j (of 32 weights), its weights 4v..4v+3: chunk j // 2, row 8 (j % 2) + v
                return 1024 * (j // 2) + 64 * (8 * (j % 2) + v)

            def fstore(p, v):
                builder.store(v, builder.bitcast(p, _F16V.as_pointer()), align=4)

            fstore(dp, _widen_f16(builder, _load(builder, rp, 0, _H16)))
            if kind == "q6k":  # d | 16 int8 scales from 32 | ql, qh from 288 (`packed256._q6k`)
                for j in range(8):
                    h, u = divmod(j, 4)
                    ql = [_load(builder, rp, 288 + 64 * (16 * h + 8 * (u & 1) + v), _B64) for v in range(8)]
                    qh = [_load(builder, rp, 288 + 64 * (32 + 8 * h + v), _B64) for v in range(8)]
                    nib = (low_nibbles if u < 2 else high_nibbles)(builder, ql)
                    shift = 4 - 2 * u
                    top = [builder.shl(b, _splat(builder, _B64, shift)) if shift > 0 else
                           (builder.lshr(b, _splat(builder, _B64, -shift)) if shift < 0 else b) for b in qh]
                    for e in range(2):  # groups of 16 weights: 2j + e, its scale
                        sc2 = _scale_words(builder, builder.sext(_load(builder, rp, 32 + 16 * (2 * j + e), _B16), _V16))
                        off32 = builder.shl(sc2, _splat(builder, _W32, 5))  # v = sc * c - 32 * sc
                        for v in range(4 * e, 4 * e + 4):
                            code = builder.or_(nib[v], builder.and_(top[v], _splat(builder, _B64, 0x30)))
                            off = row_at(j, v)
                            _planes(builder, code, sc2, off32, lambda x, o=off: store(lp, o, x),
                                    lambda x, o=off: store(hp, o, x))
                return context.get_dummy_value()
            # q4k: d dmin | 12 scale bytes from 64 | qs from 256; q5k: qh from 256, qs from 768
            fstore(dmp, _widen_f16(builder, _load(builder, rp, 32, _H16)))
            qs_at, qh_at = (256, None) if kind == "q4k" else (768, 256)
            m63, m15 = _splat(builder, _V16, 63), _splat(builder, _V16, 15)
            six, four = _splat(builder, _V16, 6), _splat(builder, _V16, 4)
            bit4 = _splat(builder, _V16, 0x10101010)
            s = lambda t: builder.zext(_load(builder, rp, 64 + 16 * t, _B16), _V16)  # noqa: E731
            for j in range(8):
                if j < 4:  # get_scale_min_k4 (`packed256._scaled_sub_blocks`)
                    sc, mn = builder.and_(s(j), m63), builder.and_(s(j + 4), m63)
                else:
                    sc = builder.or_(builder.and_(s(j + 4), m15), builder.shl(builder.lshr(s(j - 4), six), four))
                    mn = builder.or_(builder.lshr(s(j + 4), four), builder.shl(builder.lshr(s(j), six), four))
                raw = [_load(builder, rp, qs_at + 512 * (j // 2) + 64 * v, _B64) for v in range(8)]
                codes = (high_nibbles if j & 1 else low_nibbles)(builder, raw)
                sc2 = _scale_words(builder, sc)
                mn64 = builder.bitcast(builder.mul(mn, _splat(builder, _V16, 0x01010101)), _B64)  # m in each byte
                for v in range(8):
                    code = codes[v]
                    if qh_at is not None:
                        qh = _load(builder, rp, qh_at + 64 * v, _V16)
                        top = builder.shl(qh, _splat(builder, _V16, 4 - j)) if j <= 4 else \
                            builder.lshr(qh, _splat(builder, _V16, j - 4))
                        code = builder.or_(code, builder.bitcast(builder.and_(top, bit4), _B64))
                    off = row_at(j, v)
                    _planes(builder, code, sc2, None, lambda x, o=off: store(lp, o, x),
                            lambda x, o=off: store(hp, o, x))
                    store(mp, off, mn64)
            return context.get_dummy_value()

        return types.void(w, at, lo, hi, mm, pd, pdm), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


panel_q4k = _record_panel("amx_panel_q4k", "q4k")
panel_q5k = _record_panel("amx_panel_q5k", "q5k")
panel_q6k = _record_panel("amx_panel_q6k", "q6k")


# ---------------------------------------------------------------------------
# A pass: up to 16 rows against a panel, every super-block in order
# ---------------------------------------------------------------------------

_A, _BLO, _BHI, _BM, _CLO, _CHI, _CM = range(7)  # tile registers


def tile_config_of(name, shapes):
    """An intrinsic (n) loading the tile configuration in which tile register t holds
    shapes[t] = (bytes a row, rows), rows None for n (1..16, the rows of a pass). All tiles
    are zeroed."""

    def typer(typingctx, n):
        if not isinstance(n, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            cfg = cgutils.alloca_once_value(builder, ir.Constant(ir.ArrayType(_I8, 64), None))
            cfgp = builder.bitcast(cfg, _PTR)
            builder.store(ir.Constant(ir.ArrayType(_I8, 64), None), cfg)
            n8 = builder.trunc(context.cast(builder, args[0], sig.args[0], types.int64), _I8)
            builder.store(_imm(1), cfgp)  # palette 1
            for t, (colsb, rows) in enumerate(shapes):
                builder.store(ir.Constant(_I16, colsb), builder.bitcast(builder.gep(cfgp, [_c64(16 + 2 * t)]),
                                                                        _I16.as_pointer()))
                builder.store(n8 if rows is None else _imm(rows), builder.gep(cfgp, [_c64(48 + t)]))
            _call(builder, "llvm.x86.ldtilecfg", cfgp)
            return context.get_dummy_value()

        return types.void(n), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


# passes of n rows: A (n rows of 64 int8), the B planes (16 rows of 64), the C sums (n rows of 16 int32)
tile_config = tile_config_of("amx_tile_config", ((64, None),) + ((64, 16),) * 3 + ((64, None),) * 3)


@intrinsic
def tile_release(typingctx):
    """`tilerelease`: the tile state back to its initial form (a context switch saves none)."""

    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tilerelease")
        return context.get_dummy_value()

    return types.void(), codegen


def _pass(name, kind):
    """An intrinsic (acc, lo, hi, mm, pd, pdm, xq, xd, m0, n, s, first): rows m0 + first..
    m0 + n - 1 of acc float32 [M', 16] (M' >= m0 + 16) after super-block s of the Q8_K
    activations xq int8 [M, K] (scales xd [M, K/256]) against its panel (`_record_panel`'s
    planes; d, dmin in pd, pdm [16]), in tiles configured for n rows (`tile_config`). Rows
    before `first` are computed and left as they were (a last pass of 16 rows that overlaps
    the one before: one tile configuration for the whole product); rows past n are computed
    from undefined sums (and row n - 1's scale) and must not be read. kind: "k4" (Q4_K,
    Q5_K) or "q6k"."""
    q6 = kind == "q6k"
    sums = (_CLO, _CHI) if q6 else (_CLO, _CHI, _CM)

    def typer(typingctx, acc, lo, hi, mm, pd, pdm, xq, xd, m0, n, s, first):
        if not (_is_c_array(acc, types.float32) and all(_is_c_array(a, types.uint8) for a in (lo, hi, mm))
                and _is_c_array(pd, types.float32) and _is_c_array(pdm, types.float32)
                and _is_c_array(xq, types.int8) and _is_c_array(xd, types.float32)
                and all(isinstance(a, types.Integer) for a in (m0, n, s, first))):
            return None

        def codegen(context, builder, sig, args):
            arrays = [context.make_array(sig.args[k])(context, builder, args[k]) for k in range(8)]
            ap, lp, hp, mp, dp, dmp, xp, xdp = [a.data for a in arrays]
            K = builder.extract_value(arrays[6].shape, 1)
            nsb = builder.extract_value(arrays[7].shape, 1)
            m0_, n_, s_, first_ = [context.cast(builder, args[k], sig.args[k], types.int64) for k in (8, 9, 10, 11)]
            cbuf = cgutils.alloca_once(builder, ir.ArrayType(_I32, 3 * 256))
            cp = builder.bitcast(cbuf, _PTR)
            xrow = builder.gep(xp, [builder.add(builder.mul(m0_, K), builder.mul(s_, _c64(QK)))])

            for t in sums:
                _call(builder, "llvm.x86.tilezero", _imm(t))
            for c in range(QK // CHUNK):
                _call(builder, "llvm.x86.tileloadd64", _imm(_A), _ptr(builder, xrow, _c64(CHUNK * c)), K)
                _call(builder, "llvm.x86.tileloadd64", _imm(_BLO), _ptr(builder, lp, _c64(1024 * c)), _c64(64))
                _call(builder, "llvm.x86.tdpbsud", _imm(_CLO), _imm(_A), _imm(_BLO))
                _call(builder, "llvm.x86.tileloadd64", _imm(_BHI), _ptr(builder, hp, _c64(1024 * c)), _c64(64))
                _call(builder, "llvm.x86.tdpbssd" if q6 else "llvm.x86.tdpbsud", _imm(_CHI), _imm(_A), _imm(_BHI))
                if not q6:
                    _call(builder, "llvm.x86.tileloadd64", _imm(_BM), _ptr(builder, mp, _c64(1024 * c)), _c64(64))
                    _call(builder, "llvm.x86.tdpbsud", _imm(_CM), _imm(_A), _imm(_BM))
            for i, t in enumerate(sums):
                _call(builder, "llvm.x86.tilestored64", _imm(t), _ptr(builder, cp, _c64(1024 * i)), _c64(64))

            def vec(p, offset, ty=_V16):
                return builder.load(builder.bitcast(builder.gep(p, [offset]), ty.as_pointer()), align=4)

            d = vec(dp, _c64(0), _F16V)
            dm = None if q6 else vec(dmp, _c64(0), _F16V)
            last = builder.sub(n_, _c64(1))
            for r in range(TILE_ROWS):
                row = builder.add(m0_, builder.select(builder.icmp_signed("<", _c64(r), n_), _c64(r), last))
                dx = _splat_f32(builder, builder.load(builder.gep(xdp, [builder.add(builder.mul(row, nsb), s_)])))
                isum = builder.add(vec(cp, _c64(64 * r)), builder.shl(vec(cp, _c64(1024 + 64 * r)),
                                                                       _splat(builder, _V16, 8)))
                at = builder.mul(builder.add(m0_, _c64(r)), _c64(COLS))
                a0 = a = vec(ap, at, _F16V)
                if q6:
                    a = builder.fadd(a, builder.fmul(builder.fmul(dx, d), builder.sitofp(isum, _F16V)))
                else:
                    a = _float_step(builder, a, builder.fmul(dx, d), isum, builder.fmul(dx, dm),
                                    vec(cp, _c64(2048 + 64 * r)))
                a = builder.select(builder.icmp_signed("<", _c64(r), first_), a0, a)
                builder.store(a, builder.bitcast(builder.gep(ap, [at]), _F16V.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(acc, lo, hi, mm, pd, pdm, xq, xd, m0, n, s, first), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


pass_k4 = _pass("amx_pass_k4", "k4")
pass_q6k = _pass("amx_pass_q6k", "q6k")


# ---------------------------------------------------------------------------
# Column ranges
# ---------------------------------------------------------------------------

@njit(inline="always", **_JIT)
def _columns(w, xq, xd, out, c0, c1, panel, rows):
    """out[:, c0:c1] (c0 a multiple of 16, c1 too or the last column) for repacked weights
    (uint8 [N', K/256 * bytes]): per group of 16 columns, block of ROW_BLOCK rows and
    super-block, its panel (4 KiB planes, which stay in L1: decoded once per block, cheaper
    than planes of every super-block read from L2), then the block's rows against it 16 at
    a time, each row's sums added to its accumulators in super-block order. M < 16 rows
    make one pass, else passes of 16, the last overlapping the one before (another tile
    configuration costs more). The first block asks for the records' lines as the record
    tiles do (`prefetch_ahead`: 1 KiB past each record; the next group's record, 18 KiB
    ahead at K = 2048, made a 16-row Q5_K/Q6_K product from memory 16-21% slower and a
    64-row one 6-7%)."""
    M, K = xq.shape
    nsb = K // QK
    rb = w.shape[1]
    rec = rb * COLS // nsb
    lo, hi, mm = np.empty(PLANE, np.uint8), np.empty(PLANE, np.uint8), np.empty(PLANE, np.uint8)
    pd, pdm = np.empty(COLS, np.float32), np.empty(COLS, np.float32)
    acc = np.empty(((M + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS, COLS), np.float32)
    n = min(M, TILE_ROWS)
    tile_config(n)
    for g in range(c0 // COLS, (c1 + COLS - 1) // COLS):
        base = g * COLS * rb
        acc[:] = 0
        for r0 in range(0, M, ROW_BLOCK):
            for s in range(nsb):
                at = base + s * rec
                if r0 == 0:
                    prefetch_ahead(w, at, rec)
                panel(w, at, lo, hi, mm, pd, pdm)
                for m in range(r0, min(r0 + ROW_BLOCK, M), TILE_ROWS):
                    m0 = min(m, M - n)
                    rows(acc, lo, hi, mm, pd, pdm, xq, xd, m0, n, s, m - m0)
        n0 = g * COLS
        for r in range(M):
            for c in range(min(n0 + COLS, c1) - n0):
                out[r, n0 + c] = acc[r, c]
    tile_release()


@njit(inline="always", **_JIT)
def q4k_columns(w, xq, xd, xs, out, c0, c1):
    """out[:, c0:c1] for repacked Q4_K weights and Q8_K rows (`q8k_dot.quantized_rows`; xs unused: `packed256`'s
    column products' arguments)."""
    _columns(w, xq, xd, out, c0, c1, panel_q4k, pass_k4)


@njit(inline="always", **_JIT)
def q5k_columns(w, xq, xd, xs, out, c0, c1):
    """`q4k_columns` for repacked Q5_K weights."""
    _columns(w, xq, xd, out, c0, c1, panel_q5k, pass_k4)


@njit(inline="always", **_JIT)
def q6k_columns(w, xq, xd, xs, out, c0, c1):
    """`q4k_columns` for repacked Q6_K weights."""
    _columns(w, xq, xd, out, c0, c1, panel_q6k, pass_q6k)


enabled()  # asked at import: a kernel of this module run without the grant dies of SIGILL
