"""Paged KV on every backend: `attend` through a shuffled block table gives the same bits
as through the identity table of whole-context slots, for 1..33 rows (numpy's numba
kernel, the CuPy backend with its kernels emulated in numpy, MLX where it imports), and
the KV dtype is what is stored."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from panechat.backends.cuda.cupy_backend import CupyBackend
from panechat.backends.cpu.numpy_backend import NumpyBackend, StackedGemvBackend
from panechat.backends.paged_kv import BLOCK_TOKENS


def _backends():
    out = [pytest.param(NumpyBackend, id="numpy"), pytest.param(StackedGemvBackend, id="gemv"),
           pytest.param(CupyBackend.emulated_on_cpu, id="cupy-emulated")]
    if importlib.util.find_spec("mlx") is not None:
        from panechat.backends.mlx.mlx_backend import MLXBackend

        out.append(pytest.param(MLXBackend, id="mlx"))
    return out


@pytest.mark.parametrize("dtype", ["f16", "f32"])
@pytest.mark.parametrize("make", _backends())
def test_attend_through_shuffled_block_tables_equals_slots(make, dtype):
    be = make()
    rng = np.random.default_rng(5)
    S, G, H, D, C = 3, 2, 6, 64, 80  # 5 blocks per sequence
    per = C // BLOCK_TOKENS
    slotted = be.new_kv(S, 1, G, C, D, dtype)
    paged = be.new_paged_kv(S * per + 4, 1, G, D, dtype)
    tables = rng.permutation(S * per + 4)[: S * per].reshape(S, per).astype(np.int32)
    for s in range(S):  # the same keys and values in both stores
        k = rng.standard_normal((C, G, D), dtype=np.float32)
        v = rng.standard_normal((C, G, D), dtype=np.float32)
        seq, pos = np.full(C, s, np.int32), np.arange(C, dtype=np.int32)
        be.write_kv(slotted, 0, be.asarray(k), be.asarray(v), be.asarray(seq), be.asarray(pos))
        be.write_kv(paged, 0, be.asarray(k), be.asarray(v), be.asarray(seq), be.asarray(pos), be.asarray(tables))
    want_dtype = np.float16 if dtype == "f16" else np.float32
    assert be.to_numpy(paged.k[0]).dtype == want_dtype
    for R in range(1, 34, 4 if make is StackedGemvBackend else 1):
        q = rng.standard_normal((R, H, D), dtype=np.float32)
        k = rng.standard_normal((R, G, D), dtype=np.float32)
        v = rng.standard_normal((R, G, D), dtype=np.float32)
        pairs = rng.choice(S * C, R, replace=False)  # distinct (sequence, position) per row
        seqs, poss = (pairs // C).astype(np.int32), (pairs % C).astype(np.int32)
        args = [be.asarray(x) for x in (q, k, v, seqs, poss)]
        a = be.to_numpy(be.attend(slotted, 0, *args, D ** -0.5))
        b = be.to_numpy(be.attend(paged, 0, *args, D ** -0.5, 0, be.asarray(tables)))
        assert np.array_equal(a, b), R


@pytest.mark.parametrize("make", _backends())
def test_copy_blocks_and_export_import(make):
    be = make()
    rng = np.random.default_rng(2)
    kv = be.new_paged_kv(6, 2, 2, 32, "f16")
    for layer in range(2):
        for store in (kv.k[layer], kv.v[layer]):
            store[...] = be.asarray(rng.standard_normal(tuple(store.shape), dtype=np.float32).astype(np.float16))
    be.copy_blocks(kv, [4, 1], [0, 5])
    out = be.kv_export(kv, [0, 5], 20)
    assert np.array_equal(out[1][0][:, :16], be.to_numpy(kv.k[1][4]))  # [n_kv, 16, hd]
    assert np.array_equal(out[0][1][:, 16:], be.to_numpy(kv.v[0][1])[:, :4])
    be.kv_import(kv, [2, 3], out)
    assert all(np.array_equal(a, b) for x, y in zip(out, be.kv_export(kv, [2, 3], 20)) for a, b in zip(x, y))
