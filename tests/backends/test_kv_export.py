"""`kv_export` / `kv_import` (the bytes a KV snapshot holds) round-trip bit for bit on every
backend this machine runs: numpy, the CuPy backend with its kernels emulated, MLX; through
block lists in any order (paged KV), in float32 and the default float16."""

from __future__ import annotations

import numpy as np
import pytest

from panechat.backends.cuda.cupy_backend import CupyBackend
from panechat.backends.cpu.numpy_backend import NumpyBackend, StackedGemvBackend


def _backends():
    yield pytest.param(NumpyBackend, id="numpy")
    yield pytest.param(StackedGemvBackend, id="numpy-gemv")
    yield pytest.param(CupyBackend.emulated_on_cpu, id="cupy-emulated")
    yield pytest.param("mlx", id="mlx")


def _make(factory):
    if factory == "mlx":
        pytest.importorskip("mlx.core", reason="the MLX backend needs mlx")
        from panechat.backends.mlx.mlx_backend import MLXBackend

        return MLXBackend()
    return factory()


# two sequences' block tables (16 positions a block): shuffled, not in store order
SEQ_BLOCKS = {1: [5, 0, 3], 2: [7, 2, 6]}


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("factory", list(_backends()))
def test_kv_export_import_round_trip_is_bit_exact(factory, dtype):
    be = _make(factory)
    n_blocks, n_layer, n_kv, hd, n = 9, 2, 2, 8, 29
    kv = be.new_paged_kv(n_blocks, n_layer, n_kv, hd, dtype)
    width = max(len(b) for b in SEQ_BLOCKS.values())
    tables = np.zeros((3, width), np.int32)
    for seq, blocks in SEQ_BLOCKS.items():
        tables[seq, :len(blocks)] = blocks
    stored = np.float32 if dtype == "f32" else np.float16
    rng = np.random.default_rng(5)
    # write rows through the backend's own write path, with values whose low bits matter
    # (subnormals, negative zero, NaN payload-free extremes)
    for layer in range(n_layer):
        k = rng.standard_normal((n, n_kv, hd)).astype(np.float32) * np.float32(1e-3)
        v = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
        k[0, 0, :3] = [np.float32(1e-42), np.float32(-0.0), np.finfo(np.float32).max]
        be.write_kv(kv, layer, be.asarray(k), be.asarray(v), be.asarray(np.full(n, 1, np.int32)),
                    be.asarray(np.arange(n, dtype=np.int32)), be.asarray(tables))
        if layer == 0:
            first_k = k
    out = be.kv_export(kv, SEQ_BLOCKS[1], n)
    assert len(out) == n_layer
    for k, v in out:
        assert isinstance(k, np.ndarray) and k.dtype == stored and k.shape == (n_kv, n, hd)
        assert isinstance(v, np.ndarray) and v.dtype == stored and v.shape == (n_kv, n, hd)
    assert out[0][0][0, 0, 1].tobytes() == stored(-0.0).tobytes()
    # the export is the stored values, in position order: each written value rounded once
    assert out[0][0].tobytes() == np.ascontiguousarray(first_k.transpose(1, 0, 2)).astype(stored).tobytes()
    be.kv_import(kv, SEQ_BLOCKS[2], out)  # into another sequence's blocks
    back = be.kv_export(kv, SEQ_BLOCKS[2], n)
    for (k0, v0), (k1, v1) in zip(out, back):
        assert k0.tobytes() == k1.tobytes() and v0.tobytes() == v1.tobytes()
    # the export is a copy: later writes to the cache do not change it
    before = out[0][0].copy()
    be.kv_import(kv, SEQ_BLOCKS[1], [(np.zeros_like(k), np.zeros_like(v)) for k, v in out])
    assert out[0][0].tobytes() == before.tobytes()
    # a prefix import leaves the rest of the sequence's blocks alone
    be.kv_import(kv, SEQ_BLOCKS[2], [(np.zeros_like(k[:, :5]), np.zeros_like(v[:, :5])) for k, v in out])
    again = be.kv_export(kv, SEQ_BLOCKS[2], n)
    assert not again[0][0][:, :5].any() and again[0][0][:, 5:].tobytes() == out[0][0][:, 5:].tobytes()
    # an import from a block boundary (past blocks shared with other sequences) writes only
    # the blocks it is given
    be.kv_import(kv, SEQ_BLOCKS[2][1:], [(k[:, 16:], v[:, 16:]) for k, v in out])
    again = be.kv_export(kv, SEQ_BLOCKS[2], n)
    assert not again[0][0][:, :5].any() and again[0][0][:, 16:].tobytes() == out[0][0][:, 16:].tobytes()
    # blocks of neither sequence were never written
    untouched = [b for b in range(n_blocks) if all(b not in s for s in SEQ_BLOCKS.values())]
    assert not be.kv_export(kv, untouched, 16 * len(untouched))[0][0].any()


def test_kv_import_refuses_another_layer_count():
    be = NumpyBackend()
    kv = be.new_paged_kv(2, 2, 1, 4)
    with pytest.raises(ValueError, match="layers"):
        be.kv_import(kv, [1], be.kv_export(kv, [0], 3)[:1])
