"""Decode attention in one numba call per layer: write the step's K and V rows into the
paged store, then attend, every key and value read straight from its block.

`numpy_kernels.paged_attention` first copies each (row, kv head)'s keys and values into
float32 buffers in position order (two heap buffers of P x hd per task), then runs the
contiguous kernel on them; around it, `write_kv` and the wrapper's checks are a dozen
numpy calls. At decode every row belongs to a different sequence, so here one call:

* checks the rows and block tables (in numba, no numpy temporaries),
* turns q and k by RoPE when asked (`NumpyBackend.rope_attend`: two calls fewer a layer),
* rounds the new K and V rows to the store's dtype and writes them (the same bits as
  numpy's float32 -> float16 assignment: IEEE round to nearest even),
* splits the (row, query head) tasks among the threads in runs of about equal cost
  (`share_tasks`), so a thread mostly takes whole rows: it walks a row's blocks once for
  all its heads, whose keys (and values) lie next to each other in each block, each
  block prefetched into L2 two blocks ahead (`_prefetch_block`). (A task per (row, kv
  head) read 2 KB pieces 6 KB apart, and waited on memory for half its time: 29 -> 13 us
  per (row, kv head) at 576 positions, docs/benchmarks.md.)
* converts each block of keys of a kv head to float32 once into a 16-row scratch that
  stays in L1 and serves every query head of the group (GQA); values are read straight
  from the store, each value vector converted once for up to four heads of the group
  (`numpy_kernels.value_sums`; through the scratch, and three heads at a time, the value
  sums took 2.9x as long: 91 against 31.5 us for the default model's 9 heads at 2000
  positions, in L2).

Every output element's float32 arithmetic is `numpy_kernels.paged_attention`'s, operation for
operation: the same lane scheme per score (16 keys at a time through `_scores16`, the
others through `_dot`, both the same bits per key), max and exp in position order, the
weighted V sum accumulated in position order from zero, the same `_sum` and division.
Only the memory the operands come from differs, so paged == contiguous bit for bit, at
any batch size (tests/backends/test_decode_attention.py).

A call where some sequence has several rows (a prefill chunk) returns False having
written nothing; the caller then takes `paged_attention`, which gathers such a sequence
once for all its rows.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import config
from numba.extending import intrinsic

from panechat.backends.cpu.numpy_kernels import (LANES, _JIT, _dot, _element_ptr, _exp_less_max, _is_c_array, _scores16,
                            f32vec, load_kv, normalized, prefetch_l2, value_sums, vload, vload_kv, vmul, vsplat, vstore)

_HALF_VEC = ir.VectorType(ir.HalfType(), LANES)


def _target_has_f16c() -> bool:
    """Whether numba compiles for a CPU with F16C (float -> half in one instruction; without
    it LLVM would call a runtime helper numba does not link)."""
    feats = config.CPU_FEATURES
    if feats is None:
        feats = llvm.get_host_cpu_features().flatten()
    return "+f16c" in feats.split(",")


HAS_F16C = _target_has_f16c()


@intrinsic
def vstore_kv(typingctx, arr, i, v):
    """Store the float32 vector `v` at ``arr.flat[i : i + 16]`` of KV storage: float32, or
    half floats held as uint16 bits, each rounded once to nearest even (fptrunc)."""
    if not (isinstance(i, types.Integer) and v == f32vec):
        return None
    if _is_c_array(arr, types.float32):
        def codegen(context, builder, sig, args):
            p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            builder.store(args[2], builder.bitcast(p, args[2].type.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.none(arr, i, v), codegen
    if _is_c_array(arr, types.uint16):
        def codegen(context, builder, sig, args):
            p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            builder.store(builder.fptrunc(args[2], _HALF_VEC), builder.bitcast(p, _HALF_VEC.as_pointer()), align=2)
            return context.get_dummy_value()
        return types.none(arr, i, v), codegen
    return None


@intrinsic
def store_kv(typingctx, arr, i, x):
    """``arr.flat[i] = x`` for a float32 scalar into float32 or half (uint16 bits) storage."""
    if not (isinstance(i, types.Integer) and x == types.float32):
        return None
    if _is_c_array(arr, types.float32):
        def codegen(context, builder, sig, args):
            builder.store(args[2], _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1]))
            return context.get_dummy_value()
        return types.none(arr, i, x), codegen
    if _is_c_array(arr, types.uint16):
        def codegen(context, builder, sig, args):
            p = _element_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            builder.store(builder.fptrunc(args[2], ir.HalfType()), builder.bitcast(p, ir.HalfType().as_pointer()),
                          align=2)
            return context.get_dummy_value()
        return types.none(arr, i, x), codegen
    return None


@njit(**_JIT)
def _write_row(blocks, o, x, xo, D):
    """blocks.flat[o : o + D] = x.flat[xo : xo + D], rounded to the store's dtype."""
    dv = D - D % LANES
    xf = x.reshape(-1)
    for d in range(0, dv, LANES):
        vstore_kv(blocks, o + d, vload(x, xo + d))
    for d in range(dv, D):
        store_kv(blocks, o + d, xf[xo + d])


