"""engine/gguf/file.py: panechat's own GGUF reader gives what gguf.GGUFReader gives, and every
bad file (a type panechat does not read, cut tensor data, rows of partial blocks) is one
ModelFileError line, before any weight is prepared."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from panechat.engine.gguf.file import GGUFFile, ModelFileError
from panechat.engine.model.loader import load_model

from ..tiny_gguf import set_row_length, write_tiny_gguf


def _reader_view(path: Path) -> tuple[dict, dict]:
    """gguf.GGUFReader's metadata (python values) and tensors (type, shape, bytes)."""
    r = gguf.GGUFReader(path)
    meta = {}
    for k, f in r.fields.items():
        if not k.startswith("GGUF."):
            v = f.contents()
            meta[k] = v.item() if isinstance(v, np.generic) else v
    tensors = {t.name: (t.tensor_type.name, t.data.dtype, t.data.shape, bytes(np.asarray(t.data).view(np.uint8)))
               for t in r.tensors}
    return meta, tensors


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_1"), ("qwen2", "F16"), ("gemma3", "Q8_0"), ("llama", "BF16")])
def test_same_metadata_and_tensors_as_gguf_reader(tiny, arch, qtype):
    path, _ = tiny(arch, qtype)
    meta, tensors = _reader_view(path)
    gf = GGUFFile.open(path)
    assert gf.metadata == meta
    assert set(gf._tensors) == set(tensors)
    for name, (ttype, dtype, shape, data) in tensors.items():
        t = gf.tensor(name)
        assert (t.qtype, t.blocks.dtype, t.blocks.shape) == (ttype, dtype, shape), name
        assert bytes(t.blocks.view(np.uint8)) == data, name


def test_the_default_model_reads_as_gguf_reader_reads_it(model_path):
    meta, tensors = _reader_view(model_path)
    gf = GGUFFile.open(model_path)
    assert gf.metadata == meta and len(gf.metadata["tokenizer.ggml.tokens"]) == 49152
    qtype, _, shape, data = tensors["blk.3.ffn_down.weight"]
    t = gf.tensor("blk.3.ffn_down.weight")
    assert (t.qtype, t.blocks.shape, bytes(t.blocks)) == (qtype, shape, data)


def _one_line(e: pytest.ExceptionInfo, path: Path) -> str:
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "TQ1_0", "Q8_1"])
def test_a_type_panechat_does_not_read_is_refused_in_one_line(tmp_path, qtype):
    """Raw blocks of a type the kernels do not read: the message names the type, the tensor
    and the types read, and comes before the tokenizer or any weight is built."""
    path = tmp_path / f"{qtype}.gguf"
    write_tiny_gguf(path, "llama", n_embd=256, zero_raw={"blk.1.ffn_up.weight": qtype})
    with pytest.raises(ModelFileError) as e:
        load_model(path, "numpy", max_positions=64)
    msg = _one_line(e, path)
    assert f"tensor blk.1.ffn_up.weight has type {qtype}" in msg
    assert "Q4_K" in msg and "Q8_0" in msg and "BF16" in msg  # the types it reads


def test_several_unread_tensors_are_counted(tmp_path):
    path = tmp_path / "iq.gguf"
    write_tiny_gguf(path, "llama", n_embd=256, zero_raw={"blk.0.attn_q.weight": "IQ2_XXS",
                                                         "blk.1.attn_q.weight": "IQ2_XXS"})
    with pytest.raises(ModelFileError, match=r"tensor blk\.0\.attn_q\.weight \(and 1 more tensor\) has type IQ2_XXS"):
        load_model(path, "numpy", max_positions=64)


@pytest.mark.parametrize("keep", [0.99, 0.75, 0.5])
def test_cut_tensor_data_is_a_truncated_file(tiny, tmp_path, keep):
    good = tiny("llama", "Q8_0")[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[: int(len(good) * keep)])
    with pytest.raises(ModelFileError) as e:
        GGUFFile.open(cut)
    msg = _one_line(e, cut)
    assert "truncated" in msg and "download it again" in msg
    with pytest.raises(ModelFileError, match="truncated"):
        load_model(cut, "numpy", max_positions=64)


def test_rows_of_partial_blocks_are_a_damaged_file(tmp_path):
    """A Q8_0 weight whose rows are 48 values: the last block of each row is cut short."""
    path = tmp_path / "partial.gguf"
    write_tiny_gguf(path, "llama", qtype="Q8_0")
    set_row_length(path, "blk.0.ffn_gate.weight", 48)
    with pytest.raises(ModelFileError) as e:
        load_model(path, "numpy", max_positions=64)
    msg = _one_line(e, path)
    assert "damaged or truncated" in msg and "blk.0.ffn_gate.weight" in msg and "32-value Q8_0 blocks" in msg


def test_opening_needs_no_gguf_package(tiny, tmp_path):
    """The start-up path parses the header itself and dequantizes float norms and Q8_0
    embedding rows itself: none of it imports `gguf` (its import alone costs 0.05-0.2 s)."""
    import subprocess
    import sys

    path, _ = tiny("llama", "Q8_0")  # a Q8_0 embedding table, as the default model's
    code = ("import sys; import numpy as np; from panechat.engine.gguf.file import GGUFFile; "
            f"g = GGUFFile.open({str(path)!r}); g.check_types(); g.tensor('output_norm.weight').dequantize(); "
            "g.tensor('token_embd.weight').dequantize_rows(np.array([1, 5])); print('gguf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_big_endian_file_reads_the_same_values(tmp_path):
    w_le, w_be = (gguf.GGUFWriter(str(tmp_path / f"{e}.gguf"), "llama", endianess=getattr(gguf.GGUFEndian, e))
                  for e in ("LITTLE", "BIG"))
    a = np.arange(64, dtype=np.float32).reshape(2, 32) / 7
    for w in (w_le, w_be):
        w.add_context_length(4096)
        w.add_token_scores([0.5, -1.25])
        w.add_tensor("t", a)  # the writer swaps the bytes of a big-endian file
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    le, be = GGUFFile.open(tmp_path / "LITTLE.gguf"), GGUFFile.open(tmp_path / "BIG.gguf")
    assert le.metadata == be.metadata and be.metadata["tokenizer.ggml.scores"] == [0.5, -1.25]
    assert be.tensor("t").blocks.dtype.byteorder == ">"  # stored swapped, read as values
    assert np.array_equal(le.tensor("t").dequantize(), a) and np.array_equal(be.tensor("t").dequantize(), a)
