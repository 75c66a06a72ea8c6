"""The numpy forward pass against a float64 transcription of the equations, on tiny
synthetic GGUF files of every supported architecture and several tensor types."""

import numpy as np
import pytest

from panechat.backends.cpu.numpy_backend import NumpyBackend
from panechat.backends.quant import registry
from panechat.engine.gguf.file import GGUFFile
from panechat.engine.model.forward import Model

from ..model_runs import forward_chunks
from ..tiny_gguf import ARCH_SHAPES, ROPE_VARIANTS, reference_logits, write_tiny_gguf

class FloatProducts(NumpyBackend):
    """The numpy backend with every matrix dequantized to float32 (the float32 kernels)."""

    def linear_weight(self, t):
        return t.dequantize()


_FILES: dict[int, object] = {}  # id(model) -> the tiny file it was loaded from


def load_tiny(tmp_path, arch, name=None, **kw):
    path = tmp_path / f"{name or 'tiny-' + arch}.gguf"
    weights = write_tiny_gguf(path, arch, **{**ARCH_SHAPES[arch], **kw})
    model = Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=64)
    _FILES[id(model)] = path
    return model, weights


def assert_close(model, weights, arch, tokens):
    """The forward pass within float32's distance of the equations (2e-5 of the logits'
    scale) at one prefill, chunks of 5 and token by token. A file whose matrices are of a
    type the CPU multiplies over activations rounded to int16 per 32 (registry
    `cpu_packed`: Q4_0, Q4_1, Q8_0) is checked so twice: the equations with float32
    products (the same file on float32 kernels, the criterion unchanged), and the backend's
    own products within the int16 rounding's distance: each input off by up to half a step
    of its block's largest magnitude / 32639, about 5e-5 of the logits at these tiny sizes
    (two blocks a row); the errors of a wrong equation are over 1e-3 (the tests below)."""
    ref = reference_logits(weights, arch, tokens)
    packed = registry.get(model.layers[0].attn_output.qtype).cpu_packed if hasattr(
        model.layers[0].attn_output, "qtype") else ""
    runs = [(model, 2e-5)]
    if packed:
        floats = Model.load(GGUFFile.open(_FILES[id(model)]), FloatProducts(), max_positions=64)
        runs = [(floats, 2e-5), (model, 1.5e-4)]
    for m, bound in runs:
        for chunk in (len(tokens), 5, 1):  # one prefill, chunked prefill, token by token
            got = forward_chunks(m, tokens, chunk)
            assert got.dtype == np.float32
            err = np.abs(got - ref).max() / np.abs(ref).max()
            assert err < bound, f"chunk {chunk}: relative error {err:.2e}"
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


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_scaling_matches_reference(tmp_path, variant):
    """Llama 3.x rope_freqs, linear and yarn scaling, phi3's long and short factors with
    their attention factor: panechat (llama.cpp's ggml formulas) against the reference
    (transformers' formulas); and the reference without the scaling disagrees, so the
    scaling is really applied."""
    kw = dict(ROPE_VARIANTS[variant])
    arch = kw.pop("arch")
    model, weights = load_tiny(tmp_path, arch, qtype="Q8_0", seed=8, **kw)
    tokens = np.random.default_rng(3).integers(0, model.args.vocab_size, 23).tolist()
    assert_close(model, weights, arch, tokens)
    plain = {k: v for k, v in weights.items() if not k.startswith("rope_")}
    plain["_meta"] = weights["_meta"].copy()
    plain["_meta"][7] = 0  # no rope.scaling.factor
    unscaled = reference_logits(plain, arch, tokens)
    assert np.abs(forward_chunks(model, tokens, 23) - unscaled).max() > 1e-3


def test_phi3_long_or_short_factors_by_context(tmp_path):
    """llama.cpp picks phi3's long factors when a sequence may run past the original
    context (here 32 positions): the same file at 64 and at 32 positions differs."""
    path = tmp_path / "phi3-128k.gguf"
    write_tiny_gguf(path, "phi3", long_factors=True, orig_ctx=32, seed=9)
    tokens = list(range(30, 50))
    long_ = Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=64)
    short = Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=32)
    assert np.abs(forward_chunks(long_, tokens, 20) - forward_chunks(short, tokens, 20, ctx=32)).max() > 1e-3


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_phi3_fused_tensors_equal_separate_ones(tmp_path, qtype):
    """phi3's fused attn_qkv and gate-up ffn_up, split at load by row ranges of the stored
    blocks, give bit for bit the logits of the same weights stored as separate tensors."""
    models = []
    for fused in (True, False):
        path = tmp_path / f"phi3-{qtype}-{fused}.gguf"
        write_tiny_gguf(path, "phi3", qtype=qtype, seed=11, fused=fused)
        gf = GGUFFile.open(path)
        assert gf.has("blk.0.attn_qkv.weight") == fused and gf.has("blk.0.ffn_gate.weight") != fused
        models.append(Model.load(gf, NumpyBackend(), max_positions=64))
    tokens = np.random.default_rng(4).integers(0, models[0].args.vocab_size, 19).tolist()
    for chunk in (19, 1):
        assert np.array_equal(forward_chunks(models[0], tokens, chunk), forward_chunks(models[1], tokens, chunk))


def test_phi3_fused_tensor_of_wrong_size_is_refused(tmp_path):
    """A fused tensor whose rows do not add up to the heads in the metadata: one line."""
    from panechat.engine.gguf.file import ModelFileError

    path = tmp_path / "phi3.gguf"
    write_tiny_gguf(path, "phi3", seed=1)
    gf = GGUFFile.open(path)
    gf.metadata["phi3.attention.head_count_kv"] = 1
    with pytest.raises(ModelFileError, match="blk.0.attn_qkv.weight has 128 rows, metadata says 96") as e:
        Model.load(gf, NumpyBackend(), max_positions=64)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["dynamic", "su"])
def test_unknown_rope_scaling_is_refused_in_one_line(kind):
    from panechat.engine.gguf.file import ModelFileError
    from panechat.engine.model.args import ModelArgs

    meta = {"general.architecture": "llama", "llama.block_count": 1, "llama.embedding_length": 64,
            "llama.attention.head_count": 4, "llama.feed_forward_length": 96,
            "llama.rope.scaling.type": kind, "llama.rope.scaling.factor": 2.0}
    with pytest.raises(ModelFileError, match=f"unsupported RoPE scaling type '{kind}'.*linear, yarn"):
        ModelArgs.from_metadata(meta)
    meta["llama.rope.scaling.type"] = "yarn"
    args = ModelArgs.from_metadata(meta)
    assert args.rope_freq_scale == 0.5 and args.yarn_ext_factor == 1.0
    meta["llama.rope.scaling.yarn_log_multiplier"] = 0.1  # DeepSeek's: not implemented, so refused
    with pytest.raises(ModelFileError, match="yarn_log_multiplier"):
        ModelArgs.from_metadata(meta)
