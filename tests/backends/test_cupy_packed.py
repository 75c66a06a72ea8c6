"""Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K resident in GGUF's block form on the
CuPy backend (backends/cuda/packed.py, the q4, q5 and q80 kernels; Q4_K's and Q5_K's super-blocks as stored,
q4k / q5k; Q6_K's with d split off, q6k), through the numpy emulation: the bytes
are the file's, the weights are gguf's dequantized floats bit for bit, and the block-form
kernels compute exactly what the widened q8 path (int8 codes + float32 scales, the former
form) computes -- at every row count 1..33, with the rows in shuffled order, for every
row tile."""

from __future__ import annotations

import numpy as np
import pytest

from panechat.backends.cuda import kernels as ck
from panechat.backends.cuda.cupy_backend import CupyBackend, CupyWeight, prepare_weight
from panechat.backends.cuda.widen import random_blocks
from panechat.backends.quant.gguf_tensor import GGUFTensor


def _tensor(qtype: str, n: int, k: int, seed: int) -> GGUFTensor:
    rng = np.random.default_rng(seed)
    if qtype.endswith("_K"):  # raw super-blocks: random codes, scales and mins, small f16 d, dmin
        blocks = random_blocks(rng, qtype, n, k)
        if qtype == "Q6_K":
            blocks[0, 192:208] = 128  # scales -128: the most negative int8 scale
            blocks[0, 0:192] = 255  # q = 31 everywhere
        else:
            blocks[0, 4:16] = 255  # the largest 6-bit scales and mins of the first super-block
        return GGUFTensor("w", (n, k), qtype, blocks)
    w = rng.standard_normal((n, k), dtype=np.float32)
    w[0, :32] = 0.0  # an all-zero block (d = 0)
    w[1, 32:64] *= 1e4  # a block with a large scale
    return GGUFTensor.from_array(w, qtype)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_block_form_is_the_files_bytes_and_gguf_weights(qtype):
    n, k = 24, 512
    t = _tensor(qtype, n, k, 1)
    pw = prepare_weight(t)
    if qtype == "Q8_0":
        assert pw.kind == "q80" and pw.w.dtype == np.int8 and pw.w.shape == (n, k)
    elif qtype in ("Q4_K", "Q5_K"):
        assert pw.kind == qtype[:2].lower() + "k" and pw.w.dtype == np.uint8 and pw.scales is None
        assert np.array_equal(pw.w.reshape(-1), np.asarray(t.blocks).reshape(-1))  # as stored
    elif qtype == "Q6_K":
        assert pw.kind == "q6k" and pw.w.dtype == np.uint8 and pw.w.shape == (n, k // 256 * 208)
        stored = np.asarray(t.blocks).reshape(n, k // 256, 210)
        assert np.array_equal(pw.w.reshape(n, -1, 208), stored[..., :208])  # ql, qh, scales as stored
        assert pw.scales.dtype == np.float16 and np.array_equal(pw.scales.view(np.uint8).reshape(n, -1, 2),
                                                                stored[..., 208:210])  # d as stored
    else:
        assert pw.kind == qtype[:2].lower() and pw.w.dtype == np.uint8 and pw.w.shape == (n, k // 2)
    if qtype.startswith("Q5_") and not qtype.endswith("_K"):  # the fifth bits: uint32 as stored
        stored = np.asarray(t.blocks).reshape(n, k // 32, -1)
        o = 4 if qtype == "Q5_1" else 2
        assert pw.qh.dtype == np.uint32 and np.array_equal(pw.qh.astype("<u4").view(np.uint8).reshape(n, -1, 4),
                                                          stored[..., o:o + 4])
        assert np.array_equal(pw.w.reshape(n, -1, 16), stored[..., o + 4:o + 20])  # codes as stored
    if not qtype.endswith("_K"):
        assert pw.scales.dtype == np.float16 and (pw.mins is not None) == qtype.endswith("_1")
    assert pw.nbytes == np.asarray(t.blocks).nbytes  # exactly the file's bytes
    got = ck.dequantize(pw.kind, pw.w, pw.scales, pw.mins, qh=pw.qh)
    want = t.dequantize()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # the widened form (the q8 kernels) holds the same floats
    ww = prepare_weight(t, widened=True)
    assert ww.kind == "q8"
    assert np.array_equal(ck.dequantize("q8", ww.w, ww.scales, ww.mins, ww.group).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype,N,K", [("Q4_0", 40, 288), ("Q4_1", 37, 96), ("Q8_0", 35, 320),
                                     ("Q4_K", 33, 512), ("Q4_0", 8200, 32), ("Q8_0", 8200, 64),
                                     pytest.param("Q4_K", 8200, 256, marks=pytest.mark.slow),
                                     ("Q5_K", 33, 512), ("Q6_K", 35, 768),
                                     pytest.param("Q5_K", 8200, 256, marks=pytest.mark.slow),
                                     pytest.param("Q6_K", 8200, 256, marks=pytest.mark.slow), ("Q5_0", 40, 288), ("Q5_1", 37, 96),
                                     pytest.param("Q5_1", 8200, 64, marks=pytest.mark.slow)])
def test_q4_kernel_equals_widened_path_at_every_row_count(qtype, N, K):
    """linear through the block-form kernels (emulated) == through the q8 kernels on the widened
    codes, bit for bit, for M = 1..33 (every row tile and both column tiles), and a row's
    result is the same alone and at any position of a shuffled batch. The second column
    tile (N 8200) is `slow` but for Q4_0 and Q8_0 (it is 20-40 s of emulation a type):
    those check the tile in every run, `make test-slow` the K-quants'."""
    be = CupyBackend.emulated_on_cpu()
    t = _tensor(qtype, N, K, N + K)
    wq4 = be.linear_weight(t)
    h = prepare_weight(t, widened=True)
    wq8 = CupyWeight(h.kind, h.n, h.k, h.w, h.scales, h.mins, h.group)
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((33, K), dtype=np.float32)
    mod = be.kernels.module
    alone = {}
    rows = range(1, 34) if N < 1000 else (1, 2, 5, 9, 17, 33)
    for M in rows:
        order = rng.permutation(33)[:M]
        x = np.ascontiguousarray(xs[order])
        got = be.linear(x, wq4)
        assert mod.launches[-1][0].startswith(f"linear_{wq4.kind}_")
        want = be.linear(x, wq8)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), M
        for i, r in enumerate(order):
            if r in alone:
                assert np.array_equal(got[i].view(np.uint32), alone[r]), (M, r)
            else:
                alone[r] = got[i].view(np.uint32).copy()


def test_q4_kernel_is_the_contract_on_gguf_weights():
    """The emulated q4 kernel == the literal contract (emulate_linear) on gguf's
    dequantized weights, with a residual added once after the sum."""
    be = CupyBackend.emulated_on_cpu()
    t = _tensor("Q4_1", 33, 544, 4)
    w = be.linear_weight(t)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 544), dtype=np.float32)
    add = rng.standard_normal((3, 33), dtype=np.float32)
    want = ck.emulate_linear(x, t.dequantize())
    assert np.array_equal(be.linear(x, w).view(np.uint32), want.view(np.uint32))
    assert np.array_equal(be.linear_add(x, w, add).view(np.uint32), (want + add).view(np.uint32))
