"""IQ4_NL (32-weight blocks) and IQ4_XS (256-weight super-blocks) read as stored on the CPU
(backends/cpu/quant_kernels.py): the loaders give gguf's float32 weights bit for bit, any f16
d included (subnormal, signed zero, infinite, NaN), with and without the lookup tables,
and decode every code and scale. The checks every registered type gets (kernels == linear
at every row count, kept in blocks, one call == op by op) are test_registry_types.py's."""

import numpy as np
import pytest

from panechat.backends.cpu import quant_kernels as qk
from panechat.backends.cpu.block_lut import HAS_LUT
from panechat.backends.quant import registry

from .raw_types import assert_loader_is_gguf_any_scale, gguf_weights
from .test_block_lut import _weights
from .test_numpy_kernels import _read_only

IQ4 = ("IQ4_NL", "IQ4_XS")
LOADERS = {"IQ4_NL": (qk._arith_iq4_nl, qk._lut_iq4_nl), "IQ4_XS": (qk._arith_iq4_xs, qk._lut_iq4_xs)}


def test_kvalues_are_ggufs():
    from gguf import quants

    assert qk.KVALUES == tuple(quants.IQ4_NL.kvalues)


@pytest.mark.parametrize("qtype", IQ4)
@pytest.mark.parametrize("table", [False, True])
def test_loader_weights_are_gguf_dequantize_any_scale(qtype, table):
    """Adversarial f16 d (subnormals, +-0, largest, +-inf, NaN) or random bits, random codes
    and IQ4_XS sub-block scales: gguf's floats, bit for bit."""
    if table and not HAS_LUT:
        pytest.skip("the table loaders need AVX-512 permutes")
    assert_loader_is_gguf_any_scale(LOADERS[qtype][table], qtype, 40, 0, registry.get(qtype).block_bytes)


@pytest.mark.parametrize("qtype", IQ4)
def test_loader_decodes_every_code_and_scale(qtype):
    """Each code 0..15 in each nibble and (IQ4_XS) each 6-bit sub-block scale 0..63 in each
    of the 8 sub-blocks, with d = 1: the weight kvalues[q] * (ls - 32), as gguf."""
    N, per, size = 64, *{"IQ4_NL": (32, 18), "IQ4_XS": (256, 136)}[qtype]
    K = 256
    b = np.zeros((N, K // per, size), np.uint8)
    b[..., 0:2] = np.array([1.0], np.float16).view(np.uint8)
    codes = (np.arange(N)[:, None, None] + np.arange(size - (2 if qtype == "IQ4_NL" else 8))) % 16
    b[..., size - codes.shape[-1]:] = (codes | ((15 - codes) << 4)).astype(np.uint8)
    if qtype == "IQ4_XS":
        ls = (np.arange(N)[:, None] + 7 * np.arange(8)) % 64  # [N, 8]
        b[:, 0, 4:8] = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
        h = sum((ls[:, j] >> 4).astype(np.uint16) << (2 * j) for j in range(8)).astype("<u2")
        b[:, 0, 2:4] = h[:, None].view(np.uint8)
    blocks = _read_only(b.reshape(N, -1))
    want = gguf_weights(blocks, qtype, N, K)
    assert len(np.unique(want)) > 16 if qtype == "IQ4_XS" else set(np.unique(want)) == set(qk.KVALUES)
    for table in ([False, True] if HAS_LUT else [False]):
        assert np.array_equal(_weights(LOADERS[qtype][table], blocks, qtype, K).view(np.uint32),
                              want.view(np.uint32)), (qtype, table)
