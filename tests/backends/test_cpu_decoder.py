"""The one-call decode step (backends/cpu/decoder.py) equals the op-by-op layers and head
bit for bit: logits and every layer's stored K and V, on the default model, a K-quant
copy of it and tiny models of every architecture (biases, q/k norms, post norms, gelu,
sliding windows, fused QKV), at 1..5 rows with shuffled block tables, f16 and f32 KV,
on one thread and on two; also steps where a sequence has several rows (a decode row and
its speculative drafts), which the step takes in one call. Both paths read one description of the layers
(`layer_spec.DecoderSpec`): the step takes each family's, and declines one with a feature
it does not implement."""

from __future__ import annotations

import dataclasses

import numba
import numpy as np
import pytest

from panechat.backends.cpu import decoder as cpu_decoder
from panechat.backends.cpu.numpy_backend import NumpyBackend
from panechat.backends.layer_spec import DecoderSpec
from panechat.backends.paged_kv import BLOCK_TOKENS
from panechat.engine.gguf.file import GGUFFile, ModelFileError
from panechat.engine.model import forward
from panechat.engine.model.decoder_spec import decoder_spec
from panechat.engine.model.forward import Batch, Model
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.serving.speculation import StepCost

from .kquant_model import write_kquant_copy

# each family on a shipped model's type (their kernels are in the cache `make setup` warms);
# the same families on types no shipped model uses compile cold for a minute: `slow`
TINY = [("llama", "Q8_0"), ("qwen2", "Q4_1"), ("qwen3", "Q8_0"), ("gemma3", "Q8_0"), ("phi3", "Q4_1"),
        pytest.param("qwen2", "Q5_1", marks=pytest.mark.slow), pytest.param("qwen3", "Q4_0", marks=pytest.mark.slow)]
# each family's features in its description, beside the defaults (the plain llama layer)
FAMILY = {"llama": {},
          "qwen2": dict(rope_style="neox", attn_q_bias=True, attn_k_bias=True, attn_v_bias=True),
          "qwen3": dict(rope_style="neox", attn_q_norm=True, attn_k_norm=True),
          "gemma3": dict(rope_style="neox", activation="gelu_tanh", attn_q_norm=True, attn_k_norm=True,
                         post_attention_norm=True, post_ffw_norm=True, embed_scale=8.0),
          "phi3": dict(rope_style="neox")}


def _tiny_model(tiny, arch: str, qtype: str) -> Model:
    path, _ = tiny(arch, qtype)
    return Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=128)


def _prepare(model: Model, spec: DecoderSpec):
    """The backend's one-call plan for `spec` with `model`'s weights (None: declined)."""
    layers = [{f.name: getattr(L, f.name) for f in dataclasses.fields(L)} for L in model.layers]
    return model.backend.prepare_decoder(spec, layers, model.output_norm, model.output, model.rope)


def _prefilled(model: Model, lengths: list[int], kv_dtype: str, seed: int):
    """A paged store whose sequences (one per length) own shuffled blocks, each prefilled
    op by op with random tokens: (kv, tables, next positions)."""
    a, be = model.args, model.backend
    rng = np.random.default_rng(seed)
    per = max(lengths) // BLOCK_TOKENS + 2
    n_blocks = per * len(lengths) + 3
    kv = be.new_paged_kv(n_blocks, a.n_layer, a.n_kv_head, a.head_dim, kv_dtype)
    tables = rng.permutation(n_blocks)[:per * len(lengths)].reshape(len(lengths), per).astype(np.int32)
    for s, n in enumerate(lengths):
        toks = rng.integers(0, a.vocab_size, n).astype(np.int32)
        model.forward(kv, Batch(toks, np.full(n, s, np.int32), np.arange(n, dtype=np.int32), np.array([n - 1]),
                                tables))
    return kv, tables, np.array(lengths, np.int32)


def _copy(be: NumpyBackend, kv, model: Model):
    a = model.args
    twin = be.new_paged_kv(kv.n_blocks, a.n_layer, a.n_kv_head, a.head_dim, kv.dtype)
    for mine, theirs in zip(twin.stacked, kv.stacked):
        mine[...] = theirs
    return twin


