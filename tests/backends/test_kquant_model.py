"""K-quant weights on a real llama-architecture model: the default model re-quantized into
Q4_K / Q6_K blocks (tests/backends/kquant_model.py) decodes, through the block kernels, exactly as
the float32 kernel does on the same weights dequantized by gguf (Q4_K, Q6_K: as their int8-activation
numpy references), and stays batch-invariant."""

import numpy as np
import pytest

from panechat.backends.cpu import repack
from panechat.backends.cpu.numpy_backend import NumpyBackend, PackedWeight
from panechat.backends.quant import registry
from panechat.engine.gguf.file import GGUFFile
from panechat.engine.model.forward import Model

from .kquant_model import write_kquant_copy
from ..model_runs import new_kv, run_batched

PROMPTS = [[1, 9690, 198, 2683, 359, 253], [504, 2365, 6354]]
STEPS = 16


class _PackedReference:
    """A weight of a type whose products run over repacked blocks (registry `cpu_packed`),
    for the reference backend: the file's blocks, multiplied by `repack.reference` (for a
    K-quant `q8k_dot`'s contract: activations rounded to 8 bits)."""

    def __init__(self, t):
        self.qtype, self.blocks, self.shape = t.qtype, np.asarray(t.blocks, np.uint8), t.shape


class DequantizedBackend(NumpyBackend):
    """The reference: every weight dequantized to float32 by gguf, through the f32 kernel;
    a `cpu_packed` type's (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) through its numpy reference
    instead (one call per product)."""

    def linear_weight(self, t):
        if registry.get(t.qtype).cpu_packed and len(t.shape) == 2:
            return _PackedReference(t)
        return t.dequantize()

    def linear(self, x, w):
        if isinstance(w, _PackedReference):
            return repack.reference(w.qtype, np.ascontiguousarray(x, np.float32), w.blocks)
        return super().linear(x, w)

    def linear_many(self, x, ws):
        return tuple(self.linear(x, w) for w in ws)

    def prepare_decoder(self, spec, layers, output_norm, output, rope):
        return None  # op by op: every product through `linear`


@pytest.fixture(scope="module")
def kquant_file(model_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("kquant") / "smollm2-kquant.gguf"
    types = write_kquant_copy(model_path, path)
    assert set(types.values()) == {"Q4_K", "Q6_K"}
    return path


@pytest.fixture(scope="module")
def model(kquant_file):
    return Model.load(GGUFFile.open(kquant_file), NumpyBackend(), max_positions=128)


def test_kquant_weights_are_repacked(model, kquant_file):
    """Every ffn_down is a K-quant (Q4_K or Q6_K), repacked (`repack`): the file's bytes
    regrouped by 16 columns, none lost."""
    downs = [layer.ffn_down for layer in model.layers]
    assert {w.qtype for w in downs} == {"Q4_K", "Q6_K"}
    f = GGUFFile.open(kquant_file)
    for i, w in enumerate(downs):
        blocks = np.asarray(f.tensor(f"blk.{i}.ffn_down.weight").blocks, np.uint8)
        assert isinstance(w, PackedWeight) and np.array_equal(repack.unpack(w.data, w.qtype, w.shape[0]), blocks)


def test_greedy_decode_equals_float32_reference(model, kquant_file):
    """16 greedy steps on 2 prompts: the same tokens, and every logit bit-identical."""
    ref = Model.load(GGUFFile.open(kquant_file), DequantizedBackend(), max_positions=128)
    for prompt in PROMPTS:
        got = run_batched(model, new_kv(model, 1), [prompt], STEPS, 0)[0]
        want = run_batched(ref, new_kv(ref, 1), [prompt], STEPS, 0)[0]
        assert [int(np.argmax(s)) for s in got] == [int(np.argmax(s)) for s in want]
        for s in range(STEPS + 1):
            assert np.array_equal(got[s], want[s]), f"step {s}"


def test_a_long_prompts_prefill_equals_float32_reference(model, kquant_file):
    """A 70-token prompt in one prefill (ffn_down's Q4_K and Q6_K products at 70 rows: on a
    CPU with AMX, `amx_tiles`' forms, from 64 and 16 rows) and 4 greedy steps: every logit
    bit-identical to the numpy reference's."""
    ref = Model.load(GGUFFile.open(kquant_file), DequantizedBackend(), max_positions=128)
    prompt = [int(t) for t in np.random.default_rng(5).integers(100, 40000, 70)]
    got = run_batched(model, new_kv(model, 1), [prompt], 4, 0)[0]
    want = run_batched(ref, new_kv(ref, 1), [prompt], 4, 0)[0]
    for s in range(5):
        assert np.array_equal(got[s], want[s]), f"step {s}"


def test_kquant_logits_bit_identical_alone_vs_batched(model):
    alone = [run_batched(model, new_kv(model, 1), [p], STEPS, 0)[0] for p in PROMPTS]
    together = run_batched(model, new_kv(model, 4), PROMPTS + [[57, 5248, 2090], [19556, 905, 30]], STEPS, 3)
    for i in range(len(PROMPTS)):
        for s in range(STEPS + 1):
            assert np.array_equal(alone[i][s], together[i][s]), f"seq {i} step {s}"
