"""`norm_kernels.rms_norm` (NumpyBackend.rms_norm) equals `ArrayBackend.rms_norm`'s numpy
expression bit for bit: row lengths across numpy's pairwise-sum cases (under 8, up to
128, split once and several times, lengths not a multiple of 8), 1..33 rows, 3-d inputs
(per-head q/k norms), wide and tiny magnitudes."""

from __future__ import annotations

import numpy as np
import pytest

from panechat.backends.cpu import norm_kernels
from panechat.backends.array_backend import ArrayBackend
from panechat.backends.cpu.numpy_backend import NumpyBackend


def _numpy(x, w, eps):
    return ArrayBackend.rms_norm(NumpyBackend.__new__(NumpyBackend), x, w, eps)


@pytest.mark.parametrize("D", [1, 5, 7, 8, 13, 64, 100, 128, 129, 136, 300, 576, 960, 1536, 2048, 2049, 4096])
def test_rms_norm_equals_the_numpy_expression(D):
    rng = np.random.default_rng(D)
    for R in (1, 2, 3, 16, 33):
        x = rng.standard_normal((R, D), dtype=np.float32) * np.float32(rng.uniform(0.01, 40))
        w = rng.standard_normal(D, dtype=np.float32)
        for eps in (1e-5, 1e-6):
            want = _numpy(x, w, eps)
            got = norm_kernels.rms_norm(x, w, eps)
            assert got.dtype == np.float32 and got.shape == x.shape
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), (D, R, eps)


def test_rms_norm_many_random_rows_and_heads():
    """Many rows, where a rounding difference (e.g. in the mean's division) would show."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4000, 576), dtype=np.float32) * rng.uniform(1e-3, 1e3, (4000, 1)).astype(np.float32)
    w = rng.standard_normal(576, dtype=np.float32)
    assert np.array_equal(norm_kernels.rms_norm(x, w, 1e-5), _numpy(x, w, 1e-5))
    q = rng.standard_normal((7, 9, 64), dtype=np.float32)
    wq = rng.standard_normal(64, dtype=np.float32)
    assert np.array_equal(NumpyBackend().rms_norm(q, wq, 1e-6), _numpy(q, wq, 1e-6))


def test_rms_norm_rows_are_batch_invariant():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((33, 576), dtype=np.float32)
    w = rng.standard_normal(576, dtype=np.float32)
    full = norm_kernels.rms_norm(x, w, 1e-5)
    for R in range(1, 34):
        assert np.array_equal(norm_kernels.rms_norm(x[-R:].copy(), w, 1e-5), full[-R:])


def test_rms_norm_rejects_bad_input():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="rms_norm"):
        norm_kernels.rms_norm(x, np.zeros(7, np.float32), 1e-5)
    with pytest.raises(ValueError, match="rms_norm"):
        norm_kernels.rms_norm(x.astype(np.float64), np.zeros(8, np.float32), 1e-5)
