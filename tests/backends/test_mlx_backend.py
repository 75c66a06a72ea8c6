"""The MLX backend (on whatever device MLX runs here; the CPU on Linux): accuracy against
the float64 reference and the numpy backend, quantized weights kept exact, batch
invariance, and llama.cpp's golden answers for the default model. See docs/mlx.md."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'panechat[mlx]')")

from panechat.backends.mlx.mlx_backend import ATTN_BLOCK, MLXBackend, MLXWeight  # noqa: E402
from panechat.backends.cpu.numpy_backend import StackedGemvBackend  # noqa: E402
from panechat.engine.gguf.file import GGUFFile  # noqa: E402
from panechat.engine.model.invariance import check_model_invariance  # noqa: E402
from panechat.engine.model.forward import Batch, Model  # noqa: E402

from ..model_runs import forward_chunks, golden_agreement  # noqa: E402
from ..tiny_gguf import reference_logits  # noqa: E402

ON_GPU = mx.default_device() == mx.gpu
# Q4_0/Q4_1/Q8_0 become MLX affine weights that dequantize to exactly the GGUF floats, so
# only float32 accumulation order differs from the reference: measured <= 6e-7 on the CPU.
REL_TOL = 1e-4 if ON_GPU else 2e-5

QTYPES = [("F32", True), ("Q8_0", False), ("Q4_1", True), ("Q4_0", False)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "phi3"])
@pytest.mark.parametrize("qtype,tied", QTYPES)
def test_mlx_matches_float64_reference(tiny, arch, qtype, tied):
    path, weights = tiny(arch, qtype, tied)
    model = Model.load(GGUFFile.open(path), MLXBackend(), max_positions=64)
    tokens = np.random.default_rng(1).integers(0, model.args.vocab_size, 23).tolist()
    ref = reference_logits(weights, arch, tokens)
    for chunk in (23, 5, 1):  # one prefill, chunked prefill, token by token
        got = forward_chunks(model, tokens, chunk)
        assert got.dtype == np.float32 and got.shape == ref.shape
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < REL_TOL, f"chunk {chunk}: relative error {err:.2e}"
        assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_1", 4), ("Q4_0", 4)])
def test_quantized_weights_stay_quantized_and_exact(tiny, qtype, bits):
    path, _ = tiny("llama", qtype, True)
    gf = GGUFFile.open(path)
    be = MLXBackend()
    model = Model.load(gf, be, max_positions=64)
    w = model.layers[0].ffn_gate
    assert isinstance(w, MLXWeight) and w.bits == bits and w.w.dtype == mx.uint32
    assert be.nbytes(w) < w.n * w.k * 4 / 2  # not float32
    assert isinstance(model.output, MLXWeight) and model.output.bits == bits  # tied output too
    deq = mx.dequantize(w.w, w.scales, w.biases, group_size=32, bits=bits)
    assert np.array_equal(np.array(deq), gf.tensor("blk.0.ffn_gate.weight").dequantize())


def test_float_types_load_as_float(tiny):
    path, _ = tiny("llama", "F32", True)
    model = Model.load(GGUFFile.open(path), MLXBackend(), max_positions=64)
    w = model.layers[0].attn_q
    assert w.bits == 0 and w.w.dtype == mx.float32


@pytest.mark.parametrize("arch,qtype,tied", [("llama", "Q4_1", True), ("qwen2", "Q8_0", False),
                                             ("llama", "F32", True)])
def test_mlx_and_numpy_backends_agree(tiny, arch, qtype, tied):
    path, _ = tiny(arch, qtype, tied)
    gf = GGUFFile.open(path)
    m_mlx = Model.load(gf, MLXBackend(), max_positions=64)
    m_np = Model.load(gf, StackedGemvBackend(), max_positions=64)  # no numba JIT here
    tokens = np.random.default_rng(2).integers(0, m_mlx.args.vocab_size, 20).tolist()
    a, b = forward_chunks(m_mlx, tokens, 20), forward_chunks(m_np, tokens, 20)
    assert (a.argmax(-1) == b.argmax(-1)).all()
    assert np.abs(a - b).max() / np.abs(b).max() < REL_TOL


# -- batch invariance ----------------------------------------------------------------------


def _batch(parts: list[tuple[int, list[int], int]]) -> Batch:
    """(slot, tokens, first position) per sequence -> one Batch, logits of each last row."""
    tokens, slots, positions, last = [], [], [], []
    for slot, toks, start in parts:
        tokens += toks
        slots += [slot] * len(toks)
        positions += range(start, start + len(toks))
        last.append(len(tokens) - 1)
    return Batch(np.asarray(tokens, np.int32), np.asarray(slots, np.int32),
                 np.asarray(positions, np.int32), np.asarray(last, np.int64))


@pytest.mark.parametrize("arch,qtype,tied", [("llama", "Q4_1", True), ("qwen2", "Q8_0", False),
                                             ("llama", "F32", True), ("gemma3", "Q8_0", True)])
def test_logits_identical_alone_and_batched(tiny, arch, qtype, tied):
    """4 sequences (one longer than an attention bucket): prefill, then 3 decode steps;
    each sequence's logits alone equal, bit for bit, its logits in a batch of all four
    at every row position (the batch order rotates each step)."""
    path, _ = tiny(arch, qtype, tied)
    model = Model.load(GGUFFile.open(path), MLXBackend(), max_positions=256)
    a = model.args
    rng = np.random.default_rng(5)
    lengths = [3, 7, 12, ATTN_BLOCK + 5]
    prompts = [rng.integers(0, a.vocab_size, n).tolist() for n in lengths]
    kv_alone = model.backend.new_kv(4, a.n_layer, a.n_kv_head, 256, a.head_dim)
    kv_batch = model.backend.new_kv(4, a.n_layer, a.n_kv_head, 256, a.head_dim)

    alone = [model.forward(kv_alone, _batch([(s, p, 0)]))[0] for s, p in enumerate(prompts)]
    batched = model.forward(kv_batch, _batch([(s, p, 0) for s, p in enumerate(prompts)]))
    for s in range(4):
        assert np.array_equal(alone[s], batched[s]), f"prefill of sequence {s}"
    nxt = [int(np.argmax(x)) for x in alone]
    for step in range(3):
        pos = [n + step for n in lengths]
        alone = [model.forward(kv_alone, _batch([(s, [nxt[s]], pos[s])]))[0] for s in range(4)]
        order = [(s + step + 1) % 4 for s in range(4)]  # every sequence visits other rows
        out = model.forward(kv_batch, _batch([(s, [nxt[s]], pos[s]) for s in order]))
        for row, s in enumerate(order):
            assert np.array_equal(alone[s], out[row]), f"step {step}: sequence {s} at row {row}"
        nxt = [int(np.argmax(x)) for x in alone]


def test_check_model_invariance_passes(tiny):
    path, _ = tiny("llama", "Q4_1", True)
    model = Model.load(GGUFFile.open(path), MLXBackend(), max_positions=256)
    a = model.args
    kv = model.backend.new_kv(3, a.n_layer, a.n_kv_head, 256, a.head_dim)
    assert check_model_invariance(model, kv) is None


def test_self_check_passes_and_can_fail(monkeypatch):
    be = MLXBackend()
    assert be.self_check() is None
    real = MLXBackend.linear

    def drifting(self, x, w):  # a kernel whose rows change with the batch size
        y = real(self, x, w)
        return y * (1 + 1e-6 * (x.shape[0] > 4))

    monkeypatch.setattr(MLXBackend, "linear", drifting)
    problem = be.self_check()
    assert problem and "differs" in problem


def test_copy_blocks(tiny):
    path, _ = tiny("llama", "Q4_0", False)
    model = Model.load(GGUFFile.open(path), MLXBackend(), max_positions=64)
    a = model.args
    kv = model.backend.new_kv(2, a.n_layer, a.n_kv_head, 64, a.head_dim)
    toks = list(range(40, 50))
    model.forward(kv, _batch([(0, toks, 0)]))
    per = kv.slot_blocks  # slot 1's blocks take a copy of slot 0's
    model.backend.copy_blocks(kv, list(range(per)), list(range(per, 2 * per)))
    x = model.forward(kv, _batch([(0, [7], len(toks))]))[0]
    y = model.forward(kv, _batch([(1, [7], len(toks))]))[0]
    assert np.array_equal(x, y)


def test_a_block_copy_writes_in_place():
    """copy_blocks writes the destination blocks into the stores' buffers: MLX allocates
    about the copied blocks, not a new store per layer (a scatter reading the store itself
    could copy every layer's whole store: 4-8 s a copy in a tiny model's engine at the
    default KV budget)."""
    be = MLXBackend()
    kv = be.new_paged_kv(2048, 2, 2, 64, "f16")  # 8 MiB a store
    rng = np.random.default_rng(5)
    for layer in range(2):
        for store in (kv.k[layer], kv.v[layer]):
            store[3] = be.asarray(rng.standard_normal(tuple(store.shape[1:]), dtype=np.float32).astype(np.float16))
    mx.eval(kv.k, kv.v)
    store_bytes = kv.k[0].nbytes
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    be.copy_blocks(kv, [3], [7])
    assert mx.get_peak_memory() - before < store_bytes // 16
    for layer in range(2):
        for store in (kv.k[layer], kv.v[layer]):
            assert np.array_equal(be.to_numpy(store[7]), be.to_numpy(store[3])) and be.to_numpy(store[3]).any()


def test_describe_names_device_and_policy():
    line = MLXBackend(policy="rowwise").describe()
    assert line.startswith("mlx") and ("cpu" in line or "Metal" in line) and "row-wise" in line
    assert "tiled" in MLXBackend(policy="tile").describe()
    with pytest.raises(ValueError):
        MLXBackend(policy="fast")


@pytest.mark.parametrize("policy", ["rowwise", "tile", "plain"])
def test_every_policy_is_correct(tiny, policy):
    """Whatever the policy, the numbers are right (invariance is the self-check's job)."""
    path, weights = tiny("qwen2", "Q4_1", True)
    be = MLXBackend(policy=policy)
    model = Model.load(GGUFFile.open(path), be, max_positions=64)
    tokens = list(range(50, 70))
    got, ref = forward_chunks(model, tokens, 7), reference_logits(weights, "qwen2", tokens)
    assert np.abs(got - ref).max() / np.abs(ref).max() < REL_TOL
    assert be.self_check() is None or (ON_GPU and policy != "rowwise")


# -- the default model against llama.cpp ------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_default_model(model_path):
    from panechat.engine.model.loader import load_model

    return load_model(model_path, MLXBackend(), max_positions=1024)


def _check_golden(lm, cases) -> None:
    agree, total, misses, gaps = golden_agreement(lm.model, cases)
    assert not misses, f"disagreements where llama.cpp's margin >= 0.5: {misses}"
    assert agree / total >= 0.93, f"top-1 agreement {agree}/{total}"
    assert np.median(gaps) < 0.3


def test_golden_teacher_forced_short_cases(mlx_default_model, golden):
    """The four shortest greedy cases (~240 tokens of prefill; the CPU MLX kernels run
    ~10 tokens/s here), teacher-forced in one pass each."""
    cases = sorted(golden["greedy"], key=lambda c: len(c["prompt_ids"]) + len(c["tokens"]))[:4]
    _check_golden(mlx_default_model, cases)


@pytest.mark.slow
def test_golden_teacher_forced_all_cases(mlx_default_model, golden):
    _check_golden(mlx_default_model, golden["greedy"])


def test_default_model_invariance(mlx_default_model):
    m = mlx_default_model.model
    kv = m.backend.new_kv(3, m.args.n_layer, m.args.n_kv_head, 64, m.args.head_dim)
    assert check_model_invariance(m, kv) is None
