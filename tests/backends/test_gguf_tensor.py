"""The loader's seam: backends get each tensor as stored (`GGUFTensor`) and dequantize
only what they do not keep quantized."""

from __future__ import annotations

import numpy as np
import pytest

from panechat.backends.cuda.cupy_backend import CupyBackend
from panechat.backends.quant.gguf_tensor import GGUFTensor, TensorError
from panechat.backends.cpu.numpy_backend import NumpyBackend, StackedGemvBackend
from panechat.engine.gguf.file import GGUFFile, ModelFileError
from panechat.engine.model.forward import Model


def _mlx():
    pytest.importorskip("mlx.core")
    from panechat.backends.mlx.mlx_backend import MLXBackend

    return MLXBackend()


BACKENDS = {"numpy": NumpyBackend, "cupy-emulated": CupyBackend.emulated_on_cpu, "mlx": _mlx}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_0"])
def test_no_float32_copy_of_a_tensor_kept_quantized(tiny, monkeypatch, backend, qtype):
    """Loading a quantized model dequantizes only the float32 norms, and a step only the
    embedding rows it uses: every matmul weight (and the table) stays in block form."""
    path, _ = tiny("llama", qtype, tied=True)
    gf = GGUFFile.open(path)
    be = BACKENDS[backend]()
    whole, rows = [], []
    real, real_rows = GGUFTensor.dequantize, GGUFTensor.dequantize_rows
    monkeypatch.setattr(GGUFTensor, "dequantize", lambda t: whole.append(t.qtype) or real(t))
    monkeypatch.setattr(GGUFTensor, "dequantize_rows",
                        lambda t, ids: rows.append((t.name, len(ids))) or real_rows(t, ids))
    model = Model.load(gf, be, max_positions=64)
    assert whole and set(whole) == {"F32"}
    model.forward(model.backend.new_kv(1, model.args.n_layer, model.args.n_kv_head, 64, model.args.head_dim),
                  _batch([5, 6, 7]))
    assert rows == [("token_embd.weight", 3)]


def test_a_reference_backend_dequantizes_everything(tiny, monkeypatch):
    path, _ = tiny("llama", "Q8_0", tied=True)
    seen = []
    real = GGUFTensor.dequantize
    monkeypatch.setattr(GGUFTensor, "dequantize", lambda t: seen.append(t.qtype) or real(t))
    Model.load(GGUFFile.open(path), StackedGemvBackend(), max_positions=64)
    assert "Q8_0" in seen  # the check above can fail


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1", "Q4_0"])
def test_rows_dequantize_as_the_whole_tensor_does(tiny, qtype):
    path, weights = tiny("qwen2", qtype, tied=False)
    t = GGUFFile.open(path).tensor("token_embd.weight")
    assert t.qtype == qtype and t.shape == weights["token_embd.weight"].shape
    full = t.dequantize()
    assert full.dtype == np.float32 and np.array_equal(full, weights["token_embd.weight"])
    ids = np.array([3, 0, 200, 3, t.shape[0] - 1], np.int32)
    assert np.array_equal(t.dequantize_rows(ids).view(np.uint32), full[ids].view(np.uint32))


def test_blocks_are_the_mapped_file_not_a_copy(tiny):
    path, _ = tiny("llama", "Q4_1", tied=True)
    t = GGUFFile.open(path).tensor("blk.0.ffn_up.weight")
    assert t.blocks.dtype == np.uint8 and not t.blocks.flags.owndata and not t.blocks.flags.writeable
    assert t.nbytes == t.shape[0] * t.shape[1] // 32 * 20  # Q4_1: 20 bytes per 32 weights


def test_from_array_round_trips_through_the_stored_type():
    w = np.random.default_rng(0).standard_normal((4, 64), dtype=np.float32)
    assert np.array_equal(GGUFTensor.from_array(w).dequantize(), w)
    q = GGUFTensor.from_array(w, "Q8_0", "w")
    assert q.blocks.shape == (4, 2 * 34) and np.abs(q.dequantize() - w).max() < 0.02


def test_an_unsupported_type_is_a_one_line_model_file_error(tmp_path):
    from ..tiny_gguf import write_tiny_gguf

    path = tmp_path / "q8_1.gguf"
    write_tiny_gguf(path, "llama", zero_raw={"blk.0.attn_q.weight": "Q8_1"})
    with pytest.raises(TensorError, match="Q8_1"):
        GGUFFile.open(path).tensor("blk.0.attn_q.weight").dequantize()
    with pytest.raises(ModelFileError) as e:
        Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=64)
    assert str(e.value).startswith(str(path)) and "Q8_1" in str(e.value) and "\n" not in str(e.value)


def _batch(tokens: list[int]):
    from panechat.engine.model.forward import Batch

    n = len(tokens)
    return Batch(np.asarray(tokens, np.int32), np.zeros(n, np.int32), np.arange(n, dtype=np.int32),
                 np.array([n - 1]))


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_a_row_range_is_a_view_of_the_stored_blocks(tiny, qtype):
    """How phi3's fused weights are split: rows a..b share the file's memory (no copy, no
    float32) and dequantize to exactly those rows of the whole tensor."""
    path, _ = tiny("phi3", qtype)
    t = GGUFFile.open(path).tensor("blk.0.attn_qkv.weight")
    part = t.row_range(64, 96)
    assert part.shape == (32, t.shape[1]) and part.qtype == qtype
    assert np.shares_memory(part.blocks, t.blocks)
    assert np.array_equal(part.dequantize(), t.dequantize()[64:96])
    with pytest.raises(TensorError, match="has no rows 90..200"):
        t.row_range(90, 200)