def _step_both_ways(model: Model, lengths: list[int], kv_dtype: str, seed: int):
    """(one-call logits, op-by-op logits, one-call KV, op-by-op KV) of one decode step."""
    kv, tables, pos = _prefilled(model, lengths, kv_dtype, seed)
    twin = _copy(model.backend, kv, model)
    R = len(lengths)
    order = np.random.default_rng(seed + 1).permutation(R).astype(np.int32)  # rows in any order
    toks = np.random.default_rng(seed + 2).integers(0, model.args.vocab_size, R).astype(np.int32)
    batch = Batch(toks, order, pos[order], np.arange(R), tables)
    assert model.decoder is not None
    fused = model.forward(kv, batch)
    plan, model.decoder = model.decoder, None
    try:
        ops = model.forward(twin, batch)
    finally:
        model.decoder = plan
    return fused, ops, kv, twin


def _assert_same(fused, ops, kv, twin):
    assert np.array_equal(fused.view(np.uint32), ops.view(np.uint32))
    for mine, theirs in zip(kv.stacked, twin.stacked):
        assert np.array_equal(mine.view(np.uint8), theirs.view(np.uint8))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_default_model_one_call_equals_ops(loaded_model, rows, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("one core")
    model = loaded_model.model
    was = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        _assert_same(*_step_both_ways(model, [9, 33, 17, 1, 40][:rows], "f16", seed=rows))
    finally:
        numba.set_num_threads(was)


def test_f32_store(loaded_model):
    _assert_same(*_step_both_ways(loaded_model.model, [5, 20, 16], "f32", seed=7))


@pytest.mark.parametrize("arch,qtype", TINY)
def test_tiny_architectures_one_call_equals_ops(tiny, arch, qtype):
    """The step takes each family's description and gives op by op's bits."""
    model = _tiny_model(tiny, arch, qtype)
    assert model.spec.features_set() == FAMILY[arch]
    assert model.decoder is not None and model.decoder.spec is model.spec
    for rows in (1, 4):
        _assert_same(*_step_both_ways(model, [7, 12, 3, 9][:rows], "f16", seed=rows))


@pytest.mark.parametrize("arch,qtype", TINY)
def test_the_step_declines_a_family_feature_it_lacks(tiny, monkeypatch, arch, qtype):
    """Were the step to lack one of a family's features (taken out of `IMPLEMENTS`), it
    declines that family; the model still loads and decodes op by op."""
    model = _tiny_model(tiny, arch, qtype)
    assert _prepare(model, model.spec) is not None
    implements = cpu_decoder.IMPLEMENTS
    for name, value in {"rope_style": model.spec.rope_style, **FAMILY[arch]}.items():
        # the step computing this feature for every value but the family's
        lacking = {**implements, name: tuple(v for v in implements[name] or () if v != value)}
        monkeypatch.setattr(cpu_decoder, "IMPLEMENTS", lacking)
        assert _prepare(model, model.spec) is None, name
    path, _ = tiny(arch, qtype)
    declined = Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=128)
    assert declined.decoder is None
    _, ops, _, _ = _step_both_ways(model, [7, 12], "f16", seed=5)
    kv, tables, pos = _prefilled(declined, [7, 12], "f16", seed=5)
    order = np.random.default_rng(6).permutation(2).astype(np.int32)
    toks = np.random.default_rng(7).integers(0, declined.args.vocab_size, 2).astype(np.int32)
    got = declined.forward(kv, Batch(toks, order, pos[order], np.arange(2), tables))
    assert np.array_equal(got.view(np.uint32), ops.view(np.uint32))


@dataclasses.dataclass(frozen=True)
class _WithAttentionSoftcap(DecoderSpec):
    """A family feature neither path knows (gemma2's attention logit softcap)."""

    attn_logit_softcap: float = 0.0


def test_a_feature_unknown_to_the_step_makes_it_decline(tiny, monkeypatch):
    model = _tiny_model(tiny, "gemma3", "Q8_0")
    unset = _WithAttentionSoftcap(**dataclasses.asdict(model.spec))
    assert _prepare(model, unset) is not None  # at its default the feature changes nothing
    capped = dataclasses.replace(unset, attn_logit_softcap=50.0)
    assert "attn_logit_softcap" in capped.unsupported_by(cpu_decoder.IMPLEMENTS)
    assert _prepare(model, capped) is None
    # the op-by-op pass refuses it too: the model does not load, rather than compute it wrongly
    monkeypatch.setattr(forward, "decoder_spec", lambda args, layers: _WithAttentionSoftcap(
        **dataclasses.asdict(decoder_spec(args, layers)), attn_logit_softcap=50.0))
    with pytest.raises(ModelFileError, match="attn_logit_softcap=50.0"):
        Model.load(GGUFFile.open(tiny("gemma3", "Q8_0")[0]), NumpyBackend(), max_positions=128)


