"""Block-resident weights and fused products (backends/cpu/block_linear.py, quant_kernels.py):
one call for several weights gives each product's bits, and the model's forward pass on
stored blocks, fused, equals the unfused forward on float32 weights bit for bit."""

import numpy as np
import pytest

from panechat.backends.cpu import numpy_kernels as nk
from panechat.backends.quant.gguf_tensor import GGUFTensor
from panechat.backends.cpu.numpy_backend import NumpyBackend
from panechat.backends.quant import registry
from panechat.engine.gguf.file import GGUFFile
from panechat.engine.model.forward import Batch, Model

from ..tiny_gguf import write_tiny_gguf
from .raw_types import product_reference
from .test_kquant_model import DequantizedBackend
from .test_numpy_kernels import raw_blocks


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def _weights(rng, qtype, shapes):
    """Kept weights and gguf's float32 dequantization of each [N, K] in `shapes`."""
    from gguf import GGMLQuantizationType, quants

    be = NumpyBackend()
    kept, dense = [], []
    for n, k in shapes:
        blocks = raw_blocks(rng, qtype, n, k)
        kept.append(be.linear_weight(GGUFTensor("w", (n, k), qtype, blocks)))
        dense.append(np.ascontiguousarray(quants.dequantize(blocks, GGMLQuantizationType[qtype]),
                                          dtype=np.float32).reshape(n, k))
    return be, kept, dense


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("M", [1, 3, 4, 5, 33])
def test_linear_many_equals_each_linear_and_float32(rng, qtype, M):
    """q, k, v shapes (N not a multiple of the 6-column tile) in one call: every product is
    the single call's and the float32 kernel's on gguf's floats (Q4_K, Q6_K: their int8-activation
    reference, `raw_types.product_reference`), at the register path (M <= 4) and the panel
    path."""
    be, kept, dense = _weights(rng, qtype, [(70, 512), (20, 512), (33, 512)])
    x = rng.standard_normal((M, 512), dtype=np.float32)
    fused = be.linear_many(x, tuple(kept))
    assert len(fused) == 3
    for got, w, d in zip(fused, kept, dense):
        assert np.array_equal(got, be.linear(x, w))
        assert np.array_equal(got, product_reference(x, w, d))


def test_linear_many_rows_invariant(rng):
    """Row counts 1..33 through the fused call, shuffled: each row's bits as alone."""
    be, kept, _ = _weights(rng, "Q4_1", [(40, 256), (16, 256)])
    pool = rng.standard_normal((33, 256), dtype=np.float32)
    alone = [np.concatenate([be.linear_many(pool[i:i + 1], tuple(kept))[j] for i in range(33)])
             for j in range(2)]
    for B in range(1, 34):
        pick = rng.permutation(33)[:B]
        got = be.linear_many(pool[pick], tuple(kept))
        assert all(np.array_equal(got[j], alone[j][pick]) for j in range(2)), B


@pytest.mark.parametrize("qtype", ["Q4_1", pytest.param("Q4_0", marks=pytest.mark.slow), "Q8_0", "Q5_0",
                                   pytest.param("Q5_1", marks=pytest.mark.slow), "Q4_K",
                                   pytest.param("Q5_K", marks=pytest.mark.slow), "Q6_K"])
def test_one_thread_gives_the_bits_of_two(rng, qtype):
    """On one numba thread (the governor's choice on a busy machine) every product, fused or
    not, has the same bits as on two threads, at the register path and the panel path."""
    import numba

    from panechat.backends.cpu import quant_kernels as qk

    be, kept, _ = _weights(rng, qtype, [(70, 512), (20, 512), (33, 512)])
    before = numba.get_num_threads()
    try:
        for M in (1, 4, 5, 33):
            x = rng.standard_normal((M, 512), dtype=np.float32)
            got = {}
            for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
                numba.set_num_threads(threads)
                got[threads] = (be.linear_many(x, tuple(kept)), [be.linear(x, w) for w in kept])
            one, many = got[1], got[max(got)]
            for a, b in zip(one[0] + tuple(one[1]), many[0] + tuple(many[1])):
                assert np.array_equal(a, b), (qtype, M)
    finally:
        numba.set_num_threads(before)
    assert (qk.packed_kernel(qtype) if registry.get(qtype).cpu_packed else qk.kernel(qtype)).signatures


class _Float32Unfused(DequantizedBackend):
    """The reference path: every weight dequantized to float32 by gguf (a `cpu_packed` type's
    multiplied by its numpy reference), one `linear` call per product, op by op."""


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_forward_on_blocks_fused_equals_float32_unfused(tmp_path, qtype):
    """A batch mixing a prefill chunk and decode rows of other sequences: identical logits."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", qtype=qtype, tied=False, seed=4, n_embd=64, n_ff=96)
    fast = Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=64)
    ref = Model.load(GGUFFile.open(path), _Float32Unfused(), max_positions=64)
    assert not isinstance(fast.layers[0].attn_q, np.ndarray)  # kept as stored
    rng = np.random.default_rng(2)
    a = fast.args
    kvs = [m.backend.new_kv(3, a.n_layer, a.n_kv_head, 64, a.head_dim) for m in (fast, ref)]
    steps = [  # (tokens, slots, positions)
        (rng.integers(0, a.vocab_size, 9), [0] * 9, range(9)),
        (rng.integers(0, a.vocab_size, 6), [1] * 5 + [0], list(range(5)) + [9]),
        (rng.integers(0, a.vocab_size, 3), [0, 1, 2], [10, 5, 0]),
    ]
    for toks, slots, pos in steps:
        b = Batch(np.asarray(toks, np.int32), np.asarray(slots, np.int32), np.asarray(pos, np.int32),
                  np.arange(len(toks)))
        got, want = (m.forward(kv, b) for m, kv in zip((fast, ref), kvs))
        assert np.array_equal(got, want)


def test_q4_1_weights_are_the_files_bytes_regrouped(tmp_path):
    """The default model's type: each matrix holds the file's tensor bytes, regrouped into
    records of 16 columns (unpacked, they are the file's blocks): no int8 widening, no
    float32 copy."""
    from panechat.backends.cpu import repack

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", qtype="Q4_1", tied=False, seed=1)
    gf = GGUFFile.open(path)
    m = Model.load(gf, NumpyBackend(), max_positions=64)
    w, t = m.layers[0].ffn_up, gf.tensor("blk.0.ffn_up.weight")
    assert w.nbytes == t.nbytes and not np.shares_memory(w.data, t.blocks)
    assert np.array_equal(repack.unpack(w.data, "Q4_1", t.shape[0]), t.blocks)
