"""One request never takes its batch down: a poisonous parameter is either made harmless
(tiny temperature = greedy) or refused at submit, and a row that fails mid-generation
(its sampler raises, the model gives it NaN logits) fails alone. Every time, the four
innocent requests decoding in the same steps get exactly the tokens they get alone."""

from __future__ import annotations

import math

import numpy as np
import pytest

from panechat.engine.serving import engine as engine_mod
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.events import TokenEvent
from panechat.engine.serving.sampling import SamplingError, SamplingParams, make_sampler

INNOCENT = ["Why is the sky blue?", "Write a haiku about the sea.", "Tell me a story about a dragon.",
            "What do plants need to grow?"]
INNOCENT_PARAMS = SamplingParams(max_tokens=24)
BAD_PROMPT = "hi"
GREEDY8 = SamplingParams(max_tokens=8)


def _msgs(q):
    return [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def engines(loaded_model):
    """(solo, batched): one sequence at a time, and five at once."""
    solo = Engine(loaded_model, EngineConfig(max_concurrent=1, ctx_size=512)).start()
    batched = Engine(loaded_model, EngineConfig(max_concurrent=5, ctx_size=512)).start()
    assert batched.batching, batched.invariance_problem
    yield solo, batched
    solo.stop()
    batched.stop()


@pytest.fixture(scope="module")
def alone(engines):
    """alone(prompt, params) -> token ids of that request run on its own (cached)."""
    solo, _ = engines
    cache: dict = {}

    def get(prompt: str, params: SamplingParams) -> list[int]:
        if (prompt, params) not in cache:
            fin = solo.submit(_msgs(prompt), params=params).result()
            assert fin.reason in ("stop", "length"), fin.error
            cache[prompt, params] = fin.token_ids
        return cache[prompt, params]

    return get


def _start_innocents(e: Engine):
    """Submit the four innocent requests and wait until each is decoding (the repro: the
    bad request arrives mid-generation)."""
    gens = [e.submit(_msgs(q), params=INNOCENT_PARAMS) for q in INNOCENT]
    for g in gens:
        next(ev for ev in g.events() if isinstance(ev, TokenEvent))
    return gens


def _solo_innocents(alone) -> list[list[int]]:
    """Their solo replies, computed before the test starts its batch (and patches)."""
    return [alone(q, INNOCENT_PARAMS) for q in INNOCENT]


def _assert_untouched(gens, solo: list[list[int]]):
    fins = [g.result() for g in gens]
    assert [f.reason for f in fins] == ["length"] * 4, [f.error for f in fins]
    assert [f.token_ids for f in fins] == solo


def _shared_steps(e: Engine) -> int:
    return sum(e.stats().step_hist[5:])  # steps with all five rows


# (params, what the reply must equal: "greedy" = the greedy reply, "own" = its own solo run)
HARMLESS = {
    "temperature 5e-324": (SamplingParams(temperature=5e-324, max_tokens=8), "greedy"),
    "temperature 1e-320": (SamplingParams(temperature=1e-320, max_tokens=8), "greedy"),
    "temperature 9.9e-6": (SamplingParams(temperature=9.9e-6, seed=1, max_tokens=8), "greedy"),
    "temperature 10": (SamplingParams(temperature=10.0, seed=1, max_tokens=8), "own"),
    "top_p 1e-320": (SamplingParams(temperature=0.8, top_p=1e-320, seed=1, max_tokens=8), "greedy"),
    "min_p 0.9999999": (SamplingParams(temperature=1.0, min_p=0.9999999, seed=1, max_tokens=8), "greedy"),
    "top_k 10**30": (SamplingParams(temperature=0.8, top_k=10**30, seed=1, max_tokens=8), "own"),
    "seed 2**100": (SamplingParams(temperature=0.8, seed=2**100, max_tokens=8), "own"),
}


@pytest.mark.parametrize("name", list(HARMLESS))
def test_a_poisonous_parameter_is_harmless_and_the_batch_is_untouched(engines, alone, name):
    _, e = engines
    params, expect = HARMLESS[name]
    solo, want = _solo_innocents(alone), alone(BAD_PROMPT, GREEDY8 if expect == "greedy" else params)
    before = _shared_steps(e)
    gens = _start_innocents(e)
    fin = e.submit(_msgs(BAD_PROMPT), params=params).result()
    assert fin.reason in ("stop", "length"), fin.error
    assert fin.token_ids == want
    _assert_untouched(gens, solo)
    assert _shared_steps(e) > before  # the bad request really shared steps with the four


def test_a_huge_max_tokens_is_bounded_by_the_context(engines, alone):
    _, e = engines
    long_prompt = "Repeat after me: " + "la " * 462
    n_prompt = len(e.lm.prompt_ids(_msgs(long_prompt)))
    assert e.ctx - 30 < n_prompt < e.ctx - 1
    params = SamplingParams(max_tokens=10**12)
    solo, want = _solo_innocents(alone), alone(long_prompt, params)
    gens = _start_innocents(e)
    fin = e.submit(_msgs(long_prompt), params=params).result()
    assert fin.reason in ("stop", "length")
    assert fin.reason == "stop" or n_prompt + len(fin.token_ids) == e.ctx
    assert fin.token_ids == want
    _assert_untouched(gens, solo)


NOT_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", NOT_FINITE, ids=["nan", "inf", "-inf"])
def test_non_finite_floats_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize("kw,match", [
    ({"temperature": 10.5}, "temperature"), ({"temperature": -1e-320}, "temperature"),
    ({"temperature": "0.5"}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"min_p": 1.0}, "min_p"),
    ({"top_k": 2.5}, "top_k"), ({"top_k": -1}, "top_k"), ({"top_k": True}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 1.5}, "max_tokens"), ({"seed": -1}, "seed"),
])
def test_out_of_range_parameters_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw).validate()


