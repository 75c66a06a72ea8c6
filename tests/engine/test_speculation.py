"""Speculative decoding keeps the answer (issue 27): with n-gram drafts on, every reply is
the token sequence plain decoding gives, greedy and seeded, alone and beside 3 others; and
the drafts are really used (accepted > 0), so these tests can fail."""

from __future__ import annotations

import pytest

from panechat.engine.model.invariance import check_speculation
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.serving.speculation import (K_MAX, K_START, AdaptiveK, NgramDrafter, Speculation, StepCost,
                                                 can_speculate)

from .speculation_checks import FreeRows, assert_drafts_change_nothing

#: Raw completions that repeat themselves, so n-gram drafts get accepted.
TEXTS = [
    "apple, banana, cherry, apple, banana, cherry, apple, banana, cherry, apple,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The",
    "1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2",
]
N = 20  # tokens per reply: short, the engine is shared by the module


def _greedy(spec: bool) -> SamplingParams:
    return SamplingParams(max_tokens=N, speculate=spec)


def _seeded(spec: bool, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0.8, seed=seed, speculate=spec)


@pytest.fixture(scope="module")
def engine(loaded_model):
    e = Engine(loaded_model, EngineConfig(max_concurrent=4, ctx_size=512)).start()
    e.scheduler.step_cost = FreeRows()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.completion_ids(t) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(engine, prompts):
    """Each prompt alone without speculation, greedy then seeded: the reference replies."""
    return {kind: [_reply(engine, p, params(False, i)) for i, p in enumerate(prompts)]
            for kind, params in (("greedy", lambda s, i: _greedy(s)), ("seeded", lambda s, i: _seeded(s, 7 + i)))}


def _reply(engine: Engine, ids: list[int], params: SamplingParams):
    fin = engine.submit(prompt_ids=ids, params=params).result()
    assert fin.reason in ("stop", "length"), fin.error
    return fin.token_ids


def _accepted(engine: Engine) -> int:
    return engine.stats().spec_accepted


def test_self_check_passes_on_the_default_model(engine):
    assert engine.spec_problem is None and engine.scheduler.speculate
    assert any("speculative decoding: n-gram" in line for line in engine.startup_lines())
    assert check_speculation(engine.lm.model, engine.kv) is None


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_alone_the_same_tokens_with_drafts_accepted(engine, prompts, plain, kind):
    before = _accepted(engine)
    for i, p in enumerate(prompts):
        params = _greedy(True) if kind == "greedy" else _seeded(True, 7 + i)
        assert _reply(engine, p, params) == plain[kind][i], f"prompt {i}"
    assert _accepted(engine) > before  # the drafts were used: otherwise nothing was tested


def test_batched_beside_three_others_the_same_tokens(engine, prompts, plain):
    """Four at once, greedy and seeded mixed, two with speculation and two without."""
    before = _accepted(engine)
    jobs = [(i, "greedy" if i % 2 == 0 else "seeded", i < 2) for i in range(4)]
    gens = []
    for i, kind, spec in jobs:
        params = _greedy(spec) if kind == "greedy" else _seeded(spec, 7 + i)
        gens.append(engine.submit(prompt_ids=prompts[i], params=params))
    for (i, kind, _), g in zip(jobs, gens):
        assert g.result().token_ids == plain[kind][i], f"prompt {i} ({kind})"
    assert _accepted(engine) > before


def test_logprobs_penalty_and_stop_string_see_the_accepted_tokens(engine, prompts):
    """Logprobs, a repeat penalty (history-dependent) and a stop string: the same with and
    without speculation."""
    outs = []
    for spec in (False, True):
        params = SamplingParams(max_tokens=N, repeat_penalty=1.05, logprobs=2, speculate=spec)
        fin = engine.submit(prompt_ids=prompts[0], params=params, stop=["cherry, apple"]).result()
        outs.append((fin.token_ids, fin.text, fin.reason, [(lp.token, lp.logprob) for lp in fin.logprobs]))
    assert outs[0] == outs[1]


