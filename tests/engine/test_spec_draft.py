"""The draft model's KV under pressure: with a KV budget too small for three replies at once
the scheduler preempts, and a preempted request gives its draft KV back (it is admitted
again when it drafts next); every reply is still the plain one, and at the end no draft
block is held."""

from __future__ import annotations

from dataclasses import replace

from panechat.backends.paged_kv import bytes_per_block
from panechat.engine.serving.draft_model import ModelDraft
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.request import RequestState
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.serving.speculation import Speculation, StepCost

TEXTS = ["apple, banana, cherry, apple, banana, cherry, apple,", "1 2 3 4 5 1 2 3 4 5 1 2 3",
         "The cat sat on the mat. The cat sat on the mat. The"]


class FreeRows(StepCost):
    def ratio(self, rows: int, extra: int) -> float:  # every draft tried, whatever the machine's load
        return 1.0

    def seconds(self, rows: int) -> float:  # and the draft model's passes too (unmeasured: not weighed)
        return 0.0


def test_preempted_requests_give_their_draft_kv_back(loaded_model, model_path):
    a = loaded_model.model.args
    blocks = 11  # each reply needs 5 (about 16 prompt tokens + 60): three at once do not fit
    per = bytes_per_block(a.n_layer, a.n_kv_head, a.head_dim, "f16")  # the target's, and its own draft's
    cfg = EngineConfig(max_concurrent=3, ctx_size=256, kv_memory=blocks * 2 * per, spec="draft",
                       draft_model=str(model_path))
    e = Engine(loaded_model, cfg).start()
    e.scheduler.step_cost = FreeRows()
    draft, problems = e.draft, []
    run = draft.run

    def checked_run(wants, live):  # after each drafting pass: only decoding requests hold draft KV
        run(wants, live)
        for r in list(e.scheduler.running) + list(e.scheduler.waiting):
            if r.spec is not None and r.spec.drafter.admitted and r.state != RequestState.DECODING:
                problems.append(f"{r.id} holds draft KV while {r.state.name}")

    draft.run = checked_run
    try:
        params = SamplingParams(max_tokens=60, temperature=0)
        ids = [e.completion_ids(t) for t in TEXTS]
        plain = [e.submit(prompt_ids=p, params=replace(params, speculate=False)).result().token_ids for p in ids]
        gens = [e.submit(prompt_ids=p, params=params) for p in ids]
        got = [g.result().token_ids for g in gens]
        assert got == plain
        assert e.scheduler.preemptions > 0 and e.stats().spec_accepted > 0
        assert problems == []
        assert draft.held == 0 and draft.pool.in_use == 0
        assert e.pool.n_blocks == draft.pool.n_blocks == blocks  # the budget holds both models' blocks
    finally:
        e.stop()


def test_extend_keeps_the_draft_kv_of_the_drafts_that_stood():
    d = ModelDraft("r", [1, 2, 3])
    d.computed, d.proposal = 5, [7, 8, 9]  # after drafting 3: positions 3, 4 hold drafts 7, 8
    d.extend([7, 4])  # the first stood, the target picked 4 instead of 8
    assert (d.tokens, d.computed, d.proposal) == ([1, 2, 3, 7, 4], 4, [])
    d.computed, d.proposal = 6, [5, 6]
    d.extend([5, 6, 0])  # every draft stood: all its draft KV holds true tokens
    assert (d.tokens, d.computed) == ([1, 2, 3, 7, 4, 5, 6, 0], 6)


def test_wanted_computes_only_drafts_that_pay():
    s = Speculation([1, 2, 3], 100, ModelDraft("r", [1, 2, 3]))
    assert s.wanted(10) == s.policy.k > 0  # no cost model: the policy's k
    assert s.wanted(10, lambda expected, k: 0.9) == 0  # nothing pays: the draft model is not run
    assert s.wanted(10, lambda expected, k: expected / (1 + 0.1 * k)) == s.policy.k
    assert s.wanted(1, lambda expected, k: expected) == 1  # bounded by the room
