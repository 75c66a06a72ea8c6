"""The CPU gated activations (backends/cpu/activation_kernels.py): close to float64, and each
element's bits independent of which columns a call covers (vector body or scalar tail)."""

from __future__ import annotations

import numpy as np
import pytest

from panechat.backends.cpu.activation_kernels import gated, gated_columns


def _inputs():
    rng = np.random.default_rng(0)
    g = np.concatenate([rng.standard_normal(4000) * s for s in (0.01, 1, 5, 30)]).astype(np.float32)
    g = np.concatenate([g, np.array([0, -0.0, 80, -80, 1e-30, -1e-30], np.float32)])
    u = rng.standard_normal(g.size).astype(np.float32)
    return g.reshape(2, -1), u.reshape(2, -1)


def test_silu_within_a_few_ulp_of_float64():
    g, u = _inputs()
    got = gated(g, u, False).astype(np.float64)
    gd = g.astype(np.float64)
    want = gd / (1 + np.exp(-gd)) * u
    # below g = -88 the exp is held at e^88: silu's size there is under 1e-35 either way
    assert np.all(np.abs(got - want) <= 4e-7 * np.abs(want) + 1e-35 * np.abs(u))


def test_gelu_close_to_float64():
    g, u = _inputs()
    got = gated(g, u, True).astype(np.float64)
    gd = g.astype(np.float64)
    want = 0.5 * gd * (1 + np.tanh(0.7978845608028654 * (gd + 0.044715 * gd ** 3))) * u
    assert np.all(np.abs(got - want) <= 1e-6 * np.abs(u) * np.maximum(1, np.abs(gd)) + 4e-7 * np.abs(want))


@pytest.mark.parametrize("gelu", [False, True])
def test_bits_do_not_depend_on_the_columns_a_call_covers(gelu):
    g, u = _inputs()
    whole = gated(g, u, gelu)
    parts = np.empty_like(g)
    N = g.shape[1]
    cuts = [0, 1, 18, 35, 1000, 1003, N]
    for c0, c1 in zip(cuts, cuts[1:]):
        gated_columns(g, u, parts, c0, c1, gelu)
    assert np.array_equal(whole.view(np.uint32), parts.view(np.uint32))