def test_layers_unlike_each_other_run_op_by_op(tiny):
    """A vector some layers hold and others lack (`uneven_layers`): the step declines."""
    model = _tiny_model(tiny, "qwen3", "Q4_0")
    model.layers[1].attn_k_norm = None
    spec = decoder_spec(model.args, model.layers)
    assert spec.uneven_layers and not spec.attn_k_norm and spec.attn_q_norm
    assert _prepare(model, spec) is None


def test_kquant_model(model_path, tmp_path):
    path = tmp_path / "kquant.gguf"
    write_kquant_copy(model_path, path)
    model = Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=128)
    _assert_same(*_step_both_ways(model, [30, 8], "f16", seed=3))


@pytest.mark.parametrize("positions", [[6, 8], [7, 6, 7], list(range(6, 7 + cpu_decoder.MAX_RUN))],
                         ids=["gap", "repeat", "longer-than-MAX_RUN"])
def test_a_sequence_with_rows_the_step_does_not_take_runs_op_by_op(loaded_model, positions):
    """run_decoder declines (None) when a sequence's rows are not at distinct consecutive
    positions, or are more than MAX_RUN, having written nothing."""
    model = loaded_model.model
    kv, tables, pos = _prefilled(model, [6], "f16", seed=1)
    before = [a.copy() for a in kv.stacked]
    x = np.zeros((len(positions), model.args.n_embd), np.float32)
    out = model.backend.run_decoder(model.decoder, kv, x, np.zeros(len(positions), np.int32),
                                    np.array(positions, np.int32), tables)
    assert out is None
    assert all(np.array_equal(b, a) for b, a in zip(before, kv.stacked))


def _runs_both_ways(model: Model, lengths: list[int], runs: list[int], kv_dtype: str, seed: int):
    """(one-call logits, op-by-op logits, one-call KV, op-by-op KV) of one step in which
    sequence s has runs[s] rows at its next positions (a decode row and its drafts), the
    rows shuffled; the one-call logits straight from `run_decoder`, so a step it declined
    fails here rather than passing op by op."""
    kv, tables, pos = _prefilled(model, lengths, kv_dtype, seed)
    twin = _copy(model.backend, kv, model)
    seqs = np.repeat(np.arange(len(runs)), runs).astype(np.int32)
    positions = np.concatenate([np.arange(p, p + m) for p, m in zip(pos, runs)]).astype(np.int32)
    order = np.random.default_rng(seed + 1).permutation(len(seqs))  # a sequence's rows in any order too
    seqs, positions = seqs[order], positions[order]
    toks = np.random.default_rng(seed + 2).integers(0, model.args.vocab_size, len(seqs)).astype(np.int32)
    be = model.backend
    x = be.embed(model.token_embd, toks)
    if model.spec.embed_scale != 1.0:
        x = x * np.float32(model.spec.embed_scale)
    fused = be.run_decoder(model.decoder, kv, x, seqs, positions, tables)
    assert fused is not None, "the one-call step declined a sequence's consecutive rows"
    ops = model.layers_and_head(twin, x, seqs, positions, None, tables)
    return fused, ops, kv, twin


@pytest.mark.parametrize("threads", [1, 2])
def test_several_rows_of_a_sequence_one_call_equals_ops(loaded_model, threads):
    """Runs of 5, 1, 3 and 1 rows (a block edge inside the 5: positions 30..34), shuffled:
    op by op's logits and stored K/V bit for bit."""
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("one core")
    was = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        _assert_same(*_runs_both_ways(loaded_model.model, [30, 9, 17, 40], [5, 1, 3, 1], "f16", seed=11))
        _assert_same(*_runs_both_ways(loaded_model.model, [12], [cpu_decoder.MAX_RUN], "f16", seed=12))
    finally:
        numba.set_num_threads(was)


