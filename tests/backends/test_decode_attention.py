"""The one-call decode attention (`decode_attention.paged_decode`) equals the numpy KV write
followed by `numpy_kernels.paged_attention` bit for bit: stored K and V and the output, for
1..33 rows of distinct sequences, float16 and float32 stores, head dims that are and are
not whole vectors, sliding windows, shuffled block tables; and the backend's `attend`
gives the same bits whichever path it takes."""

from __future__ import annotations

import numpy as np
import pytest

from panechat.backends.cpu import decode_attention as da
from panechat.backends.cpu import numpy_kernels as nk
from panechat.backends.cpu.numpy_backend import NumpyBackend
from panechat.backends.paged_kv import BLOCK_TOKENS

from .decode_rows import decode_rows


def _store(rng, n_blocks, G, D, dtype):
    kb = rng.standard_normal((n_blocks, G, BLOCK_TOKENS, D), dtype=np.float32).astype(dtype)
    vb = rng.standard_normal((n_blocks, G, BLOCK_TOKENS, D), dtype=np.float32).astype(dtype)
    return kb, vb


def _composed(q, k, v, kb, vb, tables, seqs, poss, scale, window):
    """The numpy write (ArrayBackend.write_kv's assignment), then paged_attention."""
    blocks, offs = tables[seqs, poss // BLOCK_TOKENS], poss % BLOCK_TOKENS
    kb[blocks, :, offs, :] = k
    vb[blocks, :, offs, :] = v
    return nk.paged_attention(q, kb, vb, tables, seqs, poss, scale, np.empty_like(q), window)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("D,H,G,window", [(64, 9, 3, 0), (40, 6, 2, 0), (64, 6, 2, 37), (80, 4, 4, 16), (64, 8, 2, 0)])
def test_paged_decode_equals_write_then_paged_attention_rows_1_to_33(dtype, D, H, G, window):
    rng = np.random.default_rng(11)
    S, nb = 40, 12  # up to 192 positions per sequence
    n_blocks = S * nb + 5
    kb, vb = _store(rng, n_blocks, G, D, dtype)
    for R in range(1, 34):
        tables = rng.permutation(n_blocks)[: S * nb].reshape(S, nb).astype(np.int32)
        seqs = rng.choice(S, R, replace=False).astype(np.int32)
        poss = rng.integers(0, nb * BLOCK_TOKENS, R).astype(np.int32)
        poss[0] = min(R * 5, nb * BLOCK_TOKENS - 1)  # short, whole-block and long contexts
        q = rng.standard_normal((R, H, D), dtype=np.float32)
        k = rng.standard_normal((R, G, D), dtype=np.float32) * np.float32(3)
        v = rng.standard_normal((R, G, D), dtype=np.float32)
        kb2, vb2 = kb.copy(), vb.copy()
        want = _composed(q, k, v, kb, vb, tables, seqs, poss, 0.125, window)
        got = np.empty_like(q)
        assert da.paged_decode(q, k, v, kb2, vb2, tables, seqs, poss, 0.125, got, window)
        assert np.array_equal(kb2.view(np.uint8), kb.view(np.uint8)), R
        assert np.array_equal(vb2.view(np.uint8), vb.view(np.uint8)), R
        assert np.array_equal(got, want), R


def test_paged_decode_rounds_to_half_as_numpy_does():
    """Ties, subnormals, overflow to infinity and values near the half range's edges are
    stored with numpy's bits (round to nearest even)."""
    rng = np.random.default_rng(3)
    vals = np.concatenate([
        rng.standard_normal(4000).astype(np.float32) * np.float32(100),
        (np.arange(-2048, 2048, dtype=np.float32) + np.float32(0.5)),  # ties at integers' halves
        rng.uniform(-1e-4, 1e-4, 2000).astype(np.float32),  # half subnormals
        np.array([65504, 65519.99, 65520, 1e6, -1e6, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8, 0.0, -0.0,
                  np.inf, -np.inf], np.float32),
    ])
    vals = np.concatenate([vals, np.zeros(-len(vals) % 64, np.float32)]).reshape(-1, 1, 64)
    R = vals.shape[0]
    kb, vb = np.zeros((R, 1, BLOCK_TOKENS, 64), np.float16), np.zeros((R, 1, BLOCK_TOKENS, 64), np.float16)
    tables = np.arange(R, dtype=np.int32).reshape(R, 1)
    seqs, poss = np.arange(R, dtype=np.int32), (np.arange(R) % BLOCK_TOKENS).astype(np.int32)
    q = np.zeros((R, 1, 64), np.float32)
    da.paged_decode(q, vals, vals, kb, vb, tables, seqs, poss, 1.0, np.empty_like(q))
    with np.errstate(over="ignore"):
        want = vals.astype(np.float16)
    got = kb[np.arange(R), 0, poss]
    assert np.array_equal(got.view(np.uint16), want[:, 0].view(np.uint16))


def test_paged_decode_declines_several_rows_of_one_sequence_and_writes_nothing():
    rng = np.random.default_rng(4)
    kb, vb = _store(rng, 8, 2, 64, np.float16)
    before = kb.copy()
    tables = np.arange(8, dtype=np.int32).reshape(2, 4)
    q = rng.standard_normal((2, 4, 64), dtype=np.float32)
    k = rng.standard_normal((2, 2, 64), dtype=np.float32)
    assert not da.paged_decode(q, k, k, kb, vb, tables, np.array([1, 1], np.int32), np.array([5, 6], np.int32),
                               0.1, np.empty_like(q))
    assert np.array_equal(kb, before)


def test_paged_decode_rejects_bad_rows_and_tables():
    rng = np.random.default_rng(5)
    kb, vb = _store(rng, 8, 2, 64, np.float16)
    tables = np.arange(8, dtype=np.int32).reshape(2, 4)
    q = rng.standard_normal((1, 4, 64), dtype=np.float32)
    k = rng.standard_normal((1, 2, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="out of range"):
        da.paged_decode(q, k, k, kb, vb, tables, np.array([0], np.int32), np.array([64], np.int32), 0.1,
                        np.empty_like(q))
    bad = tables.copy()
    bad[1, 1] = 8
    with pytest.raises(ValueError, match="block table"):
        da.paged_decode(q, k, k, kb, vb, bad, np.array([1], np.int32), np.array([20], np.int32), 0.1,
                        np.empty_like(q))
    bad[1, 1], bad[1, 2] = 5, -1  # past the row's position: never read, may be anything
    assert da.paged_decode(q, k, k, kb, vb, bad, np.array([1], np.int32), np.array([20], np.int32), 0.1,
                           np.empty_like(q))


@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_backend_attend_same_bits_for_decode_and_prefill_shaped_calls(dtype):
    """A row computed in a decode-shaped call (the one-call path) equals the same row in a
    call where its sequence has other rows (the gather path)."""
    be = NumpyBackend()
    rng = np.random.default_rng(6)
    G, H, D, nb = 3, 9, 64, 6
    kv_a, kv_b = be.new_paged_kv(2 * nb, 1, G, D, dtype), be.new_paged_kv(2 * nb, 1, G, D, dtype)
    tables = np.arange(2 * nb, dtype=np.int32).reshape(2, nb)
    n = 70
    k = rng.standard_normal((n, G, D), dtype=np.float32)
    v = rng.standard_normal((n, G, D), dtype=np.float32)
    q = rng.standard_normal((n, H, D), dtype=np.float32)
    seq, pos = np.zeros(n, np.int32), np.arange(n, dtype=np.int32)
    prefill = be.attend(kv_a, 0, q, k, v, seq, pos, 0.125, 0, tables)
    for t in range(n):  # token by token, beside a row of the other sequence
        s2 = np.array([0, 1], np.int32)
        p2 = np.array([t, t], np.int32)
        out = be.attend(kv_b, 0, np.stack([q[t], q[t]]), np.stack([k[t], k[t]]), np.stack([v[t], v[t]]), s2, p2,
                        0.125, 0, tables)
        assert np.array_equal(out[0], prefill[t]), t
    assert np.array_equal(kv_a.k[0][:nb], kv_b.k[0][:nb]) and np.array_equal(kv_a.v[0][:nb], kv_b.v[0][:nb])


@pytest.mark.parametrize("style,rope_dim", [("neox", 64), ("normal", 64), ("neox", 32), ("normal", 48)])
@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_rope_attend_equals_rope_then_attend_rows_1_to_33(style, rope_dim, dtype):
    """The fused RoPE + KV write + attention (`NumpyBackend.rope_attend`) equals the two
    `rope` calls and `attend` (the Backend default) bit for bit: output, stored K and V;
    q is left untouched."""
    be = NumpyBackend()
    rng = np.random.default_rng(8)
    G, H, D, S, nb = 3, 9, 64, 40, 10
    tabs = be.rope_tables(rope_dim, 10000.0, nb * BLOCK_TOKENS)
    kv_a, kv_b = be.new_paged_kv(S * nb, 1, G, D, dtype), be.new_paged_kv(S * nb, 1, G, D, dtype)
    for kv in (kv_a, kv_b):
        fill = np.random.default_rng(1)
        kv.k[0][...] = fill.standard_normal(kv.k[0].shape, dtype=np.float32)
        kv.v[0][...] = fill.standard_normal(kv.v[0].shape, dtype=np.float32)
    tables = rng.permutation(S * nb).reshape(S, nb).astype(np.int32)
    for R in range(1, 34):
        q, k, v, seqs, poss = decode_rows(rng, R, H, G, D, S, nb)
        q0 = q.copy()
        want = be.attend(kv_a, 0, be.rope(q, poss, style, tabs), be.rope(k, poss, style, tabs), v, seqs, poss,
                         0.125, 0, tables)
        got = be.rope_attend(kv_b, 0, q, k, v, seqs, poss, 0.125, 0, tables, style, tabs)
        assert np.array_equal(got, want), R
        assert np.array_equal(q, q0)
        assert np.array_equal(kv_a.k[0], kv_b.k[0]) and np.array_equal(kv_a.v[0], kv_b.v[0]), R
    # a prefill-shaped call (several rows of one sequence) composes and gives the same bits
    q = rng.standard_normal((5, H, D), dtype=np.float32)
    k = rng.standard_normal((5, G, D), dtype=np.float32)
    seqs, poss = np.zeros(5, np.int32), np.arange(20, 25, dtype=np.int32)
    want = be.attend(kv_a, 0, be.rope(q, poss, style, tabs), be.rope(k, poss, style, tabs), k, seqs, poss, 0.1, 0,
                     tables)
    assert np.array_equal(be.rope_attend(kv_b, 0, q, k, k, seqs, poss, 0.1, 0, tables, style, tabs), want)


@pytest.mark.parametrize("window", [0, 40])
def test_share_tasks_gives_every_row_and_kv_head_to_one_thread_in_balanced_runs(window):
    """The threads' (row, heads) runs cover each (row, head) once, in row-major order, and
    no thread's cost exceeds an even share by more than one task (G: kv heads for the K/V
    writes, query heads for attention)."""
    rng = np.random.default_rng(12)
    for R in range(1, 34):
        pos = rng.integers(0, 300, R).astype(np.int32)
        cost = [p + 1 - (max(0, p - window + 1) if window else 0) + da._TASK_COST for p in pos]
        for G in (1, 2, 3, 4, 9):
            for n in (1, 2, 3, 4, 7):
                seen, loads = [], []
                for tid in range(n):
                    runs = da.share_tasks(pos, window, G, tid, n)
                    tasks = [(int(r), g) for r, g0, g1 in runs for g in range(g0, g1)]
                    assert all(0 <= g0 < g1 <= G for _, g0, g1 in runs)
                    seen += tasks
                    loads.append(sum(cost[r] for r, _ in tasks))
                assert seen == [(r, g) for r in range(R) for g in range(G)], (R, G, n)
                assert max(loads) <= sum(loads) / n + max(cost), (R, G, n, loads)


@pytest.mark.parametrize("H,G", [(9, 3), (4, 1), (8, 2)])
def test_any_split_of_a_rows_query_heads_gives_each_head_its_bits(H, G):
    """Threads split a row's attention by query heads (`share_tasks` over H), so a task may
    hold part of a kv head's group: every split, inside groups or across them, gives each
    head the bits of the task holding them all."""
    rng = np.random.default_rng(14)
    D, nb = 64, 6
    kb, vb = _store(rng, nb, G, D, np.float16)
    kb, vb = kb.view(np.uint16), vb.view(np.uint16)
    table = rng.permutation(nb).astype(np.int32)
    q = rng.standard_normal((2, H, D), dtype=np.float32)
    for first, last in ((0, 70), (21, 90), (5, 5)):
        whole = np.zeros_like(q)
        da._attend_blocks(q, kb, vb, table, 1, 0, H, first, last, np.float32(0.125), whole)
        for cuts in ([1], [H - 1], [H // 2], [1, 2, H - 1]):
            got = np.zeros_like(q)
            for h0, h1 in zip([0] + cuts, cuts + [H]):
                da._attend_blocks(q, kb, vb, table, 1, h0, h1, first, last, np.float32(0.125), got)
            assert np.array_equal(got, whole), (first, last, cuts)
        assert whole[1].any() and not whole[0].any()


@pytest.mark.parametrize("window", [0, 20, 37])
def test_a_run_of_rows_gives_each_row_its_own_bits(window):
    """`_attend_run` converts each block once for a sequence's consecutive rows (a verify
    step's): every row, at any head range, gets the bits `_attend_blocks` gives it alone,
    whether its window starts in the first block of the run or later, and a run starting
    mid-block or at a block's last position."""
    rng = np.random.default_rng(15)
    H, G, D, nb = 9, 3, 64, 10
    kb, vb = _store(rng, nb, G, D, np.float16)
    kb, vb = kb.view(np.uint16), vb.view(np.uint16)
    table = rng.permutation(nb).astype(np.int32)
    for last0, m in ((40, 5), (15, 2), (47, 9), (3, 16), (100, 3)):
        q = rng.standard_normal((m + 2, H, D), dtype=np.float32)
        for h0, h1 in ((0, H), (2, 7), (4, 5)):
            want, got = np.zeros_like(q), np.zeros_like(q)
            for i in range(m):
                last = last0 + i
                da._attend_blocks(q, kb, vb, table, 1 + i, h0, h1, da.first_position(last, window), last,
                                  np.float32(0.125), want)
            da._attend_run(q, kb, vb, table, 1, m, h0, h1, window, last0, np.float32(0.125), got)
            assert np.array_equal(got, want), (last0, m, h0, h1)
            assert got[1:1 + m, h0:h1].all() and not got[0].any() and not got[1 + m:].any()


@pytest.mark.parametrize("window", [0, 40])
def test_share_runs_splits_a_sequences_rows_by_heads(window):
    """The threads' (run, heads) tasks cover each (row, query head) once; a sequence's
    consecutive rows form one run (rows elsewhere, or at a gap, their own), and no thread's
    cost exceeds an even share by more than one (run, head) unit."""
    rng = np.random.default_rng(16)
    for _ in range(40):
        seqs, pos = [], []
        for s in rng.permutation(6)[:rng.integers(1, 6)]:
            p0, k = int(rng.integers(0, 200)), int(rng.integers(1, 6))
            seqs += [int(s)] * k
            pos += list(range(p0, p0 + k))
        seqs, pos = np.asarray(seqs, np.int32), np.asarray(pos, np.int32)
        cost = [p + 1 - (max(0, p - window + 1) if window else 0) + da._TASK_COST for p in pos]
        for H in (1, 4, 9):
            for n in (1, 2, 3):
                seen, loads, units = [], [], []
                for tid in range(n):
                    tasks = da.share_runs(seqs, pos, window, H, tid, n)
                    for r0, m, h0, h1 in tasks:
                        assert all(seqs[r] == seqs[r0] and pos[r] == pos[r0] + r - r0 for r in range(r0, r0 + m))
                        seen += [(r, h) for r in range(r0, r0 + m) for h in range(h0, h1)]
                        units.append(sum(cost[r0:r0 + m]))
                    loads.append(sum(sum(cost[r0:r0 + m]) * (h1 - h0) for r0, m, h0, h1 in tasks))
                assert sorted(seen) == [(r, h) for r in range(len(pos)) for h in range(H)]
                assert max(loads) <= sum(loads) / n + max(units), (H, n, loads)


def test_paged_decode_same_bits_at_any_thread_count_and_block_order():
    """Rows attended by one thread (whole rows) or four (split rows), over tables whose
    blocks run in order, jump, or are shuffled, give the same bits as the composed ops."""
    import numba
    rng = np.random.default_rng(13)
    G, H, D, S, nb = 3, 9, 64, 8, 12
    n_blocks = S * nb
    kb, vb = _store(rng, n_blocks, G, D, np.float16)
    runs = np.arange(n_blocks, dtype=np.int32).reshape(S, nb)
    jumps = runs.copy()
    jumps[:, nb // 2:] = runs[::-1, nb // 2:]  # half in order, then another sequence's blocks
    shuffled = rng.permutation(n_blocks).reshape(S, nb).astype(np.int32)
    before = numba.get_num_threads()
    try:
        for tables in (runs, jumps, shuffled):
            for R in (1, 2, 5, 8):
                seqs = rng.choice(S, R, replace=False).astype(np.int32)
                poss = rng.integers(0, nb * BLOCK_TOKENS, R).astype(np.int32)
                q = rng.standard_normal((R, H, D), dtype=np.float32)
                k = rng.standard_normal((R, G, D), dtype=np.float32)
                want = _composed(q, k, k, kb.copy(), vb.copy(), tables, seqs, poss, 0.125, 0)
                for threads in sorted({1, min(4, numba.config.NUMBA_NUM_THREADS)}):
                    numba.set_num_threads(threads)
                    got = np.empty_like(q)
                    assert da.paged_decode(q, k, k, kb.copy(), vb.copy(), tables, seqs, poss, 0.125, got)
                    assert np.array_equal(got, want), (R, threads)
    finally:
        numba.set_num_threads(before)
