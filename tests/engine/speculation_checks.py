"""What the speculation tests share: an engine cost model that tries every draft, and the
check that drafts change no reply."""

from __future__ import annotations

from dataclasses import replace

from panechat.engine.serving.engine import Engine
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.serving.speculation import StepCost


class FreeRows(StepCost):
    """Extra rows cost nothing: every draft the n-grams offer is tried, whatever this
    machine's load (the cost model is tested on its own; with this, the identity)."""

    def ratio(self, rows: int, extra: int) -> float:
        return 1.0


def assert_drafts_change_nothing(e: Engine, prompts: list[list[int]], params: list[SamplingParams],
                                 labels: list[str] | None = None) -> None:
    """Each prompt with its params (`speculate` set here): the reply with drafts on, alone
    and four at a time (each beside 3 others), is the reply with drafts off, alone; and
    drafts stood (otherwise nothing was tested). `e` should try every draft (`FreeRows`)."""
    labels = labels or [f"prompt {i}" for i in range(len(prompts))]

    def one(p: list[int], q: SamplingParams, spec: bool) -> list[int]:
        return e.submit(prompt_ids=p, params=replace(q, speculate=spec)).result().token_ids

    plain = [one(p, q, False) for p, q in zip(prompts, params)]
    before = e.stats().spec_accepted
    alone = [one(p, q, True) for p, q in zip(prompts, params)]
    assert e.stats().spec_accepted > before
    batched = []
    for g in range(0, len(prompts), 4):
        gens = [e.submit(prompt_ids=p, params=replace(q, speculate=True))
                for p, q in zip(prompts[g:g + 4], params[g:g + 4])]
        batched += [x.result().token_ids for x in gens]
    for i, label in enumerate(labels):
        assert alone[i] == plain[i], f"{label} alone"
        assert batched[i] == plain[i], f"{label} batched"