def _tiny_replies_the_same_with_drafts(lm) -> None:
    """A tiny model's engine (every draft tried): the start-up check of k+1 rows passes, and
    greedy and seeded replies are the same with drafts on, alone and four at once."""
    e = Engine(lm, EngineConfig(max_concurrent=4, ctx_size=64, verify_invariance=False)).start()
    e.scheduler.step_cost = FreeRows()
    try:
        assert check_speculation(e.lm.model, e.kv) is None  # what the start-up check runs
        prompts = [[1, 90, 198, 26, 90, 198], [50, 23, 63, 50, 23], [28, 198, 66, 11], [7, 7, 7]]
        params = [SamplingParams(max_tokens=10, temperature=t, seed=s) for t, s in ((0.0, None), (0.8, 3))] * 2
        assert_drafts_change_nothing(e, prompts, params)
    finally:
        e.stop()


def test_tiny_model_on_numpy_and_emulated_cupy_the_same_tokens(tiny_lm):
    """The device-sampling path (CuPy's numpy emulation: picks keyed on (seed, step)) and the
    host one."""
    _tiny_replies_the_same_with_drafts(tiny_lm)


def test_tiny_model_on_mlx_the_same_tokens(tiny):
    """The MLX backend (the CPU here)."""
    pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'panechat[mlx]')")
    from panechat.backends.mlx.mlx_backend import MLXBackend
    from panechat.engine.model.loader import load_model

    path, _ = tiny("llama", "Q8_0")
    _tiny_replies_the_same_with_drafts(load_model(path, MLXBackend(), max_positions=64))


def test_spec_off_engine_never_drafts(loaded_model, prompts):
    e = Engine(loaded_model, EngineConfig(max_concurrent=1, ctx_size=256, spec="off")).start()
    try:
        _reply(e, prompts[3], SamplingParams(max_tokens=8))
        s = e.stats()
        assert s.spec_draft_tokens == 0 and s.spec_accepted == 0
        assert "speculative decoding: off (--spec off)" in e.startup_lines()
    finally:
        e.stop()


def test_config_refuses_draft_mode_in_one_line():
    with pytest.raises(ValueError, match="--spec draft needs --draft-model"):
        EngineConfig(spec="draft")
    with pytest.raises(ValueError, match=r"--draft-model drafts only with --spec draft \(not --spec off\)"):
        EngineConfig(spec="off", draft_model="x.gguf")
    with pytest.raises(ValueError, match="--spec must be one of"):
        EngineConfig(spec="eagle")


def test_ngram_drafter_proposes_what_followed_the_last_match():
    d = NgramDrafter([5, 6, 7, 8, 9, 5, 6])
    assert d.propose(3) == [7, 8, 9]  # "5 6" was followed by 7 8 9
    d.extend([1])
    assert d.propose(3) == []  # "6 1" and "5 6 1" never occurred before
    d.extend([5, 6, 7])
    assert d.propose(2) == [8, 9]  # "5 6 7": the latest earlier occurrence
    d.extend([2, 5, 6])
    assert d.propose(4) == [7, 2, 5, 6]  # the latest "5 6" wins over the first


def test_ngram_drafter_prefers_the_longest_suffix_seen_before():
    d = NgramDrafter([1, 2, 3, 4, 10, 7, 2, 3, 4, 11, 1, 2, 3, 4])
    assert d.propose(1) == [10]  # "1 2 3 4" once, followed by 10; the later "2 3 4" by 11


def test_ngram_drafter_goes_on_with_the_copy_in_progress():
    passage = [1, 2, 3, 4, 5, 6, 7, 8]
    prompt = [9, *passage, 20, 0, *passage, 30]  # the passage twice, continued differently
    d = NgramDrafter([*prompt, 9, 1])
    assert d.propose(3) == [2, 3, 4]  # "9 1" only at the start: the copy starts there
    d.extend(passage[1:])
    assert d.propose(1) == [20]  # the copy goes on, though the latest "1 .. 8" ends in 30
    assert NgramDrafter([*prompt, 9, *passage]).propose(1) == [30]  # no copy in progress: the latest


