"""IQ4_NL (32-weight blocks) and IQ4_XS (256-weight super-blocks) read as stored on the CPU
(backends/quant_kernels.py): the loaders give gguf's float32 weights bit for bit, any f16
d included (subnormal, signed zero, infinite, NaN); the kernels give the float32 kernel's
product on gguf's weights at every row count, each row's bits independent of the batch,
on one thread and on two; a tiny model of both types loads, keeps them in their blocks,
and its one-call decode step equals the op-by-op step."""

import numba
import numpy as np
import pytest

from panechat.backends import numpy_kernels as nk
from panechat.backends import quant_kernels as qk
from panechat.backends.block_lut import HAS_LUT
from panechat.backends.gguf_tensor import GGUFTensor
from panechat.backends.numpy_backend import NumpyBackend
from panechat.engine.gguf_file import GGUFFile
from panechat.engine.model import Model

from ..tiny_gguf import random_raw_blocks, write_tiny_gguf
from .test_block_lut import _adversarial, _same_bits, _weights
from .test_cpu_decoder import _assert_same, _step_both_ways
from .test_numpy_kernels import _read_only

IQ4 = ("IQ4_NL", "IQ4_XS")
LOADERS = {"IQ4_NL": (qk._arith_iq4_nl, qk._lut_iq4_nl), "IQ4_XS": (qk._arith_iq4_xs, qk._lut_iq4_xs)}


def _gguf(blocks, qtype, N, K):
    from gguf import GGMLQuantizationType, quants

    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in gguf's own product: NaN, as ours
        return np.asarray(quants.dequantize(blocks, GGMLQuantizationType[qtype]), np.float32).reshape(N, K)


def test_kvalues_are_ggufs():
    from gguf import quants

    assert qk.KVALUES == tuple(quants.IQ4_NL.kvalues)


@pytest.mark.parametrize("qtype", IQ4)
@pytest.mark.parametrize("table", [False, True])
def test_loader_weights_are_gguf_dequantize_any_scale(qtype, table):
    """Every f16 d from the adversarial list (subnormals, +-0, largest, +-inf, NaN) or random
    bits, random codes and IQ4_XS sub-block scales: gguf's floats, bit for bit (a NaN
    matches any NaN: `_same_bits`)."""
    if table and not HAS_LUT:
        pytest.skip("the table loaders need AVX-512 permutes")
    rng = np.random.default_rng(40)
    seen = set()
    for N, K in [(9, 256), (33, 512)]:
        blocks = _adversarial(rng, qtype, N, K)
        want, got = _gguf(blocks, qtype, N, K), _weights(LOADERS[qtype][table], blocks, qtype, K)
        bits = want.view(np.uint32)
        d = blocks.reshape(N, -1, qk.KQUANT_BYTES.get(qtype, 18))[..., 0:2].copy().view("<u2")
        seen |= {"nan"} if np.isnan(want).any() else set()
        seen |= {"inf"} if np.isinf(want).any() else set()
        seen |= {"subnormal d"} if (((d & 0x7C00) == 0) & ((d & 0x3FF) != 0)).any() else set()
        seen |= {"-0"} if (bits == 0x80000000).any() else set()
        assert _same_bits(got, want), qtype
        finite = np.isfinite(want)
        assert np.array_equal(got.view(np.uint32)[finite], bits[finite]), qtype
    assert seen == {"nan", "inf", "subnormal d", "-0"}  # the adversarial cases were there


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
    want = _gguf(blocks, qtype, N, K)
    assert len(np.unique(want)) > 16 if qtype == "IQ4_XS" else set(np.unique(want)) == set(qk.KVALUES)
    for table in ([False, True] if HAS_LUT else [False]):
        assert np.array_equal(_weights(LOADERS[qtype][table], blocks, qtype, K).view(np.uint32),
                              want.view(np.uint32)), (qtype, table)


@pytest.mark.parametrize("qtype", IQ4)
def test_kernel_equals_linear_on_gguf_dequantized_at_every_row_count(qtype):
    """Rows 1..33 picked from a pool in shuffled order, through `linear` and the fused
    `linear_many`, on one numba thread (the serial kernels) and two: every product is the
    float32 kernel's on gguf's weights, and each row's bits are the row's alone."""
    rng = np.random.default_rng(41)
    be = NumpyBackend()
    K = 512
    blocks = [_read_only(random_raw_blocks(rng, qtype, n, K)) for n in (37, 20)]
    kept = [be.linear_weight(GGUFTensor("w", (b.shape[0], K), qtype, b)) for b in blocks]
    assert all(w.qtype == qtype and np.shares_memory(w.blocks if qtype == "IQ4_XS" else w.data, b)
               for w, b in zip(kept, blocks))  # kept as stored, no copy
    dense = [_gguf(b, qtype, b.shape[0], K) for b in blocks]
    pool = rng.standard_normal((33, K), dtype=np.float32)
    want = [nk.linear(pool, d, np.empty((33, d.shape[0]), np.float32)) for d in dense]
    alone = [np.concatenate([nk.linear(pool[i:i + 1], d, np.empty((1, d.shape[0]), np.float32))
                             for i in range(33)]) for d in dense]
    assert all(np.array_equal(a, w) for a, w in zip(alone, want))  # the reference is row-invariant itself
    before = numba.get_num_threads()
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            for B in range(1, 34):
                pick = rng.permutation(33)[:B]
                x = np.ascontiguousarray(pool[pick])
                fused = be.linear_many(x, tuple(kept))
                for j in range(2):
                    assert np.array_equal(be.linear(x, kept[j]), want[j][pick]), (qtype, threads, B, j)
                    assert np.array_equal(fused[j], want[j][pick]), (qtype, threads, B, j)
    finally:
        numba.set_num_threads(before)
    serial = qk._SERIAL if qtype in qk._SERIAL else qk._BLOCK32_SERIAL
    parallel = qk._KERNELS if qtype in qk._KERNELS else qk._BLOCK32_KERNELS
    assert serial[qtype].signatures and parallel[qtype].signatures  # both kernels ran


@pytest.fixture(scope="module")
def iq4_model(tmp_path_factory):
    """A tiny llama (n_embd 256) whose layer 0 matrices are IQ4_XS and layer 1's IQ4_NL
    (the rest Q8_0)."""
    path = tmp_path_factory.mktemp("iq4") / "iq4.gguf"
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    raw = {f"blk.{i}.{m}.weight": t for i, t in enumerate(IQ4) for m in names}
    write_tiny_gguf(path, "llama", n_embd=256, n_ff=256, n_head=4, n_kv=2, qtype="Q8_0", tied=False, seed=9,
                    random_raw=raw)
    gf = GGUFFile.open(path)
    gf.check_types()  # read, not refused
    return Model.load(gf, NumpyBackend(), max_positions=128), gf


def test_iq4_model_keeps_its_blocks(iq4_model):
    model, gf = iq4_model
    for i, qtype in enumerate(IQ4):
        w, t = model.layers[i].ffn_down, gf.tensor(f"blk.{i}.ffn_down.weight")
        assert t.qtype == w.qtype == qtype and w.nbytes - (w.d.nbytes if qtype == "IQ4_XS" else 0) == t.nbytes
    assert model.decoder is not None  # the one-call step takes them


@pytest.mark.parametrize("threads", [1, 2])
def test_iq4_model_one_call_equals_ops(iq4_model, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("one core")
    model, _ = iq4_model
    was = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        for rows in (1, 4):
            _assert_same(*_step_both_ways(model, [7, 12, 3, 9][:rows], "f16", seed=rows + threads))
    finally:
        numba.set_num_threads(was)
