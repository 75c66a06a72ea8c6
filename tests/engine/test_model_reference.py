"""The numpy forward pass against a float64 transcription of the equations, on tiny
synthetic GGUF files of both architectures and several tensor types."""

import numpy as np
import pytest

from panechat.backends.numpy_backend import NumpyBackend
from panechat.engine.gguf_file import GGUFFile
from panechat.engine.model import Model

from ..model_runs import forward_chunks
from ..tiny_gguf import reference_logits, write_tiny_gguf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype,tied", [("F32", True), ("Q8_0", False), ("Q4_1", True), ("Q4_0", False)])
def test_forward_matches_float64_reference(tmp_path, arch, qtype, tied):
    path = tmp_path / f"tiny-{arch}.gguf"
    weights = write_tiny_gguf(path, arch, qtype=qtype, tied=tied, seed=3)
    model = Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=64)
    tokens = np.random.default_rng(1).integers(0, model.args.vocab_size, 23).tolist()
    ref = reference_logits(weights, arch, tokens)
    for chunk in (23, 5, 1):  # one prefill, chunked prefill, token by token
        got = forward_chunks(model, tokens, chunk)
        assert got.dtype == np.float32
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 2e-5, f"chunk {chunk}: relative error {err:.2e}"
        assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_rope_style_matters(tmp_path):
    """The reference of the other architecture must disagree: the test can fail."""
    path = tmp_path / "tiny.gguf"
    weights = write_tiny_gguf(path, "llama", seed=4)
    model = Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=64)
    tokens = list(range(10, 30))
    got = forward_chunks(model, tokens, 20)
    wrong = reference_logits(weights, "qwen2", tokens)
    assert np.abs(got - wrong).max() > 1e-3
