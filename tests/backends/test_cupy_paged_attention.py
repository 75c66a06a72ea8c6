"""Attention reading the paged KV store in place through the block tables (the
attn_*_f16 / attn_*_f32 kernels, emulated): bit for bit what the former path computed --
the sequences gathered into a contiguous float32 cache (ArrayBackend.contiguous_kv) and
the contiguous kernels' arithmetic (emulate_attention) -- at 1..33 rows, shuffled block
tables, float16 and float32 stores, GQA, head_dim 40 and 128, sliding windows; and a row's
output is the same alone and in any batch."""

from __future__ import annotations

import numpy as np
import pytest

from panechat.backends.cuda import kernels as ck
from panechat.backends.array_backend import ArrayBackend
from panechat.backends.cuda.cupy_backend import CupyBackend
from panechat.backends.paged_kv import BLOCK_TOKENS


def _store(rng, dtype: str, S: int, nb: int, G: int, D: int):
    be = CupyBackend.emulated_on_cpu()
    kv = be.new_paged_kv(S * nb, 1, G, D, dtype)
    for a in (kv.k[0], kv.v[0]):
        a[...] = rng.standard_normal(a.shape, dtype=np.float32).astype(a.dtype)
    tables = rng.permutation(S * nb).astype(np.int32).reshape(S, nb)  # shuffled blocks
    return be, kv, tables


@pytest.mark.parametrize("dtype,G,H,D,window", [("f16", 2, 6, 40, 0), ("f32", 1, 2, 128, 0),
                                                ("f16", 2, 4, 64, 21)])
def test_paged_attention_is_the_gathered_path_at_every_row_count(dtype, G, H, D, window):
    rng = np.random.default_rng(D + G)
    S, nb = 5, 4
    be, kv, tables = _store(rng, dtype, S, nb, G, D)
    C = nb * BLOCK_TOKENS
    pool_seq = rng.integers(0, S, 33).astype(np.int32)
    pool_pos = rng.integers(0, C, 33).astype(np.int32)
    pool_pos[0] = C - 1  # the longest key range
    pool_q = rng.standard_normal((33, H, D), dtype=np.float32) * 2
    kc, vc = ArrayBackend.contiguous_kv(be, kv, 0, tables)  # the former gather, float32
    want_all = ck.emulate_attention(pool_q, kc, vc, pool_seq, pool_pos, D ** -0.5, window)
    mod = be.kernels.module
    for M in range(1, 34):
        idx = rng.permutation(33)[:M]
        q = np.ascontiguousarray(pool_q[idx])
        out = np.empty_like(q)
        be.kernels.attention(q, kv.k[0], kv.v[0], tables, np.ascontiguousarray(pool_seq[idx]),
                             np.ascontiguousarray(pool_pos[idx]), D ** -0.5, out, window)
        assert mod.launches[-1][0] == f"attn_softmax_v_{dtype}"
        assert np.array_equal(out.view(np.uint32), want_all[idx].view(np.uint32)), M


def test_attend_reads_the_store_without_a_gather():
    """CupyBackend.attend: the step's K, V written into the blocks, then only the two
    attention launches; the result is the gathered path's."""
    rng = np.random.default_rng(11)
    be, kv, tables = _store(rng, "f16", 3, 3, 2, 32)
    R, H = 4, 4
    seqs = np.array([2, 0, 1, 2], np.int32)
    pos = np.array([40, 7, 33, 41], np.int32)
    q = rng.standard_normal((R, H, 32), dtype=np.float32)
    k = rng.standard_normal((R, 2, 32), dtype=np.float32)
    v = rng.standard_normal((R, 2, 32), dtype=np.float32)
    mod = be.kernels.module
    mod.launches.clear()
    got = be.attend(kv, 0, q, k, v, seqs, pos, 0.2, tables=tables)
    assert [n for n, _ in mod.launches] == ["attn_scores_f16", "attn_softmax_v_f16"]
    kc, vc = ArrayBackend.contiguous_kv(be, kv, 0, tables)
    want = ck.emulate_attention(q, kc, vc, seqs, pos, 0.2)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
