"""Checks shared by the tests of block types written as raw bytes (IQ4_NL, IQ4_XS, Q2_K,
Q3_K: gguf cannot quantize them): loaders against gguf's weights under adversarial
scales, kernels against the float32 kernel at every row count, and a tiny model of the
types whose one-call step equals its op-by-op step."""

from __future__ import annotations

import numba
import numpy as np

from panechat.backends.cpu import numpy_kernels as nk
from panechat.backends.cpu import repack
from panechat.backends.cpu import quant_kernels as qk
from panechat.backends.quant import registry
from panechat.backends.quant.gguf_tensor import GGUFTensor
from panechat.backends.cpu.numpy_backend import KQuantWeight, NumpyBackend, PackedWeight
from panechat.engine.gguf.file import GGUFFile
from panechat.engine.model.forward import Model

from ..tiny_gguf import random_raw_blocks, write_tiny_gguf
from .test_block_lut import _adversarial, _same_bits, _weights
from .test_cpu_decoder import _assert_same, _step_both_ways
from .test_numpy_kernels import _read_only


def gguf_weights(blocks, qtype, N, K):
    """gguf.quants.dequantize's float32 weights [N, K]."""
    from gguf import GGMLQuantizationType, quants

    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in gguf's own product: NaN, as ours
        return np.asarray(quants.dequantize(blocks, GGMLQuantizationType[qtype]), np.float32).reshape(N, K)


def assert_loader_is_gguf_any_scale(loader, qtype, seed, d_at, block_bytes):
    """Every f16 d from the adversarial list (subnormals, +-0, largest, +-inf, NaN) or random
    bits, random codes and scales: the loader gives gguf's floats bit for bit (a NaN matches
    any NaN: `_same_bits`), and the adversarial cases did occur. d_at: d's byte in a block."""
    rng = np.random.default_rng(seed)
    seen = set()
    for N, K in [(9, 256), (33, 512)]:
        blocks = _adversarial(rng, qtype, N, K)
        want, got = gguf_weights(blocks, qtype, N, K), _weights(loader, blocks, qtype, K)
        bits = want.view(np.uint32)
        d = blocks.reshape(N, -1, block_bytes)[..., d_at:d_at + 2].copy().view("<u2")
        seen |= {"nan"} if np.isnan(want).any() else set()
        seen |= {"inf"} if np.isinf(want).any() else set()
        seen |= {"subnormal d"} if (((d & 0x7C00) == 0) & ((d & 0x3FF) != 0)).any() else set()
        seen |= {"-0"} if (bits == 0x80000000).any() else set()
        assert _same_bits(got, want), qtype
        finite = np.isfinite(want)
        assert np.array_equal(got.view(np.uint32)[finite], bits[finite]), qtype
    assert seen == {"nan", "inf", "subnormal d", "-0"}  # the adversarial cases were there


def assert_products_at_every_row_count(be, kept, pool, want, rng, label):
    """Rows 1..33 of `pool` in shuffled order, on one numba thread (the serial kernels) and
    two, through `linear` and the fused `linear_many` of the weights `kept`: each product
    equals `want[j]` (the product of the whole pool) on the rows picked."""
    before = numba.get_num_threads()
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            for B in range(1, 34):
                pick = rng.permutation(33)[:B]
                x = np.ascontiguousarray(pool[pick])
                fused = be.linear_many(x, tuple(kept))
                for j in range(len(kept)):
                    assert np.array_equal(be.linear(x, kept[j]), want[j][pick]), (label, threads, B, j)
                    assert np.array_equal(fused[j], want[j][pick]), (label, threads, B, j)
    finally:
        numba.set_num_threads(before)


def product_reference(x, w, dense):
    """What the backend's product x @ W.T must be, bit for bit: for a repacked type (registry
    `cpu_packed`) `repack.reference` on the file's blocks (its activations rounded to int16,
    or for a K-quant to 8 bits: `q8k_dot`'s contract), for the others the float32 kernel on
    gguf's weights `dense`."""
    if isinstance(w, PackedWeight):  # in records of 16 columns
        return repack.reference(w.qtype, x, repack.unpack(w.data, w.qtype, w.shape[0]))
    return nk.linear(x, dense, np.empty((x.shape[0], dense.shape[0]), np.float32))


def assert_kernels_are_linear_at_every_row_count(qtype, seed):
    """Rows 1..33 picked from a pool in shuffled order, through `linear` and the fused
    `linear_many`, on one numba thread (the serial kernels) and two: every product is the
    float32 kernel's on gguf's weights (a `cpu_packed` type's: its repacked product's reference),
    and each row's bits are the row's alone."""
    rng = np.random.default_rng(seed)
    be = NumpyBackend()
    K = 512
    blocks = [_read_only(random_raw_blocks(rng, qtype, n, K)) for n in (37, 20)]
    kept = [be.linear_weight(GGUFTensor("w", (b.shape[0], K), qtype, b)) for b in blocks]
    assert all(w.qtype == qtype and (np.array_equal(repack.unpack(w.data, qtype, w.shape[0]), b)
                                     if isinstance(w, PackedWeight)  # the file's bytes regrouped
                                     else np.shares_memory(w.blocks if isinstance(w, KQuantWeight) else w.data, b))
               for w, b in zip(kept, blocks))  # kept as stored, no copy
    dense = [gguf_weights(b, qtype, b.shape[0], K) for b in blocks]
    pool = rng.standard_normal((33, K), dtype=np.float32)
    want = [product_reference(pool, w, d) for w, d in zip(kept, dense)]
    alone = [np.concatenate([product_reference(pool[i:i + 1], w, d) for i in range(33)])
             for w, d in zip(kept, dense)]
    assert all(np.array_equal(a, w) for a, w in zip(alone, want))  # the reference is row-invariant itself
    assert_products_at_every_row_count(be, kept, pool, want, rng, qtype)
    assert (qk.packed_kernel(qtype) if registry.get(qtype).cpu_packed else qk.kernel(qtype)).signatures  # its own kernel ran


def tiny_model(path, qtypes, seed):
    """A tiny llama (n_embd 256, a layer per type, at least 2) whose layer i matrices are all
    qtypes[i] (the rest Q8_0), loaded on the numpy backend: (model, GGUFFile)."""
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    raw = {f"blk.{i}.{m}.weight": t for i, t in enumerate(qtypes) for m in names}
    write_tiny_gguf(path, "llama", n_layer=max(2, len(qtypes)), n_embd=256, n_ff=256, n_head=4, n_kv=2, qtype="Q8_0",
                    tied=False, seed=seed, random_raw=raw)
    gf = GGUFFile.open(path)
    gf.check_types()  # read, not refused
    return Model.load(gf, NumpyBackend(), max_positions=128), gf


def assert_one_call_equals_ops(model, threads):
    """The model's one-call decode step equals its op-by-op step at 1 and 4 rows, on
    `threads` numba threads."""
    was = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        for rows in (1, 4):
            _assert_same(*_step_both_ways(model, [7, 12, 3, 9][:rows], "f16", seed=rows + threads))
    finally:
        numba.set_num_threads(was)