@njit(**_JIT)
def _rope_row(x, xo, p, cos, sin, neox, dst, do, D):
    """dst.flat[do : do + D] = x.flat[xo : xo + D] turned by RoPE at position p: the bits of
    `numpy_kernels.rope` (a*cos - b*sin and b*cos + a*sin, each product and sum rounded)."""
    xf, df = x.reshape(-1), dst.reshape(-1)
    half = cos.shape[1]
    for i in range(half):
        c, s = cos[p, i], sin[p, i]
        ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
        a, b = xf[xo + ia], xf[xo + ib]
        df[do + ia] = a * c - b * s
        df[do + ib] = b * c + a * s
    for j in range(2 * half, D):
        df[do + j] = xf[xo + j]


@njit(**_JIT)
def _convert(blocks, o, n, buf):
    """buf[i, :] = blocks.flat[o + i*D : o + (i+1)*D] as float32 (exact), for i < n."""
    D = buf.shape[1]
    dv = D - D % LANES
    for i in range(n):
        for d in range(0, dv, LANES):
            vstore(buf, i * D + d, vload_kv(blocks, o + i * D + d))
        for d in range(dv, D):
            buf[i, d] = load_kv(blocks, o + i * D + d)


@njit(**_JIT)
def _prefetch_block(blocks, table, b, last_b, g0, g1):
    """Prefetch block table[b]'s kv heads g0..g1-1 into L2 (b <= last_b). Weights stream
    through the caches between one layer's attention and the next, so a long context's
    keys and values come from L3 or memory; with each block asked for two ahead, the
    default model's heads at 2000 positions attended in 127-150 us a layer instead of
    168-195 (one thread, the weights' stream between layers), while the hardware
    prefetcher alone followed the sequence's blocks only within each 4 KiB page."""
    if b <= last_b:
        G, B, D = blocks.shape[1], blocks.shape[2], blocks.shape[3]
        for i in range(((table[b] * G + g0) * B) * D, ((table[b] * G + g1) * B) * D, 64 // blocks.itemsize):
            prefetch_l2(blocks, i)


@njit(**_JIT)
def _segment_scores(q, qo, kb, n, scale, ef, eo):
    """ef[eo + i] = q . kb[i] * scale for i < n: `numpy_kernels._scores`'s bits per key."""
    D = q.shape[2]
    dv = D - D % LANES
    qf, kf = q.reshape(-1), kb.reshape(-1)
    sv = vsplat(scale)
    nv = n - n % LANES
    for t in range(0, nv, LANES):
        v = _scores16(q, qo, kb, t * D, D, dv)
        if dv == D:
            vstore(ef, eo + t, vmul(v, sv))
            continue
        vstore(ef, eo + t, v)
        for i in range(LANES):
            st = ef[eo + t + i]
            for d in range(dv, D):  # head-dim tail, as in _dot
                st = st + qf[qo + d] * kf[(t + i) * D + d]
            ef[eo + t + i] = st * scale
    for t in range(nv, n):
        ef[eo + t] = _dot(q, qo, kb, t * D, D) * scale


@njit(**_JIT)
def _group_heads(g, grp, h0, h1):
    """Kv head g's query heads among h0..h1-1 (grp a kv head), as offsets from h0: ja..jb-1."""
    return max(h0, g * grp) - h0, min(h1, (g + 1) * grp) - h0


_AHEAD = 2  # blocks between a prefetch and the block's use
_TASK_COST = 16  # a (row, head) task's fixed cost, in attended positions


@njit(**_JIT)
def first_position(last, window):
    """The first position a row at `last` attends (window 0: all)."""
    return max(0, last - window + 1) if window > 0 else 0


@njit(**_JIT)
def _task_cost(last, window):
    """The cost of a (row, head) task of a row at position `last`: its attended positions
    plus `_TASK_COST`."""
    return last + 1 - first_position(last, window) + _TASK_COST


@njit(**_JIT)
def share_tasks(pos, window, G, tid, n):
    """Thread tid of n's (row, head) tasks as [k, 3] rows (r, g0, g1): heads g0..g1-1 of row
    r, of G a row (kv heads, for the K/V writes; query heads, for attention). The tasks in
    row-major order are split into n runs of about equal cost (attended positions +
    `_TASK_COST` each), so a thread takes whole rows where it can and reads each of their
    blocks once for all its heads, in one stream. Which thread runs a task never changes
    its bits. (Attention split by kv heads left a thread waiting: the default model's 3 kv
    heads went 2 and 1, gemma-3-270m's 1 all to one thread.)"""
    R = pos.shape[0]
    runs = _share_units(np.arange(R + 1), pos, window, G, tid, n)
    out = np.empty((runs.shape[0], 3), np.int64)
    for k in range(runs.shape[0]):
        out[k, 0], out[k, 1], out[k, 2] = runs[k, 0], runs[k, 2], runs[k, 3]
    return out


@njit(**_JIT)
def _attend_blocks(q, k_blocks, v_blocks, table, r, h0, h1, first, last, scale, out):
    """Query heads h0..h1-1 of row r over positions first..last of the sequence whose block
    table is `table`: each block's keys (then values) of their kv heads, adjacent in the
    store, are read once, in one pass over the blocks, for all of those query heads; each
    head's arithmetic is the same whatever h0..h1 is."""
    H, D = q.shape[1], q.shape[2]
    G, B = k_blocks.shape[1], k_blocks.shape[2]
    grp = H // G
    P = last + 1 - first
    g0, g1, nh = h0 // grp, (h1 - 1) // grp + 1, h1 - h0
    e = np.empty((nh, P), np.float32)  # scores, then exp(score - max)
    ef = e.reshape(-1)
    buf = np.empty((B, D), np.float32)
    sv = vsplat(scale)
    b0, last_b = first // B, last // B
    for b in range(b0, b0 + _AHEAD):
        _prefetch_block(k_blocks, table, b, last_b, g0, g1)
    p = first
    while p <= last:
        off = p % B
        n = min(B - off, last + 1 - p)
        _prefetch_block(k_blocks, table, p // B + _AHEAD, last_b, g0, g1)
        for g in range(g0, g1):
            ja, jb = _group_heads(g, grp, h0, h1)
            _convert(k_blocks, ((table[p // B] * G + g) * B + off) * D, n, buf)
            if n == LANES and D % LANES == 0:  # a whole block of keys and whole vectors: kept tight
                for j in range(ja, jb):
                    vstore(ef, j * P + p - first, vmul(_scores16(q, (r * H + h0 + j) * D, buf, 0, D, D), sv))
            else:
                for j in range(ja, jb):
                    _segment_scores(q, (r * H + h0 + j) * D, buf, n, scale, ef, j * P + p - first)
        p += n
    for j in range(nh):
        _exp_less_max(e[j], P)
    acc = np.zeros((nh, D), np.float32)
    af = acc.reshape(-1)
    for b in range(b0, b0 + _AHEAD):
        _prefetch_block(v_blocks, table, b, last_b, g0, g1)
    p = first
    while p <= last:
        off = p % B
        n = min(B - off, last + 1 - p)
        _prefetch_block(v_blocks, table, p // B + _AHEAD, last_b, g0, g1)
        for g in range(g0, g1):
            ja, jb = _group_heads(g, grp, h0, h1)
            value_sums(ef, ja * P + p - first, P, jb - ja, v_blocks, ((table[p // B] * G + g) * B + off) * D, n,
                       af, ja * D, D)
        p += n
    for j in range(nh):
        normalized(acc[j], e[j], P, out, r, h0 + j)


@njit(**_JIT)
def _attend_run(q, k_blocks, v_blocks, table, r0, m, h0, h1, window, last0, scale, out):
    """`_attend_blocks` for query heads h0..h1-1 of rows r0..r0+m-1, one sequence's rows at
    positions last0..last0+m-1 (a decode row and its drafts): each block's keys (then
    values) are converted once for all m rows, and each row computes from them exactly what
    `_attend_blocks` computes for it alone: its segment of the block (its window's first
    position to its own), 16 keys at a time where the segment is a whole block, the same
    softmax and the same weighted sum key after key."""
    if m == 1:  # this loop at one row was 6-11% slower than `_attend_blocks`' (the same bits)
        _attend_blocks(q, k_blocks, v_blocks, table, r0, h0, h1, first_position(last0, window), last0, scale, out)
        return
    H, D = q.shape[1], q.shape[2]
    G, B = k_blocks.shape[1], k_blocks.shape[2]
    grp = H // G
    g0, g1, nh = h0 // grp, (h1 - 1) // grp + 1, h1 - h0
    lastm = last0 + m - 1
    first0 = first_position(last0, window)
    W = lastm + 1 - first0  # room for every row's scores (the last row's are the most)
    e = np.empty((m, nh, W), np.float32)  # row, head: scores, then exp(score - max)
    buf = np.empty((B, D), np.float32)
    sv = vsplat(scale)
    b0, last_b = first0 // B, lastm // B
    for b in range(b0, b0 + _AHEAD):
        _prefetch_block(k_blocks, table, b, last_b, g0, g1)
    for b in range(b0, last_b + 1):
        _prefetch_block(k_blocks, table, b + _AHEAD, last_b, g0, g1)
        s, t = max(b * B, first0), min(b * B + B, lastm + 1)  # every row's keys in this block
        for g in range(g0, g1):
            ja, jb = _group_heads(g, grp, h0, h1)
            _convert(k_blocks, ((table[b] * G + g) * B + s - b * B) * D, t - s, buf)
            for i in range(m):
                first = first_position(last0 + i, window)
                a, z = max(s, first), min(t, last0 + i + 1)  # this row's segment
                if a >= z:
                    continue
                ef = e[i].reshape(-1)
                qo = ((r0 + i) * H + h0) * D
                if z - a == LANES and D % LANES == 0:
                    for j in range(ja, jb):
                        vstore(ef, j * W + a - first, vmul(_scores16(q, qo + j * D, buf, (a - s) * D, D, D), sv))
                else:
                    for j in range(ja, jb):
                        _segment_scores(q, qo + j * D, buf[a - s:], z - a, scale, ef, j * W + a - first)
    for i in range(m):
        for j in range(nh):
            _exp_less_max(e[i, j], last0 + i + 1 - first_position(last0 + i, window))
    acc = np.zeros((m, nh, D), np.float32)
    ea, af = e.reshape(-1), acc.reshape(-1)
    for b in range(b0, b0 + _AHEAD):
        _prefetch_block(v_blocks, table, b, last_b, g0, g1)
    for b in range(b0, last_b + 1):
        _prefetch_block(v_blocks, table, b + _AHEAD, last_b, g0, g1)
        s, t = max(b * B, first0), min(b * B + B, lastm + 1)
        for g in range(g0, g1):
            ja, jb = _group_heads(g, grp, h0, h1)
            for i in range(m):
                first = first_position(last0 + i, window)
                a, z = max(s, first), min(t, last0 + i + 1)
                if a < z:
                    value_sums(ea, (i * nh + ja) * W + a - first, W, jb - ja, v_blocks,
                               ((table[b] * G + g) * B + a - b * B) * D, z - a, af, (i * nh + ja) * D, D)
    for i in range(m):
        P = last0 + i + 1 - first_position(last0 + i, window)
        for j in range(nh):
            normalized(acc[i, j], e[i, j], P, out, r0 + i, h0 + j)


@njit(**_JIT)
def share_runs(seqs, pos, window, H, tid, n):
    """Thread tid of n's attention tasks as [k, 4] rows (r0, m, h0, h1): query heads
    h0..h1-1 of rows r0..r0+m-1, a run of one sequence's rows at consecutive positions
    (a decode row and its drafts; other rows are runs of one). The (run, head) units in
    run-major order are split into n runs of about equal cost (the run's attended
    positions + `_TASK_COST` a row), so a verify step's rows are split by heads and each
    thread reads a block once for all of them (`_attend_run`)."""
    R = pos.shape[0]
    starts = np.empty(R + 1, np.int64)
    k = 0
    for r in range(R):
        if r == 0 or seqs[r] != seqs[r - 1] or pos[r] != pos[r - 1] + 1:
            starts[k] = r
            k += 1
    starts[k] = R
    return _share_units(starts[:k + 1], pos, window, H, tid, n)


@njit(**_JIT)
def _share_units(starts, pos, window, U, tid, n):
    """Thread tid of n's share of the (run, unit) pairs, U units a run, the runs of rows
    starts[u]..starts[u+1]-1: [k, 4] rows (r0, m, u0, u1), units u0..u1-1 of the run of m
    rows from r0. The pairs in run-major order are split into n runs of about equal cost
    (each row's attended positions + `_TASK_COST`, a unit)."""
    R = pos.shape[0]
    total = 0
    for r in range(R):
        total += U * _task_cost(pos[r], window)
    out = np.empty((starts.shape[0] - 1, 4), np.int64)
    c, start = 0, 0
    for u in range(starts.shape[0] - 1):
        r0, r1 = starts[u], starts[u + 1]
        cost = 0
        for r in range(r0, r1):
            cost += _task_cost(pos[r], window)
        u0, u1 = U, 0
        for h in range(U):
            if (start + h * cost) * n // total == tid:
                u0, u1 = min(u0, h), h + 1
        start += U * cost
        if u0 < u1:
            out[c, 0], out[c, 1], out[c, 2], out[c, 3] = r0, r1 - r0, u0, u1
            c += 1
    return out[:c]


@njit(**_JIT)
def check_rows(tables, seqs, pos, n_blocks, B, max_pos, max_run):
    """0 if a decode call can run: every row's sequence and position in range (below
    max_pos and within its table), its table entries valid, and each sequence's rows, in
    any row order, at distinct consecutive positions, at most max_run of them (a decode
    row and its drafts); else -1 (row out of range), -2 (table entry out of range), 1 (a
    sequence with rows the call does not take: a prefill chunk, or positions with gaps or
    repeats)."""
    S, MB = tables.shape
    R = seqs.shape[0]
    count = np.zeros(S, np.int64)
    lo = np.full(S, MB * B, np.int64)
    hi = np.full(S, -1, np.int64)
    several = False
    for r in range(R):
        s, p = seqs[r], pos[r]
        if s < 0 or s >= S or p < 0 or p >= MB * B or p >= max_pos:
            return -1
        count[s] += 1
        several = several or count[s] > 1
        lo[s], hi[s] = min(lo[s], p), max(hi[s], p)
    for s in range(S):
        for b in range(hi[s] // B + 1):  # hi -1 (no rows): none
            if tables[s, b] < 0 or tables[s, b] >= n_blocks:
                return -2
    if not several:
        return 0
    base = np.zeros(S, np.int64)  # where each sequence's positions start in `seen`
    total = 0
    for s in range(S):
        if count[s] > max_run or (count[s] > 1 and hi[s] - lo[s] + 1 != count[s]):
            return 1
        base[s] = total
        total += count[s]
    seen = np.zeros(total, np.bool_)  # count == span, so a repeat is a seen position
    for r in range(R):
        i = base[seqs[r]] + pos[r] - lo[seqs[r]]
        if seen[i]:
            return 1
        seen[i] = True
    return 0


@njit(parallel=True, **_JIT)
def _decode(q, k, v, k_blocks, v_blocks, tables, row_seq, row_pos, scale, window, out, rope_on, cos, sin, neox,
            n):
    R, H, D = q.shape
    NB, G, B = k_blocks.shape[0], k_blocks.shape[1], k_blocks.shape[2]
    status = check_rows(tables, row_seq, row_pos, NB, B, cos.shape[0] if rope_on else tables.shape[1] * B, 1)
    if status:  # checked before anything is written
        return status
    qr = q
    kr = np.empty(D, np.float32)
    if rope_on:  # q and k turned here rather than in two more calls
        qr = np.empty_like(q)
        for r in range(R):
            for h in range(H):
                _rope_row(q, (r * H + h) * D, row_pos[r], cos, sin, neox, qr, (r * H + h) * D, D)
    for r in range(R):
        p = row_pos[r]
        blk = tables[row_seq[r], p // B]
        for g in range(G):
            o = ((blk * G + g) * B + p % B) * D
            if rope_on:
                _rope_row(k, (r * G + g) * D, p, cos, sin, neox, kr, 0, D)
                _write_row(k_blocks, o, kr, 0, D)
            else:
                _write_row(k_blocks, o, k, (r * G + g) * D, D)
            _write_row(v_blocks, o, v, (r * G + g) * D, D)
    for tid in prange(n):  # n: numba's thread count
        for task in share_tasks(row_pos, window, H, tid, n):  # query heads: even shares
            r, last = task[0], row_pos[task[0]]
            _attend_blocks(qr, k_blocks, v_blocks, tables[row_seq[r]], r, task[1], task[2],
                           first_position(last, window), last, scale, out)
    return 0


_NO_ROPE = np.zeros((1, 0), np.float32)


def _c(a: np.ndarray, dtype) -> bool:
    return a.dtype == dtype and a.flags.c_contiguous


def paged_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_blocks: np.ndarray, v_blocks: np.ndarray,
                 tables: np.ndarray, row_seq: np.ndarray, row_pos: np.ndarray, scale: float, out: np.ndarray,
                 window: int = 0, rope: tuple[np.ndarray, np.ndarray, bool] | None = None) -> bool:
    """Write k, v f32[R, n_kv, hd] at each row's position (rounded to the store's dtype),
    then attention of q f32[R, H, hd] into out, as `paged_attention` defines it (the same
    bits); True. False, having written nothing, when a sequence has several rows in the
    call (or the store is float16 and the CPU lacks F16C). k_blocks, v_blocks [n_blocks, n_kv, B, hd] float16 or float32; tables int32
    [S, max_blocks]; row_seq, row_pos int32 [R]; all C-contiguous. `rope` = (cos, sin,
    neox): q and k are first turned as `numpy_kernels.rope` does with those float32 tables
    [max_pos, rope_dim/2] (q itself is left as it is). ValueError for bad rows or tables."""
    if k_blocks.dtype == np.float16:
        if not HAS_F16C:
            return False  # the caller's numpy write + paged_attention: the same bits
        k_blocks, v_blocks = k_blocks.view(np.uint16), v_blocks.view(np.uint16)
    kvt = k_blocks.dtype
    if not (_c(q, np.float32) and _c(k, np.float32) and _c(v, np.float32) and _c(out, np.float32)
            and _c(k_blocks, kvt) and _c(v_blocks, kvt) and kvt in (np.float32, np.uint16)
            and _c(tables, np.int32) and _c(row_seq, np.int32) and _c(row_pos, np.int32)
            and q.ndim == 3 and k.ndim == 3 and k_blocks.ndim == 4 and tables.ndim == 2):
        raise ValueError("paged_decode: arrays must be C-contiguous float32 (q, k, v, out), "
                         "float16/float32 (KV) and int32 (tables, rows)")
    R, H, D = q.shape
    NB, G, B, D2 = k_blocks.shape
    if (D2 != D or v_blocks.shape != k_blocks.shape or out.shape != q.shape or H % G
            or k.shape != (R, G, D) or v.shape != k.shape or row_seq.shape != (R,) or row_pos.shape != (R,)):
        raise ValueError(f"paged_decode: shapes q{q.shape} k{k.shape} v{v.shape} kv{k_blocks.shape} "
                         f"out{out.shape}")
    if window < 0:
        raise ValueError(f"paged_decode: window must be >= 0, got {window}")
    cos, sin, neox = (_NO_ROPE, _NO_ROPE, False) if rope is None else rope
    if rope is not None and not (_c(cos, np.float32) and _c(sin, np.float32) and cos.ndim == 2
                                 and sin.shape == cos.shape and 2 * cos.shape[1] <= D):
        raise ValueError(f"paged_decode: RoPE tables must be C-contiguous float32 [max_pos, <= {D // 2}]")
    status = _decode(q, k, v, k_blocks, v_blocks, tables, row_seq, row_pos, np.float32(scale),
                     np.int64(window), out, rope is not None, cos, sin, bool(neox), get_num_threads())
    if status == -1:
        raise ValueError("paged_decode: row_seq / row_pos out of range")
    if status == -2:
        raise ValueError("paged_decode: a block table entry is out of range")
    return status == 0