def test_bad_input_is_refused_at_submit_while_the_batch_runs_on(engines, alone):
    _, e = engines
    solo = _solo_innocents(alone)
    gens = _start_innocents(e)
    for field in ("temperature", "top_p", "min_p"):
        for v in NOT_FINITE:
            with pytest.raises(ValueError, match=field):
                e.submit(_msgs(BAD_PROMPT), params=SamplingParams(**{field: v}))
    vocab = e.lm.model.args.vocab_size
    for ids in ([1, vocab], [-1, 2], [2**70], [1, 2.5], [True, 2]):
        with pytest.raises(ValueError, match="prompt_ids"):
            e.submit(prompt_ids=ids)
    _assert_untouched(gens, solo)


def test_prompt_ids_at_the_vocabulary_edges_are_accepted(engines):
    _, e = engines
    vocab = e.lm.model.args.vocab_size
    fin = e.submit(prompt_ids=[0, vocab - 1, 1], params=SamplingParams(max_tokens=2)).result()
    assert fin.reason in ("stop", "length"), fin.error


@pytest.mark.parametrize("bad_params", [GREEDY8, SamplingParams(temperature=0.8, seed=3, max_tokens=8)],
                         ids=["greedy", "sampled"])
def test_a_row_whose_sampler_raises_fails_alone(engines, alone, monkeypatch, bad_params):
    _, e = engines
    solo, want = _solo_innocents(alone), alone(BAD_PROMPT, bad_params)
    calls = {"n": 0}

    def failing(params):
        real = make_sampler(params)
        if params is not bad_params:
            return real

        def sampler(logits):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected sampler failure")
            return real(logits)
        return sampler

    monkeypatch.setattr(engine_mod, "make_sampler", failing)
    gens = _start_innocents(e)
    fin = e.submit(_msgs(BAD_PROMPT), params=bad_params).result()
    assert fin.reason == "error"
    assert "RuntimeError: injected sampler failure" in fin.error
    assert fin.token_ids == want[:2]  # the tokens before the failure
    _assert_untouched(gens, solo)


@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("bad_params", [GREEDY8, SamplingParams(temperature=0.8, seed=3, max_tokens=8)],
                         ids=["greedy", "sampled"])
def test_a_row_with_non_finite_logits_fails_alone(engines, alone, monkeypatch, bad_params, poison):
    _, e = engines
    solo, want = _solo_innocents(alone), alone(BAD_PROMPT, bad_params)
    real = e.lm.model.forward
    seen = {"rows": 0}

    def poisoned(kv, batch):  # the model, not the engine: the bad request's logits go bad
        logits = real(kv, batch)
        if kv is e.kv:
            # a request's last block is its own (a block being written is never shared)
            tables = [e.kv_manager.blocks(r.id) for r in e.scheduler.running if r.params is bad_params]
            bad_blocks = {t[-1] for t in tables if t}
            for i, s in enumerate(batch.slots[batch.logit_rows]):
                if bad_blocks & set(batch.block_tables[s].tolist()):
                    seen["rows"] += 1
                    if seen["rows"] >= 3:
                        logits[i, 7] = poison
        return logits

    gens = _start_innocents(e)
    monkeypatch.setattr(e.lm.model, "forward", poisoned)
    fin = e.submit(_msgs(BAD_PROMPT), params=bad_params).result()
    assert fin.reason == "error" and "non-finite logits" in fin.error
    assert fin.token_ids == want[:2]
    _assert_untouched(gens, solo)
    monkeypatch.undo()
    # the engine serves the same request normally afterwards
    assert e.submit(_msgs(BAD_PROMPT), params=bad_params).result().token_ids == want


@pytest.mark.parametrize("params", [GREEDY8, SamplingParams(temperature=10.0, seed=1),
                                    SamplingParams(temperature=1e-5, min_p=0.9999999, top_k=1, top_p=1e-320,
                                                   seed=1)],
                         ids=["greedy", "hot", "every-filter"])
def test_the_sampler_keeps_the_best_token_and_refuses_non_finite_logits(params):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 30, 1000).astype(np.float32)
    logits[123] = 3e38  # far above the rest: tiny temperatures must not overflow
    sample = make_sampler(params)
    assert sample(logits) == 123
    for bad in (np.nan, np.inf):
        poisoned = logits.copy()
        poisoned[5] = bad
        with pytest.raises(SamplingError, match="non-finite"):
            sample(poisoned)
    with pytest.raises(SamplingError):
        sample(np.full(1000, -np.inf, np.float32))
