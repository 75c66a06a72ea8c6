"""Penalties, logprobs and n samples in the engine, on the host-sampling numpy backend and the
device-sampling CuPy one (its numpy emulation): each penalized, biased or logprob row gives
the same tokens and logprobs alone and batched beside 3 other rows, bit for bit, greedy and
seeded; n samples of one prompt are the n seeds' own generations, over one prefill."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.invalid_request import InvalidRequest
from panechat.engine.serving.logits_processors import CountPenalty, RepeatPenalty, make_processors
from panechat.engine.serving.logprobs import log_softmax
from panechat.engine.serving.sampling import SamplingParams

PROMPTS = [[1, 90, 198, 26], [50, 23, 63], [28, 198, 66, 11, 216], [7, 7, 8, 9, 10, 11, 12]]
N = 10


def _run(lm, jobs, n=1):
    """The FinishEvents of each (prompt, params), all submitted together to a fresh engine
    (each job `n` samples: a list of FinishEvents then)."""
    eng = Engine(lm, EngineConfig(max_concurrent=8, ctx_size=64, verify_invariance=False)).start()
    try:
        gens = [eng.submit_n(n, prompt_ids=p, params=params) for p, params in jobs]
        fins = [[g.result() for g in gs] for gs in gens]
        assert all(f.reason in ("stop", "length") for fs in fins for f in fs), [f.error for fs in fins for f in fs]
        return fins if n > 1 else [fs[0] for fs in fins]
    finally:
        eng.stop()


SPREAD = {t: 100.0 for t in range(30, 40)}  # the tiny model is all but certain: 10 near-equal choices


def _asks(seed: int | None):
    """Rows asking for each field; seeded ones sample among the SPREAD tokens, so the seed matters."""
    base = dict(max_tokens=N, seed=seed, temperature=0.0 if seed is None else 10.0)
    bias = {} if seed is None else SPREAD
    return [SamplingParams(**base, frequency_penalty=1.5, presence_penalty=0.5, logit_bias=bias or None),
            SamplingParams(**base, repeat_penalty=1.8, repeat_last_n=4, logit_bias=bias or None),
            SamplingParams(**base, logit_bias={**bias, 5: -100.0, 9: 3.0, 33: -100.0}, logprobs=3),
            SamplingParams(**base, logprobs=0, prompt_logprobs=2, frequency_penalty=-1.0, logit_bias=bias or None)]


@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "seeded"])
def test_each_asking_row_is_the_same_alone_and_batched(tiny_lm, seed):
    others = [SamplingParams(max_tokens=N), SamplingParams(temperature=0.9, seed=3, max_tokens=N),
              SamplingParams(max_tokens=N, presence_penalty=2.0)]
    for i, asks in enumerate(_asks(seed)):
        alone = _run(tiny_lm, [(PROMPTS[0], asks)])[0]
        beside = _run(tiny_lm, [(PROMPTS[1], others[0]), (PROMPTS[2], others[1]), (PROMPTS[0], asks),
                                (PROMPTS[3], others[2])])
        assert beside[2].token_ids == alone.token_ids, f"ask {i}"
        assert beside[2].logprobs == alone.logprobs and beside[2].prompt_logprobs == alone.prompt_logprobs
        assert beside[1].token_ids == _run(tiny_lm, [(PROMPTS[2], others[1])])[0].token_ids
        if seed is not None:  # the seed matters: other ones give other replies
            again = _run(tiny_lm, [(PROMPTS[0], replace(asks, seed=seed + k)) for k in range(1, 5)])
            assert any(f.token_ids != alone.token_ids for f in again), f"ask {i}"


def test_penalties_change_the_greedy_reply_and_repeat_less(tiny_lm):
    plain = _run(tiny_lm, [(PROMPTS[3], SamplingParams(max_tokens=24))])[0].token_ids
    pen = _run(tiny_lm, [(PROMPTS[3], SamplingParams(max_tokens=24, frequency_penalty=2.0))])[0].token_ids
    rep = _run(tiny_lm, [(PROMPTS[3], SamplingParams(max_tokens=24, repeat_penalty=5.0, repeat_last_n=-1))])[0]
    assert len(set(plain)) < len(plain), "the plain greedy reply should repeat a token for this test to show"
    assert len(set(pen)) > len(set(plain)) and len(set(rep.token_ids)) > len(set(plain))


def test_logprobs_are_the_rows_log_softmax(tiny_lm):
    """Greedy: each token is its row's best, listed first in its top; the prompt logprobs
    of prompt + reply give the reply's own logprobs (the same logits, up to prefill vs decode
    rounding)."""
    fin = _run(tiny_lm, [(PROMPTS[1], SamplingParams(max_tokens=N, logprobs=4))])[0]
    assert [lp.token for lp in fin.logprobs] == fin.token_ids
    for lp in fin.logprobs:
        assert len(lp.top) == 4 and lp.top[0] == (lp.token, lp.logprob) and lp.logprob <= 0
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    whole = PROMPTS[1] + fin.token_ids
    again = _run(tiny_lm, [(whole, SamplingParams(max_tokens=1, prompt_logprobs=0))])[0]
    assert len(again.prompt_logprobs) == len(whole) - 1
    tail = again.prompt_logprobs[len(PROMPTS[1]) - 1:]
    assert [lp.token for lp in tail] == fin.token_ids
    assert np.allclose([lp.logprob for lp in tail], [lp.logprob for lp in fin.logprobs], atol=1e-3)


def test_n_samples_are_their_seeds_own_over_one_prefill(tiny_lm):
    spread = SPREAD
    params = SamplingParams(temperature=10.0, seed=40, max_tokens=N, logprobs=1, logit_bias=spread)
    prompt = [(7 * i) % 250 + 3 for i in range(37)]  # two full blocks and a partial one: the others share the full ones
    eng = Engine(tiny_lm, EngineConfig(max_concurrent=4, ctx_size=64, verify_invariance=False)).start()
    try:
        fins = [g.result() for g in eng.submit_n(3, prompt_ids=prompt, params=params)]
    finally:
        eng.stop()
    assert sum(f.usage["reused_tokens"] for f in fins[1:]) == 2 * 32  # the prompt's full blocks, shared
    solo = [_run(tiny_lm, [(prompt, SamplingParams(temperature=10.0, seed=40 + i, max_tokens=N, logprobs=1,
                                                           logit_bias=spread))])[0]
            for i in range(3)]
    assert [f.token_ids for f in fins] == [s.token_ids for s in solo]
    assert [f.logprobs for f in fins] == [s.logprobs for s in solo]
    assert len({tuple(f.token_ids) for f in fins}) > 1


def test_count_penalty_is_openais_definition():
    logits = np.zeros(6, np.float32)
    CountPenalty(0.5, 0.25).apply(logits, [2, 2, 4, 2], np)
    assert logits.tolist() == [0, 0, -(3 * 0.5 + 0.25), 0, -(0.5 + 0.25), 0]


def test_repeat_penalty_is_llama_cpps():
    logits = np.array([2.0, -2.0, 2.0, -2.0], np.float32)
    RepeatPenalty(2.0, 2).apply(logits, [0, 1, 2, 3, 3], np)  # the last 2: tokens 3 and 3
    assert logits.tolist() == [2.0, -2.0, 2.0, -4.0]
    RepeatPenalty(2.0, -1).apply(logits, [0, 1], np)
    assert logits.tolist() == [1.0, -4.0, 2.0, -4.0]


def test_neutral_values_add_no_processor():
    assert make_processors(SamplingParams(frequency_penalty=0.0, repeat_penalty=1.0), 10) == ()
    assert make_processors(SamplingParams(repeat_penalty=1.3, repeat_last_n=0), 10) == ()


@pytest.mark.parametrize("field,bad", [("frequency_penalty", 2.5), ("presence_penalty", -3.0),
                                       ("repeat_penalty", 0.0), ("repeat_last_n", -2), ("logprobs", 21)])
def test_out_of_range_is_refused(field, bad):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**{field: bad}).validate()


def test_log_softmax_sums_to_one():
    row = np.array([3.0, -1.0, 0.5, -np.inf], np.float32)
    lp = log_softmax(row)
    assert abs(np.exp(lp).sum() - 1.0) < 1e-12 and lp[3] == -np.inf


def test_prompt_logprobs_come_whole_when_the_prompt_is_cached(tiny_lm):
    """A prompt-logprobs request computes every prompt position, even one the prefix cache
    holds: the same logprobs as on a fresh engine."""
    prompt = [(5 * i) % 200 + 3 for i in range(40)]
    asks = SamplingParams(max_tokens=2, prompt_logprobs=1)
    fresh = _run(tiny_lm, [(prompt, asks)])[0]
    eng = Engine(tiny_lm, EngineConfig(max_concurrent=2, ctx_size=64, verify_invariance=False)).start()
    try:
        eng.submit(prompt_ids=prompt, params=SamplingParams(max_tokens=2)).result()
        cached = eng.submit(prompt_ids=prompt, params=asks).result()
    finally:
        eng.stop()
    assert cached.usage["reused_tokens"] == 0 and None not in cached.prompt_logprobs
    assert cached.prompt_logprobs == fresh.prompt_logprobs and len(fresh.prompt_logprobs) == len(prompt) - 1
