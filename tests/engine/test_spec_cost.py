"""How the scheduler weighs drafts against their rows (engine/serving/speculation.py
`StepCost`, scheduler.py `_drafts`): a second request's drafts are weighed against the
step as already planned (the first one's drafts in it), and a policy too short for any
draft to pay grows until the runs that do pay are reached. No model: fake steps."""

from __future__ import annotations

from panechat.engine.kv.blocks import BlockPool
from panechat.engine.kv.manager import KVManager
from panechat.engine.serving.request import Request, RequestState
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.serving.scheduler import Scheduler
from panechat.engine.serving.speculation import K_START, Speculation, StepCost

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # "1 2" was followed by 3 4 5 ...


def _sure() -> Speculation:
    spec = Speculation(PROMPT, 1000)
    spec._hits, spec._misses = 50.0, 1.0  # nearly every draft stands
    return spec


def _decoding(s: Scheduler, n: int) -> list[Request]:
    """n requests prefilled (one fake step) and decoding, each with a sure Speculation."""
    reqs = [Request(id=f"r{i}", conversation=f"r{i}", prompt_ids=list(PROMPT), params=SamplingParams(max_tokens=64),
                    sampler=lambda logits: 0, emit=lambda ev: None, stop_ids=frozenset()) for i in range(n)]
    for r in reqs:
        r.spec = _sure()
        s.add(r)
    plan = s.schedule()
    s.kv.copies_done()
    for r, k in zip(plan.requests, plan.n_tokens):
        r.computed += k
        r.state = RequestState.DECODING
        r.output_ids.append(3)
    return reqs


def test_a_second_requests_drafts_are_weighed_against_the_step_as_planned():
    """Rows 2..5 cost one 2-row step more, 6..13 two more: the first request's 3 drafts pay
    (5 tokens for 2x), the second's would double the step again for 1.6x the tokens."""
    s = Scheduler(KVManager(BlockPool(32)), max_concurrent=4, max_queue=4, prefill_chunk=64)
    a, b = _decoding(s, 2)
    cost = StepCost()
    cost.record(2, 0.010)
    for rows in range(3, 6):
        cost.record(rows, 0.020, several=True)
    for rows in range(6, 14):
        cost.record(rows, 0.040, several=True)
    s.step_cost = cost
    plan = s.schedule()
    assert len(a.drafts) == K_START and b.drafts == []
    assert plan.n_tokens == [1 + K_START, 1]


def test_a_policy_too_short_to_pay_grows_to_the_runs_that_do():
    """One sequence where a verify step of k + 1 rows costs (2.5 + 0.5 k) steps (a dear
    second row): with drafts that nearly all stand, only k >= 4 pays; the policy starts at
    K_START (3) and grows."""
    spec = _sure()

    def worth(expected: float, k: int) -> float:
        return expected / (2.5 + 0.5 * k)

    assert spec.propose(8, worth) == []
    spec.accept([3], 0, 0)  # the step ran without drafts, and gave the token after "1 2"
    assert spec.propose(8, worth) == PROMPT[3:3 + K_START + 1]


def test_a_row_count_never_measured_is_read_off_the_draft_steps_line():
    """Draft steps of 3 and 5 rows measured (20 and 30 ms): 9 rows is about 50 ms, not
    'cheap'; before two counts are known it is assumed cheap, so it gets tried."""
    cost = StepCost()
    cost.record(1, 0.010)
    cost.record(3, 0.020, several=True)
    assert cost.ratio(1, 8) == 1.8  # one point: no line yet
    cost.record(5, 0.030, several=True)
    assert abs(cost.ratio(1, 8) - 5.0) < 0.3
    assert cost.ratio(1, 2) == 2.0 and cost.ratio(1, 4) == 3.0  # measured counts as measured
