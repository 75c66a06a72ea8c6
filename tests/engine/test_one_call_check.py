"""A one-call decode step unlike op by op is turned off by the start-up check
(engine/model/invariance.py `check_one_call_step`, engine/serving/engine.py): decoding
then runs op by op and gives its bits, and batching stays on."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from panechat.backends.cpu.numpy_backend import NumpyBackend
from panechat.engine.model.invariance import check_one_call_step
from panechat.engine.model.loader import load_model
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.sampling import SamplingParams

from ..model_runs import new_kv, run_batched


class OneLogitOff(NumpyBackend):
    """A broken one-call step: the real step's logits with the first of each row one ulp up."""

    calls = 0

    def run_decoder(self, *args):
        out = super().run_decoder(*args)
        if out is not None:
            self.calls += 1
            out[:, 0] = np.nextafter(out[:, 0], np.float32(np.inf))
        return out


@pytest.fixture
def llama(tiny):
    return tiny("llama", "Q8_0")[0]


def test_the_check_passes_a_right_step_and_finds_a_wrong_one(llama):
    right = load_model(llama, NumpyBackend(), max_positions=128).model
    assert right.decoder is not None and check_one_call_step(right, new_kv(right, 3)) is None
    wrong = load_model(llama, OneLogitOff(), max_positions=128).model
    problem = check_one_call_step(wrong, new_kv(wrong, 3))
    assert problem is not None and "differ from op by op" in problem
    assert wrong.decoder is not None  # the check only reports; the engine turns the step off


def test_the_engine_turns_a_wrong_step_off_and_decodes_op_by_op(llama, monkeypatch, caplog):
    be = OneLogitOff()
    lm = load_model(llama, be, max_positions=128)
    with caplog.at_level(logging.WARNING, logger="panechat.engine.serving.engine"):
        e = Engine(lm, EngineConfig(max_concurrent=2, ctx_size=128, kv_sessions=3)).start()
    try:
        assert lm.model.decoder is None and "differ from op by op" in lm.model.decoder_off
        assert [r.message for r in caplog.records if "one-call decode step turned off" in r.message]
        assert e.batching, e.invariance_problem  # op by op passed the invariance check
        assert any(line.startswith("decode step: op by op") for line in e.startup_lines())
        calls = be.calls
        got = [e.submit(prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=8)) for _ in range(2)]
        got = [g.result().token_ids for g in got]
        assert be.calls == calls  # run_decoder is never asked again
    finally:
        e.stop()
    monkeypatch.setenv("PANECHAT_CPU_STEP", "ops")
    ops = load_model(llama, NumpyBackend(), max_positions=128)
    assert ops.model.decoder is None
    e = Engine(ops, EngineConfig(max_concurrent=2, ctx_size=128, kv_sessions=3)).start()
    try:
        want = [e.submit(prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=8)).result().token_ids]
    finally:
        e.stop()
    assert got == want * 2
    # and every logit of a batched decode: op by op's bits
    mine = run_batched(lm.model, new_kv(lm.model, 2), [[5, 6, 7], [9, 10]], 6, 1)
    theirs = run_batched(ops.model, new_kv(ops.model, 2), [[5, 6, 7], [9, 10]], 6, 1)
    for a, b in zip(mine, theirs):
        for x, y in zip(a, b):
            assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
