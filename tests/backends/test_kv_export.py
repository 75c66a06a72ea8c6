"""`kv_export` / `kv_import` (the bytes a KV snapshot holds) round-trip bit for bit on every
backend this machine runs: numpy, the CuPy backend with its kernels emulated, MLX."""

from __future__ import annotations

import numpy as np
import pytest

from panechat.backends.cupy_backend import CupyBackend
from panechat.backends.numpy_backend import NumpyBackend, StackedGemvBackend


def _backends():
    yield pytest.param(NumpyBackend, id="numpy")
    yield pytest.param(StackedGemvBackend, id="numpy-gemv")
    yield pytest.param(CupyBackend.emulated_on_cpu, id="cupy-emulated")
    yield pytest.param("mlx", id="mlx")


def _make(factory):
    if factory == "mlx":
        pytest.importorskip("mlx.core", reason="the MLX backend needs mlx")
        from panechat.backends.mlx_backend import MLXBackend

        return MLXBackend()
    return factory()


@pytest.mark.parametrize("factory", list(_backends()))
def test_kv_export_import_round_trip_is_bit_exact(factory):
    be = _make(factory)
    n_slots, n_layer, n_kv, ctx, hd, n = 3, 2, 2, 40, 8, 29
    kv = be.new_kv(n_slots, n_layer, n_kv, ctx, hd)
    rng = np.random.default_rng(5)
    # write rows through the backend's own write path, with values whose low bits matter
    # (subnormals, negative zero, NaN payload-free extremes)
    for layer in range(n_layer):
        k = rng.standard_normal((n, n_kv, hd)).astype(np.float32) * np.float32(1e-3)
        v = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
        k[0, 0, :3] = [np.float32(1e-42), np.float32(-0.0), np.finfo(np.float32).max]
        be.write_kv(kv, layer, be.asarray(k), be.asarray(v), be.asarray(np.full(n, 1, np.int32)),
                    be.asarray(np.arange(n, dtype=np.int32)))
    out = be.kv_export(kv, 1, n)
    assert len(out) == n_layer
    for k, v in out:
        assert isinstance(k, np.ndarray) and k.dtype == np.float32 and k.shape == (n_kv, n, hd)
        assert isinstance(v, np.ndarray) and v.shape == (n_kv, n, hd)
    assert out[0][0][0, 0, 1].tobytes() == np.float32(-0.0).tobytes()
    be.kv_import(kv, 2, out)  # into another slot
    back = be.kv_export(kv, 2, n)
    for (k0, v0), (k1, v1) in zip(out, back):
        assert k0.tobytes() == k1.tobytes() and v0.tobytes() == v1.tobytes()
    # the export is a copy: later writes to the cache do not change it
    before = out[0][0].copy()
    be.kv_import(kv, 1, [(np.zeros_like(k), np.zeros_like(v)) for k, v in out])
    assert out[0][0].tobytes() == before.tobytes()
    # a prefix import leaves the rest of the slot alone
    be.kv_import(kv, 2, [(np.zeros_like(k[:, :5]), np.zeros_like(v[:, :5])) for k, v in out])
    again = be.kv_export(kv, 2, n)
    assert not again[0][0][:, :5].any() and again[0][0][:, 5:].tobytes() == out[0][0][:, 5:].tobytes()


def test_kv_import_refuses_another_layer_count():
    be = NumpyBackend()
    kv = be.new_kv(1, 2, 1, 8, 4)
    with pytest.raises(ValueError, match="layers"):
        be.kv_import(kv, 0, be.kv_export(kv, 0, 3)[:1])
