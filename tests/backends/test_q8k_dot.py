"""The Q8_K contract (backends/cpu/q8k_dot.py): activations rounded as llama.cpp's
quantize_row_q8_K_ref, by the compiled rounding every K-quant product takes and by its
numpy reference; that reference being gguf's product when the activations are exact int8
values; the integer-product form following the compile target.

The kernels that keep the contract give the reference's bits in every form
(test_repacked.py: `packed256`'s record tiles and `q8k_panel`'s panels; test_amx_tiles.py),
and through the backend with every other type's (test_registry_types.py, test_block_linear.py)."""

import numpy as np
import pytest
from numba import njit

from panechat.backends.cpu import q8k_dot as q
from panechat.backends.cpu import quant_kernels as qk
from panechat.backends.cpu.generated import packed_activations
from panechat.backends.quant import registry

from .test_numpy_kernels import raw_blocks


def test_the_shipped_kquants_round_activations():
    """Q4_K, Q5_K and Q6_K by `packed256` over their repacked records, on Q8_K rows and this
    module's contract (test_repacked)."""
    packed = [t.name for t in registry.block_types() if t.cpu_packed and packed_activations(t) == "q8k"]
    assert packed == ["Q4_K", "Q5_K", "Q6_K"]


@njit(cache=False)
def _quantized_rows(x):
    """The compiled rounding, as the products call it (inlined)."""
    return q.quantized_rows(x)


def test_quantized_rows_are_the_reference_rounding():
    """Every row's codes, block scales and sums of 16, compiled and in numpy, bit for bit;
    an all-zero block has scale 0 and codes 0."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 768), dtype=np.float32) * np.float32(3.0)
    x[0, 256:512] = 0
    x[1] *= np.float32(1e-30)  # small and large magnitudes
    x[2] *= np.float32(1e30)
    xq, xd, xs = _quantized_rows(x)
    rq, rd, rs = q.reference_q8k(x)
    assert np.array_equal(xq, rq) and np.array_equal(xd, rd) and np.array_equal(xs, rs)
    assert xq.dtype == np.int8 and xd.dtype == np.float32 and xs.dtype == np.int16
    assert xd[0, 1] == 0 and not xq[0, 256:512].any() and not xs[0, 16:32].any()
    assert np.abs(xq).max() == 127


@pytest.mark.parametrize("rounding", [q.reference_q8k, _quantized_rows], ids=["numpy", "compiled"])
def test_rounding_follows_llama_cpp(rounding):
    """quantize_row_q8_K_ref: the first value of largest magnitude sets iscale = -127 / it,
    codes round half to even and are capped at 127, d = 1 / iscale."""
    x = np.zeros((1, 256), np.float32)
    x[0, :4] = [2.0, -2.0, 1.0, 0.0]  # 2 comes first: iscale -63.5
    xq, xd, xs = rounding(x)
    assert xq[0, :4].tolist() == [-127, 127, -64, 0]  # -63.5 rounds to -64 (half to even)
    assert xd[0, 0] == np.float32(1) / np.float32(-127.0 / 2.0)
    assert xs[0, 0] == -64 and xs.dtype == np.int16


@pytest.mark.parametrize("rounding", [q.reference_q8k, _quantized_rows], ids=["numpy", "compiled"])
def test_the_first_value_of_largest_magnitude_is_found_in_order(rounding):
    """The compiled rounding takes the largest magnitude 16 values a vector, then looks for
    its first value in order: a tie of opposite signs in later vectors, the negative one
    first, sets iscale's sign; so does a tie inside one vector, its later lane positive."""
    x = np.zeros((2, 512), np.float32)
    x[0, 200], x[0, 230], x[0, 20] = -3.0, 3.0, 1.0
    x[1, 256 + 37], x[1, 256 + 33], x[1, 256 + 40] = 4.0, -4.0, -2.0  # lane 1 (-4) before lane 5 (4)
    xq, xd, xs = rounding(x)
    assert xq[0, 200] == -127 and xq[0, 230] == 127 and xq[0, 20] == 42  # iscale -127 / -3 > 0
    assert xq[1, 256 + 33] == -127 and xq[1, 256 + 37] == 127 and xq[1, 256 + 40] == -64  # 31.75: -63.5 to even
    assert xd[0, 0] == np.float32(1) / (np.float32(-127.0) / np.float32(-3.0)) and xd[0, 1] == 0
    assert xd[1, 1] == np.float32(1) / (np.float32(-127.0) / np.float32(-4.0))


@pytest.mark.parametrize("qtype", list(q.REFERENCES))
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


def test_the_form_follows_the_target_features():
    assert q.target_form("+avx2,+avx512f,+avx512bw,+avx512vnni") == "vnni"
    assert q.target_form("+avx2,+avx512f,+avx512bw,-avx512vnni") == "avx512"
    assert q.target_form("+avx2,-avx512f,-avx512bw") == "avx2"
    assert q.target_form("+neon,+dotprod") == "generic"
