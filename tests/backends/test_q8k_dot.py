"""The int8-activation K-quant products (backends/cpu/q8k_dot.py): activations rounded as
llama.cpp's quantize_row_q8_K_ref, the VNNI form and the plain integer form (what a CPU
without AVX-512 VNNI compiles) giving the numpy reference's bits, and that reference
being gguf's product when the activations are exact int8 values.

The products through the backend (rows 1..33, threads, the one-call step) are checked
with every other type's, from the registry (test_registry_types.py, test_block_linear.py)."""

import numpy as np
import pytest
from numba import njit

from panechat.backends.cpu import q8k_dot as q
from panechat.backends.cpu import quant_kernels as qk
from panechat.backends.quant import registry

from .test_numpy_kernels import raw_blocks

Q8K_TYPES = [t.name for t in registry.block_types() if t.cpu_q8k]


def test_the_shipped_kquants_round_activations():
    assert {"Q4_K", "Q6_K"} <= set(Q8K_TYPES)


def _products_source():
    """A test kernel computing x @ W.T for each q8k type by code (0: Q4_K, 1: Q5_K, 2: Q6_K),
    compiled fresh (cache off), so the module's HAS_VNNI at compile time picks the form."""

    def run(x, w, d, dm, out, code):
        xq, xd, xs = q.quantized_rows(x)
        if code == 0:
            q.q4k_columns(w, d, dm, xq, xd, xs, out, 0, out.shape[1])
        elif code == 1:
            q.q5k_columns(w, d, dm, xq, xd, xs, out, 0, out.shape[1])
        else:
            q.q6k_columns(w, d, dm, xq, xd, xs, out, 0, out.shape[1])
        return xq, xd, xs

    return run


CODES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}


@pytest.mark.parametrize("vnni", [True, pytest.param(False, marks=pytest.mark.slow)])  # False: the form
# for CPUs without VNNI, compiled only for this check (~25 s cold): `make test-slow`
def test_both_forms_give_the_reference_bits(vnni, monkeypatch):
    if vnni and not q.HAS_VNNI:
        pytest.skip("this CPU has no AVX-512 VNNI")
    monkeypatch.setattr(q, "HAS_VNNI", vnni)
    run = njit(cache=False)(_products_source())
    rng = np.random.default_rng(5)
    for qtype in CODES:
        for M, N in ((1, 9), (3, 6)):
            K = 512
            x = rng.standard_normal((M, K), dtype=np.float32) * np.float32(3.0)
            x[0, 256:] = 0  # an all-zero block: scale 0, codes 0
            w = raw_blocks(rng, qtype, N, K)
            d, dm = qk.superblock_scales(w, qtype)
            out = np.empty((M, N), np.float32)
            xq, xd, xs = run(x, w, d, dm, out, CODES[qtype])
            rq, rd, rs = q.reference_q8k(x)
            assert np.array_equal(xq, rq) and np.array_equal(xd, rd) and np.array_equal(xs, rs)
            assert xd[0, 1] == 0 and not xq[0, 256:].any()
            assert np.array_equal(out, q.reference(qtype, x, w, d, dm)), (qtype, vnni, M)


@pytest.mark.parametrize("qtype", list(CODES))
def test_reference_is_gguf_on_exact_activations(qtype):
    """Activations that are int8 values with 127 in every block round to themselves (scale
    -1), so the product is gguf's dequantized one up to float32 rounding."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(6)
    N, K = 7, 512
    x = rng.integers(-126, 127, (3, K)).astype(np.float32)
    x[:, 0], x[:, 256] = 127, -127
    w = raw_blocks(rng, qtype, N, K)
    d, dm = qk.superblock_scales(w, qtype)
    want = x.astype(np.float64) @ quants.dequantize(w, GGMLQuantizationType[qtype]).reshape(N, K).T.astype(np.float64)
    got = q.reference(qtype, x, w, d, dm)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_rounding_follows_llama_cpp():
    """quantize_row_q8_K_ref: the first value of largest magnitude sets iscale = -127 / it,
    codes round half to even and are capped at 127, d = 1 / iscale."""
    x = np.zeros((1, 256), np.float32)
    x[0, :4] = [2.0, -2.0, 1.0, 0.0]  # 2 comes first: iscale -63.5
    xq, xd, xs = q.reference_q8k(x)
    assert xq[0, :4].tolist() == [-127, 127, -64, 0]  # -63.5 rounds to -64 (half to even)
    assert xd[0, 0] == np.float32(1) / np.float32(-127.0 / 2.0)
    assert xs[0, 0] == -64 and xs.dtype == np.int16
