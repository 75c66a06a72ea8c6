"""The numpy forward pass against a float64 transcription of the equations, on tiny
synthetic GGUF files of every supported architecture and several tensor types."""

import numpy as np
import pytest

from panechat.backends.numpy_backend import NumpyBackend
from panechat.engine.gguf_file import GGUFFile
from panechat.engine.model import Model

from ..model_runs import forward_chunks
from ..tiny_gguf import ARCH_SHAPES, reference_logits, write_tiny_gguf

def load_tiny(tmp_path, arch, **kw):
    path = tmp_path / f"tiny-{arch}.gguf"
    weights = write_tiny_gguf(path, arch, **{**ARCH_SHAPES[arch], **kw})
    return Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=64), weights


def assert_close(model, weights, arch, tokens):
    ref = reference_logits(weights, arch, tokens)
    for chunk in (len(tokens), 5, 1):  # one prefill, chunked prefill, token by token
        got = forward_chunks(model, tokens, chunk)
        assert got.dtype == np.float32
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 2e-5, f"chunk {chunk}: relative error {err:.2e}"
        assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("arch", list(ARCH_SHAPES))
@pytest.mark.parametrize("qtype,tied", [("F32", True), ("Q8_0", False), ("Q4_1", True), ("Q4_0", False)])
def test_forward_matches_float64_reference(tmp_path, arch, qtype, tied):
    model, weights = load_tiny(tmp_path, arch, qtype=qtype, tied=tied, seed=3)
    tokens = np.random.default_rng(1).integers(0, model.args.vocab_size, 23).tolist()
    assert_close(model, weights, arch, tokens)


def test_gemma3_global_layers_with_linear_rope_scaling(tmp_path):
    """rope.scaling.factor stretches the global layers' positions only."""
    model, weights = load_tiny(tmp_path, "gemma3", seed=5, rope_scale=8.0)
    assert [model.args.window(i) for i in range(7)] == [5, 5, 5, 5, 5, 0, 5]
    assert_close(model, weights, "gemma3", np.random.default_rng(2).integers(0, 259, 23).tolist())


def test_rope_style_matters(tmp_path):
    """The reference of the other architecture must disagree: the test can fail."""
    model, weights = load_tiny(tmp_path, "llama", seed=4)
    tokens = list(range(10, 30))
    got = forward_chunks(model, tokens, 20)
    wrong = reference_logits(weights, "qwen2", tokens)
    assert np.abs(got - wrong).max() > 1e-3


def test_sliding_window_matters(tmp_path):
    """The same gemma3 weights with a window wider than the sequence must disagree past
    the window, and agree within it: the window is really applied."""
    model, weights = load_tiny(tmp_path, "gemma3", seed=6)
    tokens = list(range(40, 63))
    got = forward_chunks(model, tokens, 23)
    weights["_meta"][6] = 1000  # the reference without sliding
    wide = reference_logits(weights, "gemma3", tokens)
    assert np.abs(got[:5] - wide[:5]).max() / np.abs(wide).max() < 2e-5
    assert np.abs(got[5:] - wide[5:]).max() > 1e-3
