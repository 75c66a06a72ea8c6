"""A quant type added in the registry alone (backends/quant/registry.py) is read from a GGUF
file, kept in its blocks, multiplied by the CPU kernels and run by the one-call decode step,
with no other file edited: the type below is made up for this test (an unused ggml id, a
block of 32 int8 codes with its f16 d at the end, taken at load), its loader written here.
Without the entry the same file is refused, naming the type."""

from __future__ import annotations

import struct

import numba
import numpy as np
import pytest
from numba import njit

from panechat.backends.cpu import numpy_kernels as nk
from panechat.backends.cpu.numpy_backend import KQuantWeight, NumpyBackend
from panechat.backends.cpu.numpy_kernels import vmul, vsplat
from panechat.backends.cpu.quant_kernels import vload_s8
from panechat.backends.quant import registry
from panechat.backends.quant.gguf_tensor import GGUFTensor
from panechat.engine.gguf.file import GGUFFile, ModelFileError
from panechat.engine.model.forward import Model

from ..tiny_gguf import write_tiny_gguf
from .raw_types import assert_one_call_equals_ops, assert_products_at_every_row_count

T8 = registry.QuantType("T8_END", 200, 32, 34, f16_at=(32,), scales_at_load=True,
                        cpu_loader=f"{__name__}:_pair_t8_end")
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@njit(inline="always", nogil=True)
def _pair_t8_end(w, wd, wdm, n, k):
    """T8_END weights k..k+31 (34 B a block: int8 q[32], f16 d): d * q, d widened at load."""
    base = n * w.shape[1] + (k >> 5) * 34
    d = vsplat(wd[n, k >> 5])
    return vmul(vload_s8(w, base), d), vmul(vload_s8(w, base + 16), d)


def reference_weights(blocks: np.ndarray, n: int, k: int) -> np.ndarray:
    """float32 [n, k]: d * q for every block, in numpy (exact: an int8 times an f16)."""
    b = np.asarray(blocks, np.uint8).reshape(n, k // 32, 34)
    q = b[..., :32].copy().view(np.int8).astype(np.float32)
    d = b[..., 32:34].copy().view(np.float16).astype(np.float32)
    return (q * d).reshape(n, k)


def random_blocks(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """uint8 [n, k/32 * 34]: random codes, d of either sign making weights about 1/sqrt(k)."""
    b = rng.integers(0, 256, (n, k // 32, 34), dtype=np.uint8)
    d = rng.uniform(0.5, 1.5, (n, k // 32)) * rng.choice([-1, 1], (n, k // 32)) / (np.sqrt(k) * 74)
    b[..., 32:34] = d.astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(n, -1)


def _retype(path, names, rng) -> None:
    """Make the Q8_0 tensors `names` of the GGUF at `path` T8_END ones (34 bytes a 32 either):
    new random blocks in their data, the type id in their header entries."""
    import gguf

    data = bytearray(path.read_bytes())
    reader = gguf.GGUFReader(path)
    for t in (t for t in reader.tensors if t.name in names):
        n, k = int(t.shape[1]), int(t.shape[0])
        data[t.data_offset:t.data_offset + t.n_bytes] = random_blocks(rng, n, k).tobytes()
        name = t.name.encode()
        at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
        n_dims = struct.unpack_from("<I", data, at)[0]
        assert struct.unpack_from("<I", data, at + 4 + 8 * n_dims)[0] == 8  # was Q8_0
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, T8.type_id)
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def t8():
    registry.register(T8)
    try:
        yield T8
    finally:
        registry.unregister(T8.name)


@pytest.fixture(scope="module")
def t8_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("t8") / "t8.gguf"
    write_tiny_gguf(path, "llama", qtype="Q8_0", tied=False, seed=21)
    _retype(path, {f"blk.0.{m}.weight" for m in MATRICES}, np.random.default_rng(22))
    return path


@pytest.fixture(scope="module")
def t8_model(t8, t8_file):
    gf = GGUFFile.open(t8_file)
    gf.check_types()  # read, not refused
    return Model.load(gf, NumpyBackend(), max_positions=128), gf


def test_without_its_entry_the_file_is_refused_naming_the_type(t8_file):
    was = registry.get(T8.name)
    registry.unregister(T8.name)
    try:
        with pytest.raises(ModelFileError, match="type 200"):
            GGUFFile.open(t8_file).check_types()
    finally:
        if was is not None:
            registry.register(was)


def test_the_model_keeps_the_type_in_its_blocks(t8_model):
    model, gf = t8_model
    for m in MATRICES:
        w, t = getattr(model.layers[0], m), gf.tensor(f"blk.0.{m}.weight")
        assert t.qtype == w.qtype == "T8_END" and isinstance(w, KQuantWeight)
        assert np.shares_memory(w.blocks, t.blocks)  # no float32 copy
        d = np.asarray(t.blocks).reshape(t.shape[0], -1, 34)[..., 32:34].copy().view(np.float16)[..., 0]
        assert np.array_equal(w.d, d.astype(np.float32)) and w.dmin is w.d  # the registry's bytes
    assert model.decoder is not None  # the one-call step takes it


@pytest.mark.slow  # a made-up type's kernels compile cold every run (~50 s); the model tests below run it
def test_kernels_equal_linear_on_the_reference_weights_at_every_row_count(t8):
    rng = np.random.default_rng(23)
    be, K = NumpyBackend(), 256
    blocks = [random_blocks(rng, n, K) for n in (37, 20)]
    for b in blocks:
        b.flags.writeable = False  # as a file's mapped bytes
    kept = [be.linear_weight(GGUFTensor("w", (b.shape[0], K), "T8_END", b)) for b in blocks]
    dense = [reference_weights(b, b.shape[0], K) for b in blocks]
    pool = rng.standard_normal((33, K), dtype=np.float32)
    want = [nk.linear(pool, d, np.empty((33, d.shape[0]), np.float32)) for d in dense]
    assert_products_at_every_row_count(be, kept, pool, want, rng, "T8_END")


@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_step_equals_ops(t8_model, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("one core")
    assert_one_call_equals_ops(t8_model[0], threads)
