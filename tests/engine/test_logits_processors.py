"""The logits-processor seam: a processor changes its own row only, before the sampler, on
the host (numpy backend) and on the device (the CuPy backend over its numpy emulation).
Proved with logit_bias: a banned token never comes, a forced one always does, and a row
with a processor gives the same tokens alone and batched beside rows without, whose
tokens do not change either."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import panechat.engine.serving.engine as engine_mod
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.invalid_request import InvalidRequest
from panechat.engine.serving.logits_processors import LogitBias, make_processors, step_processors
from panechat.engine.serving.sampling import SamplingParams

PROMPTS = [[1, 90, 198, 26], [50, 23, 63], [28, 198, 66, 11, 216]]
N = 8


def _run(lm, jobs: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """The token ids of each (prompt, params), all submitted together to a fresh engine."""
    eng = Engine(lm, EngineConfig(max_concurrent=len(jobs), ctx_size=64, verify_invariance=False)).start()
    try:
        gens = [eng.submit(prompt_ids=p, params=params) for p, params in jobs]
        fins = [g.result() for g in gens]
        assert all(f.reason in ("stop", "length") for f in fins), [f.error for f in fins]
        return [list(f.token_ids) for f in fins]
    finally:
        eng.stop()


PARAMS = [SamplingParams(max_tokens=N), SamplingParams(temperature=1.3, top_k=50, seed=5, max_tokens=N)]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_a_banned_token_never_comes_and_batching_changes_nothing(tiny_lm, params):
    plain = _run(tiny_lm, [(p, params) for p in PROMPTS])
    banned = sorted(set(plain[0]))
    assert banned
    biased = replace(params, logit_bias={t: -100.0 for t in banned})
    launches = getattr(getattr(tiny_lm.model.backend, "kernels", None), "module", None)  # emulated CUDA
    if launches is not None:
        launches.launches.clear()
    alone = _run(tiny_lm, [(PROMPTS[0], biased)])[0]
    assert alone and not set(alone) & set(banned)
    if launches is not None:  # each token picked on the device (a launch picks a row each: drafts' too)
        assert sum(grid[0] for name, grid in launches.launches if name == "sample_rows") >= len(alone)
    beside = _run(tiny_lm, [(PROMPTS[1], params), (PROMPTS[0], biased), (PROMPTS[2], params)])
    assert beside == [plain[1], alone, plain[2]]  # its own tokens alone, the others' unchanged


def test_a_forced_token_always_comes(tiny_lm):
    vocab = tiny_lm.model.args.vocab_size
    forced = SamplingParams(temperature=1.0, seed=1, max_tokens=N, logit_bias={7: 100.0, vocab - 3: -5.0})
    got = _run(tiny_lm, [(PROMPTS[2], SamplingParams(max_tokens=N)), (PROMPTS[1], forced)])
    assert got[1] == [7] * N
    assert got[0] == _run(tiny_lm, [(PROMPTS[2], SamplingParams(max_tokens=N))])[0]


class FailsOnThirdToken:
    def apply(self, logits, output_ids, xp):
        if len(output_ids) == 2:
            raise RuntimeError("injected processor failure")


def test_a_row_whose_processor_raises_fails_alone(tiny_lm, monkeypatch):
    greedy = SamplingParams(max_tokens=N)
    bad = SamplingParams(max_tokens=N, logit_bias={})
    want = _run(tiny_lm, [(p, greedy) for p in PROMPTS])
    real = engine_mod.make_processors
    monkeypatch.setattr(engine_mod, "make_processors",
                        lambda params, vocab: (FailsOnThirdToken(),) if params is bad else real(params, vocab))
    eng = Engine(tiny_lm, EngineConfig(max_concurrent=3, ctx_size=64, verify_invariance=False)).start()
    try:
        gens = [eng.submit(prompt_ids=PROMPTS[0], params=greedy), eng.submit(prompt_ids=PROMPTS[1], params=bad),
                eng.submit(prompt_ids=PROMPTS[2], params=greedy)]
        fins = [g.result() for g in gens]
    finally:
        eng.stop()
    assert fins[1].reason == "error" and "RuntimeError: injected processor failure" in fins[1].error
    assert fins[1].token_ids == want[1][:2]
    assert [fins[0].token_ids, fins[2].token_ids] == [want[0], want[2]]


def test_step_processors_touch_their_rows_only():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 50)).astype(np.float32)
    before = logits.copy()
    bias = {3: -100.0, 17: 2.5}
    procs = step_processors([((), [1]), ((LogitBias(bias),), [2]), ((), []), ((LogitBias(bias), FailsOnThirdToken()),
                                                                             [4, 5])])
    procs(logits, np)
    assert np.array_equal(logits[[0, 2]], before[[0, 2]])  # bit for bit
    alone = before[1:2].copy()
    step_processors([((LogitBias(bias),), [2])])(alone, np)
    assert np.array_equal(logits[1], alone[0]) and not np.array_equal(logits[1], before[1])
    assert logits[1, 17] == np.float32(before[1, 17] + np.float32(2.5))
    procs.check(1)
    with pytest.raises(RuntimeError, match="injected"):
        procs.check(3)
    assert step_processors([((), [1]), ((), [])]) is None  # no processor: nothing to do


@pytest.mark.parametrize("bias", [{"3": 1.0}, {True: 1.0}, {-1: 1.0}, {3: 100.5}, {3: float("nan")},
                                  {3: "1"}, [(3, 1.0)]])
def test_a_bad_logit_bias_is_refused(bias):
    with pytest.raises(InvalidRequest, match="logit_bias must map token ids"):  # a 400, not a bug
        SamplingParams(logit_bias=bias).validate()


def test_a_logit_bias_outside_the_vocabulary_is_refused():
    SamplingParams(logit_bias={0: -100, 99: 100}).validate()
    assert len(make_processors(SamplingParams(logit_bias={99: 1.0}), 100)) == 1
    assert make_processors(SamplingParams(logit_bias={}), 100) == ()
    with pytest.raises(InvalidRequest, match="logit_bias names token 100 but the vocabulary holds ids 0 to 99"):
        make_processors(SamplingParams(logit_bias={100: 1.0}), 100)
