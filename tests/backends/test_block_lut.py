"""Lookup-table loaders (backends/cpu/block_lut.py): on AVX-512 the 4- and 5-bit block types
fetch each weight from a per-block table of its 16 (32) values instead of converting and
scaling every code. Both loaders must give the same float32 weights, bit for bit, and
those must be gguf's, for any codes and any f16 scales: subnormal, negative, zero,
huge, infinite and NaN. (Q8_0 has no table: its AVX-512 loader differs only in how it
splats the f16 scale, and is held to the same.)"""

import numpy as np
import pytest
from numba import njit

from panechat.backends.cpu import quant_kernels as qk
from panechat.backends.cpu.block_linear import _dequantize_panel
from panechat.backends.cpu.block_lut import HAS_LUT
from panechat.backends.quant import registry

from .test_numpy_kernels import _F16_AT, raw_blocks

LOADERS = {"Q4_0": (qk._arith_q4_0, qk._lut_q4_0), "Q4_1": (qk._arith_q4_1, qk._lut_q4_1),
           "Q5_0": (qk._arith_q5_0, qk._lut_q5_0), "Q5_1": (qk._arith_q5_1, qk._lut_q5_1),
           "Q4_K": (qk._arith_q4_k, qk._lut_q4_k), "Q5_K": (qk._arith_q5_k, qk._lut_q5_k), "Q8_0": (qk._arith_q8_0, qk._wide_q8_0)}

needs_lut = pytest.mark.skipif(not HAS_LUT, reason="the table loaders need AVX-512 permutes")

# f16 bit patterns: subnormals (smallest, largest), zeros of both signs, negatives,
# the largest finite, infinities and a NaN
ADVERSARIAL_F16 = np.array([0x0001, 0x03FF, 0x8001, 0x83FF, 0x0000, 0x8000, 0x3C00, 0xBC00,
                            0x2E66, 0xAE66, 0x7BFF, 0xFBFF, 0x0400, 0x8400, 0x7C00, 0xFC00,
                            0x7E00], np.uint16)


@njit
def _dequantize(w, wd, wdm, load2, buf):
    _dequantize_panel(w, wd, wdm, 0, buf.shape[0], load2, buf)


def _scales(blocks, qtype):
    if registry.get(qtype).scales_at_load:
        return qk.superblock_scales(blocks, qtype)
    return blocks, blocks  # 32-weight types read their f16 scales from the blocks


def _weights(load2, blocks, qtype, K):
    wd, wdm = _scales(blocks, qtype)
    buf = np.empty((blocks.shape[0], K), np.float32)
    _dequantize(blocks, wd, wdm, load2, buf)
    return buf


def _adversarial(rng, qtype, N, K):
    """Random codes; every f16 scale field drawn from ADVERSARIAL_F16 (and, for one row in
    four, random f16 bits of any kind)."""
    b = raw_blocks(rng, qtype, N, K).copy()  # raw_blocks are read-only, as a model's; written here
    size = registry.get(qtype).block_bytes
    v = b.reshape(N, -1, size)
    for o in _F16_AT[qtype]:
        bits = rng.choice(ADVERSARIAL_F16, v.shape[:2])
        bits[::4] = rng.integers(0, 1 << 16, bits[::4].shape)
        v[..., o:o + 2] = bits.astype("<u2")[..., None].view(np.uint8)
    b.setflags(write=False)  # then read-only again: the kernels' build for a model's blocks
    return b


def _same_bits(a, b):
    """Bit-identical floats, except that any NaN matches any NaN: which operand's NaN an
    x86 add or multiply passes on follows the register order LLVM picks (IEEE 754 leaves
    it open), not the source; the values never differ."""
    return np.array_equal(a.view(np.uint32), b.view(np.uint32)) or (
        np.array_equal(np.isnan(a), np.isnan(b))
        and np.array_equal(a.view(np.uint32)[~np.isnan(a)], b.view(np.uint32)[~np.isnan(b)]))


@needs_lut
@pytest.mark.parametrize("qtype", sorted(LOADERS))
def test_table_weights_equal_arithmetic_weights_bit_for_bit(qtype):
    """Adversarial scales (infinities and NaN included)."""
    rng = np.random.default_rng(12)
    arith, lut = LOADERS[qtype]
    seen = set()
    for N, K in [(9, 256), (33, 512), (64, 1024)]:
        blocks = _adversarial(rng, qtype, N, K)
        a, t = _weights(arith, blocks, qtype, K), _weights(lut, blocks, qtype, K)
        seen |= {"nan"} if np.isnan(a).any() else set()
        seen |= {"inf"} if np.isinf(a).any() else set()
        assert _same_bits(a, t), qtype
    assert seen == {"nan", "inf"}  # the adversarial cases were there


@pytest.mark.parametrize("qtype", sorted(LOADERS))
@pytest.mark.parametrize("table", [False, True])
def test_loader_weights_are_gguf_dequantize(qtype, table):
    """Finite adversarial scales (subnormal, signed zero, negative, largest): both loaders
    give gguf's float32 weights, bit for bit."""
    from gguf import GGMLQuantizationType, quants

    if table and not HAS_LUT:
        pytest.skip("the table loaders need AVX-512 permutes")
    rng = np.random.default_rng(5)
    N, K = 16, 512
    blocks = _adversarial(rng, qtype, N, K).copy()
    size = registry.get(qtype).block_bytes
    v = blocks.reshape(N, -1, size)
    for o in _F16_AT[qtype]:  # finite only: gguf's NaN payloads are numpy's business
        h = v[..., o:o + 2].copy().view("<u2")
        h[(h & 0x7C00) == 0x7C00] = 0x7BFF
        v[..., o:o + 2] = h.view(np.uint8)
    blocks.setflags(write=False)
    want = np.asarray(quants.dequantize(blocks, GGMLQuantizationType[qtype]), np.float32).reshape(N, K)
    got = _weights(LOADERS[qtype][table], blocks, qtype, K)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), qtype


@needs_lut
def test_kernels_use_the_tables_where_the_permutes_exist():
    assert qk._pair_q4_1 is qk._lut_q4_1 and qk._pair_q4_k is qk._lut_q4_k
