"""The RMS norm formed inside the products' launches (CupyBackend.norm_linear_many, the
linear kernels' norm=1 mode), emulated: bit for bit the separate rms_norm kernel then the
products, for every weight kind, the vector and the any-K kernels, at 1..33 rows; and
one launch per product, no rms_norm launch, up to FUSED_NORM_MAX_ROWS rows."""

from __future__ import annotations

import numpy as np
import pytest

from panechat.backends.cuda.cupy_backend import FUSED_NORM_MAX_ROWS, CupyBackend
from panechat.backends.cuda.widen import random_blocks
from panechat.backends.quant.gguf_tensor import GGUFTensor


def _weight(be, rng, qtype: str, n: int, k: int):
    if qtype.endswith("_K"):
        return be.linear_weight(GGUFTensor("w", (n, k), qtype, random_blocks(rng, qtype, n, k)))
    return be.linear_weight(GGUFTensor.from_array(rng.standard_normal((n, k), dtype=np.float32), qtype))


@pytest.mark.parametrize("qtypes,K", [(("F32", "F16", "BF16"), 96), (("Q8_0", "Q4_0", "Q4_1"), 288),
                                      (("Q6_K",), 256), (("F32", "F16"), 44)])
def test_norm_inside_the_products_is_the_separate_ops(qtypes, K):
    be = CupyBackend.emulated_on_cpu()
    rng = np.random.default_rng(K)
    ws = tuple(_weight(be, rng, q, 24 + 7 * i, K) for i, q in enumerate(qtypes))
    nw = rng.standard_normal(K, dtype=np.float32)
    xs = rng.standard_normal((33, K), dtype=np.float32) * 3
    mod = be.kernels.module
    for M in (1, 2, 3, 5, 8, 9, 16, 17, 33):
        x = np.ascontiguousarray(xs[rng.permutation(33)[:M]])
        mod.launches.clear()
        got = be.norm_linear_many(x, nw, 1e-6, ws)
        names = [n for n, _ in mod.launches]
        if M <= FUSED_NORM_MAX_ROWS:  # fused: one launch per product
            assert "rms_norm" not in names and len(names) == len(ws)
        else:  # the norm once, then the products
            assert names[0] == "rms_norm" and len(names) == len(ws) + 1
        want = be.linear_many(be.rms_norm(x, nw, 1e-6), ws)
        for g, w in zip(got, want):
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), M
        # with biases (qwen2's q/k/v): the bias added once after the sum, in the same launch
        biases = tuple(None if i == 1 else rng.standard_normal(w.n, dtype=np.float32) for i, w in enumerate(ws))
        mod.launches.clear()
        got = be.norm_linear_many(x, nw, 1e-6, ws, biases)
        assert ("rms_norm" in [n for n, _ in mod.launches]) == (M > FUSED_NORM_MAX_ROWS)
        h = be.rms_norm(x, nw, 1e-6)
        want = [be.linear(h, w) if b is None else be.linear_add(h, w, b) for w, b in zip(ws, biases)]
        for g, w in zip(got, want):
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), M
