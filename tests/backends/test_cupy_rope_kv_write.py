"""RoPE + KV write in one launch (the rope_kv_write_f16 / _f32 kernels, emulated): q turned
by the rope kernel's arithmetic, k turned and v stored straight into their paged KV blocks
-- bit for bit what the former path computed (two `rope` launches, then the CuPy scatter
of `ArrayBackend.write_kv`, then attention): the attention output AND the stored K and V,
at 1..33 rows, shuffled block tables, neox and normal pairing, partial rotary dims,
float16 and float32 stores, a sliding window (gemma3)."""

from __future__ import annotations

import numpy as np
import pytest

from panechat.backends.array_backend import ArrayBackend
from panechat.backends.base import Backend
from panechat.backends.cuda.cupy_backend import CupyBackend
from panechat.backends.paged_kv import BLOCK_TOKENS

from .decode_rows import decode_rows

STYLES = [("neox", 64), ("normal", 64), ("neox", 32), ("normal", 48)]


def _stores(be, rng, dtype: str, S: int, nb: int, G: int, D: int):
    """Two identical paged stores (random contents) and a shuffled block table [S, nb]."""
    kvs = [be.new_paged_kv(S * nb, 1, G, D, dtype) for _ in range(2)]
    for name in ("k", "v"):
        init = rng.standard_normal(getattr(kvs[0], name)[0].shape, dtype=np.float32) * 2
        for kv in kvs:
            getattr(kv, name)[0][...] = init
    tables = rng.permutation(S * nb).astype(np.int32).reshape(S, nb)
    return kvs, tables


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype == np.float16 else np.uint32)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 70000 -> inf, wanted
@pytest.mark.parametrize("style,rope_dim", STYLES)
@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_rope_kv_write_is_rope_rope_and_the_scatter(style, rope_dim, dtype):
    """The kernel alone, one launch, against the rope kernel twice and write_kv's scatter:
    q's result and both whole stores, bit for bit, at every row count 1..33."""
    be = CupyBackend.emulated_on_cpu()
    rng = np.random.default_rng(rope_dim + (dtype == "f16"))
    G, H, D, S, nb = 2, 6, 64, 40, 4
    (kv_a, kv_b), tables = _stores(be, rng, dtype, S, nb, G, D)
    tabs = be.rope_tables(rope_dim, 10000.0, nb * BLOCK_TOKENS)
    mod = be.kernels.module
    for R in range(1, 34):
        q = rng.standard_normal((R, H, D), dtype=np.float32) * 3
        k = rng.standard_normal((R, G, D), dtype=np.float32) * 3
        v = rng.standard_normal((R, G, D), dtype=np.float32) * 3
        if R == 7:  # values that round to float16's extremes: overflow, subnormals, ties
            k[0, 0, :4] = [70000.0, -65520.0, 3e-8, 1e-6]
            v[0, 0, :4] = [65519.0, 2.0 ** -25, 1.0 + 2.0 ** -11, -1e-7]
        seqs = rng.choice(S, R, replace=False).astype(np.int32)
        poss = rng.integers(0, nb * BLOCK_TOKENS, R).astype(np.int32)
        before = (q.copy(), k.copy(), v.copy())
        want_q = be.rope(q, poss, style, tabs)
        ArrayBackend.write_kv(be, kv_a, 0, be.rope(k, poss, style, tabs), v, seqs, poss, tables)
        mod.launches.clear()
        got_q = be.kernels.rope_kv_write(q, k, v, np.empty_like(q), kv_b.k[0], kv_b.v[0], tabs[0], tabs[1], tables,
                                         seqs, poss, style == "neox")
        assert [n for n, _ in mod.launches] == [f"rope_kv_write_{dtype}"]
        assert np.array_equal(_bits(got_q), _bits(want_q)), R
        assert np.array_equal(_bits(kv_a.k[0]), _bits(kv_b.k[0])), R
        assert np.array_equal(_bits(kv_a.v[0]), _bits(kv_b.v[0])), R
        assert all(np.array_equal(a, b) for a, b in zip((q, k, v), before))


@pytest.mark.parametrize("style,rope_dim,dtype,window", [("neox", 64, "f16", 0), ("normal", 48, "f32", 0),
                                                         ("neox", 32, "f16", 21), ("normal", 64, "f32", 21)])
def test_rope_attend_is_rope_rope_attend_at_every_row_count(style, rope_dim, dtype, window):
    """CupyBackend.rope_attend (rope_kv_write + the two attention launches, no rope launch,
    no scatter) == Backend.rope_attend (rope, rope, attend with the scatter) bit for bit:
    the output and the whole stores, rows 1..33, shuffled tables, GQA, with and without
    gemma3's sliding window."""
    be = CupyBackend.emulated_on_cpu()
    rng = np.random.default_rng(rope_dim + window)
    G, H, D, S, nb = 2, 4, 64, 40, 3
    (kv_a, kv_b), tables = _stores(be, rng, dtype, S, nb, G, D)
    tabs = be.rope_tables(rope_dim, 10000.0, nb * BLOCK_TOKENS)
    mod = be.kernels.module
    for R in range(1, 34):
        q, k, v, seqs, poss = decode_rows(rng, R, H, G, D, S, nb)
        poss[0] = nb * BLOCK_TOKENS - 1  # the longest key range
        want = Backend.rope_attend(be, kv_a, 0, q, k, v, seqs, poss, D ** -0.5, window, tables, style, tabs)
        mod.launches.clear()
        got = be.rope_attend(kv_b, 0, q, k, v, seqs, poss, D ** -0.5, window, tables, style, tabs)
        assert [n for n, _ in mod.launches] == [f"rope_kv_write_{dtype}", f"attn_scores_{dtype}",
                                                f"attn_softmax_v_{dtype}"]
        assert np.array_equal(_bits(got), _bits(want)), R
        assert np.array_equal(_bits(kv_a.k[0]), _bits(kv_b.k[0])), R
        assert np.array_equal(_bits(kv_a.v[0]), _bits(kv_b.v[0])), R


def test_rope_attend_on_a_slotted_store_and_a_prefill_chunk():
    """Without tables (a slotted store's slot_table) and with several rows of one sequence
    (a prefill chunk): the same bits as the unfused path."""
    be = CupyBackend.emulated_on_cpu()
    rng = np.random.default_rng(3)
    G, H, D = 1, 3, 32
    kvs = [be.new_kv(3, 1, G, 64, D, "f16") for _ in range(2)]
    tabs = be.rope_tables(D, 10000.0, 64)
    q = rng.standard_normal((9, H, D), dtype=np.float32)
    k = rng.standard_normal((9, G, D), dtype=np.float32)
    v = rng.standard_normal((9, G, D), dtype=np.float32)
    seqs, poss = np.full(9, 1, np.int32), np.arange(10, 19, dtype=np.int32)
    want = Backend.rope_attend(be, kvs[0], 0, q, k, v, seqs, poss, 0.2, 0, None, "neox", tabs)
    got = be.rope_attend(kvs[1], 0, q, k, v, seqs, poss, 0.2, 0, None, "neox", tabs)
    assert np.array_equal(_bits(got), _bits(want))
    assert np.array_equal(_bits(kvs[0].k[0]), _bits(kvs[1].k[0]))
    assert np.array_equal(_bits(kvs[0].v[0]), _bits(kvs[1].v[0]))
