"""The draft model's KV under pressure: with a KV budget too small for three replies at once
the scheduler preempts, and a preempted request gives its draft KV back (it is admitted
again when it drafts next); every reply is still the plain one, and at the end no draft
block is held."""

from __future__ import annotations

from dataclasses import replace

from panechat.backends.paged_kv import bytes_per_block
from panechat.engine.serving.engine import Engine, EngineConfig
from panechat.engine.serving.request import RequestState
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.serving.speculation import StepCost

TEXTS = ["apple, banana, cherry, apple, banana, cherry, apple,", "1 2 3 4 5 1 2 3 4 5 1 2 3",
         "The cat sat on the mat. The cat sat on the mat. The"]


class FreeRows(StepCost):
    def ratio(self, rows: int, extra: int) -> float:  # every draft tried, whatever the machine's load
        return 1.0


def test_preempted_requests_give_their_draft_kv_back(loaded_model, model_path):
    a = loaded_model.model.args
    blocks = 11  # each reply needs 5 (about 16 prompt tokens + 60): three at once do not fit
    cfg = EngineConfig(max_concurrent=3, ctx_size=256, kv_memory=blocks * bytes_per_block(
        a.n_layer, a.n_kv_head, a.head_dim, "f16"), spec="draft", draft_model=str(model_path))
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
    finally:
        e.stop()