def test_several_rows_f32_store(loaded_model):
    _assert_same(*_runs_both_ways(loaded_model.model, [5, 20], [2, 4], "f32", seed=13))


@pytest.mark.parametrize("arch,qtype", [("qwen2", "Q4_1"), ("gemma3", "Q8_0")])
def test_tiny_architectures_several_rows(tiny, arch, qtype):
    """Biases (qwen2); q/k norms, post norms and a 5-position sliding window that the
    later rows of a run move past (gemma3)."""
    model = _tiny_model(tiny, arch, qtype)
    _assert_same(*_runs_both_ways(model, [7, 3, 12], [4, 1, 6], "f16", seed=14))


def test_check_rows_takes_consecutive_runs_only():
    """0: each sequence's rows at distinct consecutive positions in any order, at most
    max_run; 1: gaps, repeats or longer runs; negative: out of range."""
    tables = np.arange(8, dtype=np.int32).reshape(2, 4)  # 2 sequences x 4 blocks of BLOCK_TOKENS

    def check(seqs, pos, max_run=4):
        return cpu_decoder.check_rows(tables, np.array(seqs, np.int32), np.array(pos, np.int32), 8, BLOCK_TOKENS,
                                      4 * BLOCK_TOKENS, max_run)

    assert check([0, 1], [5, 9]) == 0
    assert check([0, 1, 0, 0], [7, 3, 5, 6]) == 0
    assert check([0, 0, 0, 0], [15, 16, 17, 18]) == 0  # across a block edge
    assert check([0, 0], [5, 7]) == 1
    assert check([0, 0, 0], [5, 6, 5]) == 1
    assert check([0, 0, 0, 0, 1], [5, 6, 7, 6, 1]) == 1  # count == span, but a repeat
    assert check([0] * 5, [1, 2, 3, 4, 5]) == 1
    assert check([0] * 5, [1, 2, 3, 4, 5], max_run=5) == 0
    assert check([0, 2], [1, 1]) == -1
    assert check([0, 0], [63, 64]) == -1
    bad = tables.copy()
    bad[1, 2] = 99
    assert cpu_decoder.check_rows(bad, np.array([1], np.int32), np.array([40], np.int32), 8, BLOCK_TOKENS,
                                  64, 4) == -2


class _FreeRows(StepCost):
    """Extra rows cost nothing: every draft the n-grams offer is tried."""

    def ratio(self, rows: int, extra: int) -> float:
        return 1.0


def test_an_engine_verifies_drafts_in_the_one_call_step(loaded_model, monkeypatch):
    """Every step where a sequence has several rows (the start-up self-check's k+1 rows,
    the verify steps of a repetitive reply) runs in one call, not op by op."""
    be, taken = loaded_model.model.backend, []
    real = be.run_decoder

    def spy(plan, kv, x, slots, positions, tables):
        out = real(plan, kv, x, slots, positions, tables)
        if len(np.unique(slots)) < len(slots):
            taken.append(out is not None)
        return out

    monkeypatch.setattr(be, "run_decoder", spy)
    e = Engine(loaded_model, EngineConfig(max_concurrent=2, ctx_size=256)).start()
    try:
        assert e.spec_problem is None and taken and all(taken)  # the self-check's
        checks = len(taken)
        e.scheduler.step_cost = _FreeRows()
        ids = e.completion_ids("1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2")
        fin = e.submit(prompt_ids=ids, params=SamplingParams(max_tokens=16)).result()
        assert fin.reason in ("stop", "length"), fin.error
        assert e.stats().spec_accepted > 0 and len(taken) > checks and all(taken)
    finally:
        e.stop()


def test_out_of_range_rows_are_refused(loaded_model):
    model = loaded_model.model
    kv, tables, pos = _prefilled(model, [6], "f16", seed=1)
    x = np.zeros((1, model.args.n_embd), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        model.backend.run_decoder(model.decoder, kv, x, np.array([0], np.int32),
                                  np.array([tables.shape[1] * BLOCK_TOKENS], np.int32), tables)


def test_ops_env_keeps_the_op_by_op_path(monkeypatch, tiny):
    monkeypatch.setenv("PANECHAT_CPU_STEP", "ops")
    path, _ = tiny("llama", "Q8_0")
    assert Model.load(GGUFFile.open(path), NumpyBackend(), max_positions=64).decoder is None
