"""engine/gguf/header.py: the listing's fast header reader agrees with gguf.GGUFReader and
turns every kind of bad file into a short reason."""

import re
from pathlib import Path

import gguf
import numpy as np
import pytest

from panechat.engine.gguf.header import GGUFHeaderError, read_gguf_header


def write_gguf(path: Path, arch: str, *, vocab: int = 0, file_type: int | None = None,
               endian=gguf.GGUFEndian.LITTLE) -> Path:
    """A small GGUF of any architecture: a context length, an optional token list, one tensor."""
    w = gguf.GGUFWriter(str(path), arch, endianess=endian)
    w.add_context_length(4096)
    if file_type is not None:
        w.add_file_type(file_type)
    if vocab:
        w.add_token_list([f"t{i}" for i in range(vocab)])
        w.add_token_scores([0.0] * vocab)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def test_header_matches_gguf_reader(tiny):
    path, _ = tiny("llama", "Q8_0")
    h = read_gguf_header(path)
    full = gguf.GGUFReader(path)
    assert h.architecture == "llama" and h.context_length == 256
    assert h.data_end == h.file_size == path.stat().st_size and not h.truncated
    assert h.quant == h.dominant_type == "Q8_0"  # no general.file_type: the dominant tensor type
    by_type: dict[str, int] = {}
    for t in full.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_elements)
    assert h.type_elements == by_type
    # every scalar and string KV is there; arrays (tokens, merges) are skipped, not decoded
    scalars = {k: f.contents() for k, f in full.fields.items()
               if not k.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY}
    assert h.metadata.keys() == scalars.keys() and "tokenizer.ggml.tokens" not in h.metadata
    assert h.metadata["general.name"] == "tiny-llama"


def test_file_type_names_the_quant_and_big_vocab_is_skipped(tmp_path):
    h = read_gguf_header(write_gguf(tmp_path / "g.gguf", "gemma3", vocab=50_000, file_type=15))
    assert (h.architecture, h.context_length, h.quant) == ("gemma3", 4096, "Q4_K_M")


def test_big_endian_file(tmp_path):
    h = read_gguf_header(write_gguf(tmp_path / "be.gguf", "llama", endian=gguf.GGUFEndian.BIG))
    assert (h.architecture, h.context_length) == ("llama", 4096)


@pytest.mark.parametrize("make,reason", [
    (lambda good: b"", "not a GGUF file"),
    (lambda good: b"hello, I am not a model", "not a GGUF file"),
    (lambda good: good[:200], "truncated file (the header ends early)"),
    (lambda good: good[:4] + (1).to_bytes(4, "little") + good[8:], "unsupported GGUF version 1"),
])
def test_bad_files_give_a_reason(tiny, tmp_path, make, reason):
    good = tiny("llama", "Q8_0")[0].read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(make(good))
    with pytest.raises(GGUFHeaderError, match=re.escape(reason)):
        read_gguf_header(bad)


def test_cut_tensor_data_keeps_the_header_facts(tiny, tmp_path):
    good = tiny("llama", "Q8_0")[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[: len(good) * 3 // 4])
    h = read_gguf_header(cut)
    assert h.truncated and (h.file_size, h.data_end) == (len(good) * 3 // 4, len(good))
    assert (h.architecture, h.quant) == ("llama", "Q8_0")