def test_adaptive_k_grows_on_hits_and_pauses_on_misses():
    k = AdaptiveK()
    assert k.next_k() == K_START
    for _ in range(10):
        k.observe(k.next_k(), k.k)
    assert k.k == K_MAX
    k.observe(K_MAX, 2)
    assert k.next_k() == 3  # one more than the accepted ones
    k.observe(3, 0)
    assert k.next_k() == 1  # halved
    k.observe(1, 0)
    assert [k.next_k() for _ in range(2)] == [0, 1]  # paused a step, then one draft again
    k.observe(1, 0)
    assert [k.next_k() for _ in range(3)] == [0, 0, 1]  # a longer pause after another miss
    k.observe(1, 1)
    assert k.next_k() == 2
    k.observe(2, 0)
    k.observe(1, 0)
    assert [k.next_k() for _ in range(2)] == [0, 1]  # the hit reset the pause


def test_only_history_free_processors_allow_drafts(engine):
    from panechat.engine.serving.logits_processors import make_processors

    vocab = engine.lm.model.args.vocab_size
    assert can_speculate(make_processors(SamplingParams(repeat_penalty=1.1, logit_bias={1: 1.0}), vocab), True)
    assert not can_speculate(make_processors(SamplingParams(frequency_penalty=0.5), vocab), True)
    assert not can_speculate((), False)


def test_step_cost_weighs_drafts_against_their_rows():
    cost = StepCost()
    assert cost.ratio(1, 4) == pytest.approx(1.4)  # never measured: assumed cheap, so it is tried
    cost.record(1, 0.010)
    cost.record(2, 0.012)  # two sequences' decode rows: the one-call step
    for rows, seconds in ((2, 0.025), (3, 0.027), (4, 0.028), (5, 0.030)):
        cost.record(rows, seconds, several=True)  # one sequence's rows: op by op
    assert cost.ratio(1, 1) == pytest.approx(2.5) and cost.ratio(1, 4) == pytest.approx(3.0)
    assert cost.ratio(2, 2) == pytest.approx(0.028 / 0.012)

    def worth(e, k):  # one sequence alone: its expected tokens against the step's cost
        return e / cost.ratio(1, k)

    sure = Speculation([7, 8, 9, 10, 11, 7, 8, 9], 1000)
    sure._hits, sure._misses = 50.0, 1.0  # nearly every draft stands
    assert sure.propose(8, worth) == [10, 11, 7]  # K_START rows for ~4 tokens: worth 2.8x the cost
    unsure = Speculation([7, 8, 9, 10, 11, 7, 8, 9], 1000)
    unsure._hits, unsure._misses = 1.0, 1.0
    assert unsure.propose(8, worth) == []  # one token expected from two and a half steps' cost
    assert unsure.propose(8) == [10, 11, 7]  # without a cost model: what the n-grams offer


def test_a_multi_row_difference_turns_speculation_off(loaded_model, monkeypatch):
    """The self-check can fail: attention that drifts by one ulp when a sequence has several
    rows in the step (single decode steps untouched) is caught, and the engine decodes
    without drafts, saying so."""
    import numpy as np

    be = loaded_model.model.backend
    real = be.rope_attend

    def drifting(kv, layer, q, *rest):
        out = real(kv, layer, q, *rest)
        seqs = np.asarray(rest[2])
        _, at, counts = np.unique(seqs, return_inverse=True, return_counts=True)
        several = (counts[at] > 1) & (counts[at] <= 5)  # the check's k+1 rows, not a long prefill chunk
        if several.any():
            out = out.copy()
            out[several] = np.nextafter(out[several], np.float32(np.inf))
        return out

    monkeypatch.setattr(be, "rope_attend", drifting)
    e = Engine(loaded_model, EngineConfig(max_concurrent=2, ctx_size=128)).start()
    try:
        assert e.spec_problem and "differ from" in e.spec_problem and not e.scheduler.speculate
        assert any(line.startswith("speculative decoding: off, the self-check failed") for line in e.startup_lines())
    finally:
        e.stop()


def test_engine_stats_show_each_streams_acceptance(engine, prompts):
    gen = engine.submit(prompt_ids=prompts[0], params=SamplingParams(max_tokens=40))
    seen = set()
    for ev in gen.events():
        for s in engine.stats().streams:
            if s.id == gen.id:
                seen.add(s.spec_acceptance)
    assert any(a is not None and 0 < a <= 1 for a in seen), seen
