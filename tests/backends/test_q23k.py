"""Q2_K and Q3_K (256-weight super-blocks, f16 d (and Q2_K's dmin) at the block's end) read
as stored on the CPU (backends/cpu/quant_kernels.py): the loaders give gguf's float32 weights
bit for bit, any f16 d and dmin included (subnormal, signed zero, infinite, NaN), and
decode every code, hmask bit and sub-block scale as ggml's C loops do. The checks every
registered type gets (kernels == linear at every row count, kept in blocks, one call == op
by op) are test_registry_types.py's."""

import numpy as np
import pytest

from panechat.backends.cpu import quant_kernels as qk
from panechat.backends.quant import registry

from .raw_types import assert_loader_is_gguf_any_scale, gguf_weights
from .test_block_lut import _weights
from .test_numpy_kernels import _F16_AT, _read_only

Q23 = ("Q2_K", "Q3_K")
LOADERS = {"Q2_K": qk._pair_q2_k, "Q3_K": qk._pair_q3_k}


def _ggml_loop(block, qtype):
    """One super-block's 256 weights as ggml-quants.c dequantize_row_q2_K / _q3_K walk it
    (halves of 128, four shifts, two groups of 16 each), in float64: exact for the small
    integer codes and scales with d = dmin = 1 used here."""
    d, dmin = (float(block[o:o + 2].copy().view(np.float16)[0]) for o in (_F16_AT[qtype] * 2)[:2])
    if qtype == "Q3_K":
        aux = block[96:108].copy().view("<u4").astype(np.int64)
        tmp = aux[2]
        aux = [(aux[0] & 0x0F0F0F0F) | ((tmp & 0x03030303) << 4), (aux[1] & 0x0F0F0F0F) | (((tmp >> 2) & 0x03030303) << 4),
               ((aux[0] >> 4) & 0x0F0F0F0F) | (((tmp >> 4) & 0x03030303) << 4),
               ((aux[1] >> 4) & 0x0F0F0F0F) | (((tmp >> 6) & 0x03030303) << 4)]
        scales = np.array(aux, "<u4").view(np.int8).astype(np.int64)
    y, g, mask = [], 0, 1
    qs = 16 if qtype == "Q2_K" else 32
    for half in range(2):
        q = block[qs + 32 * half: qs + 32 * half + 32].astype(np.int64)
        for shift in (0, 2, 4, 6):
            for part in (slice(0, 16), slice(16, 32)):
                codes = (q[part] >> shift) & 3
                if qtype == "Q2_K":
                    sc = int(block[g])
                    y += list(d * (sc & 15) * codes - dmin * (sc >> 4))
                else:
                    hm = block[0:32][part].astype(np.int64)
                    y += list(d * (scales[g] - 32) * (codes - np.where(hm & mask, 0, 4)))
                g += 1
            mask <<= 1
    return np.array(y)


@pytest.mark.parametrize("qtype", Q23)
def test_loader_weights_are_gguf_dequantize_any_scale(qtype):
    """Every f16 d (and dmin) from the adversarial list (subnormals, +-0, largest, +-inf,
    NaN) or random bits, random codes and sub-block scales: gguf's floats, bit for bit (a
    NaN matches any NaN: `_same_bits`)."""
    assert_loader_is_gguf_any_scale(LOADERS[qtype], qtype, 50, _F16_AT[qtype][0], registry.get(qtype).block_bytes)


@pytest.mark.parametrize("qtype", Q23)
def test_loader_decodes_every_code_and_scale(qtype):
    """d = dmin = 1, every scale byte (Q2_K: 0..255, each (scale, min) pair) or 6-bit scale
    (Q3_K: 0..63) in each of the 16 groups, and bytes of codes and hmask covering every
    value at every shift: the weights of ggml's C loop, which gguf and the loader give."""
    N, K, size = 256, 512, registry.get(qtype).block_bytes
    rng = np.random.default_rng(51)
    b = rng.integers(0, 256, (N, K // 256, size), dtype=np.uint8)
    row = np.arange(N)[:, None, None]
    g = np.arange(16) + 16 * np.arange(K // 256)[:, None]  # [blocks, 16]
    ones = np.array([1.0, 1.0], np.float16).view(np.uint8)
    if qtype == "Q2_K":
        b[..., 0:16] = (row + g * 37) % 256
        b[..., 16:80] = (row + np.arange(64)) % 256
        b[..., 80:84] = ones
    else:
        sc = (row + 5 * g) % 64  # [N, blocks, 16]
        b[..., 96:104] = (sc[..., 0:8] & 15) | ((sc[..., 8:16] & 15) << 4)
        b[..., 104:108] = sum(((sc[..., 4 * j:4 * j + 4] >> 4) << (2 * j)) for j in range(4))
        b[..., 0:96] = (row + 3 * np.arange(96)) % 256
        b[..., 108:110] = ones[:2]
    blocks = _read_only(b.reshape(N, -1))
    loop = np.array([[_ggml_loop(blk, qtype) for blk in r] for r in b]).reshape(N, K)
    want = gguf_weights(blocks, qtype, N, K)
    assert np.array_equal(want, loop.astype(np.float32))  # gguf reads the layout as ggml's C does
    levels = ({s * q - m for s in range(16) for q in range(4) for m in range(16)} if qtype == "Q2_K"
              else {(s - 32) * q for s in range(64) for q in range(-4, 4)})
    assert set(np.unique(want)) == levels  # every weight level occurs
    assert np.array_equal(_weights(LOADERS[qtype], blocks, qtype, K).view(np.uint32), want.view(np.uint32))
