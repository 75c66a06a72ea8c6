"""Scheduler and KV-slot bookkeeping without a model: small request builders, fake steps."""

import pytest

from panechat.engine.kv_slots import SlotPool
from panechat.engine.request import Request, RequestState
from panechat.engine.sampling import SamplingParams
from panechat.engine.scheduler import KVCopy, QueueFull, Scheduler


def req(rid, prompt, conversation=None, max_tokens=4):
    return Request(id=rid, conversation=conversation or rid, prompt_ids=list(prompt),
                   params=SamplingParams(max_tokens=max_tokens), sampler=lambda l: 0, decoder=None,
                   emit=lambda ev: None, stop_ids=frozenset())


def fake_step(sched, plan, next_token=7):
    """What the engine does after a forward pass: advance computed, sample when caught up."""
    for r, n in zip(plan.requests, plan.n_tokens):
        r.computed += n
        if r.computed == r.n_known:
            r.state = RequestState.DECODING
            r.output_ids.append(next_token)
            if len(r.output_ids) >= r.params.max_tokens:
                sched.finish(r)


def test_decode_rows_and_prefill_chunks_share_a_step():
    s = Scheduler(SlotPool(4), max_concurrent=4, max_queue=4, prefill_chunk=8)
    a = req("a", range(3))
    s.add(a)
    fake_step(s, s.schedule())  # a prefilled, now decoding
    b = req("b", range(100, 120))
    s.add(b)
    plan = s.schedule()
    assert [(r.id, n) for r, n in zip(plan.requests, plan.n_tokens)] == [("a", 1), ("b", 8)]
    fake_step(s, plan)
    plan = s.schedule()
    assert plan.n_tokens == [1, 8]  # b's prompt spread over steps, a decodes between


def test_admission_respects_max_concurrent_and_queue():
    s = Scheduler(SlotPool(4), max_concurrent=2, max_queue=1, prefill_chunk=64)
    for i in range(3):  # 2 can run + 1 may wait
        s.add(req(f"r{i}", [i, i + 1]))
    with pytest.raises(QueueFull):
        s.add(req("r3", [9]))
    plan = s.schedule()
    assert {r.id for r in plan.requests} == {"r0", "r1"} and len(s.waiting) == 1


def test_finished_request_frees_its_slot_for_the_waiting_one():
    pool = SlotPool(1)
    s = Scheduler(pool, max_concurrent=2, max_queue=2, prefill_chunk=64)
    a, b = req("a", [1, 2, 3], max_tokens=1), req("b", [4, 5])
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert plan.requests == [a]  # one slot only: b waits although concurrency allows 2
    fake_step(s, plan)
    assert a.state == RequestState.FINISHED and pool.in_use == 0
    assert s.schedule().requests == [b]


def test_a_shared_prefix_is_a_copy_in_the_plan_of_the_step_that_admits():
    pool = SlotPool(2)
    s = Scheduler(pool, max_concurrent=2, max_queue=2, prefill_chunk=64)
    a = req("a", [1, 2, 3, 4, 5], max_tokens=1)
    s.add(a)
    plan = s.schedule()
    assert plan.kv_copies == []  # nothing cached yet
    fake_step(s, plan)  # a finished: slot 0 keeps [1, 2, 3, 4, 5]
    b = req("b", [1, 2, 3, 8])
    s.add(b)
    plan = s.schedule()
    assert plan.kv_copies == [KVCopy(src=a.slot, dst=b.slot, n_tokens=3)] and b.slot != a.slot
    assert [(r.id, n) for r, n in zip(plan.requests, plan.n_tokens)] == [("b", 1)]  # only what was not copied
    fake_step(s, plan)
    assert s.schedule().kv_copies == []  # a copy is planned once


def test_max_seqs_per_step_limits_the_rows_but_not_admission_or_copies():
    pool = SlotPool(3)
    s = Scheduler(pool, max_concurrent=3, max_queue=3, prefill_chunk=64, max_seqs_per_step=1)
    first = req("first", [1, 2, 3, 4], max_tokens=1)
    s.add(first)
    fake_step(s, s.schedule())  # leaves [1, 2, 3, 4] cached in its slot
    a, b = req("a", [5, 6]), req("b", [1, 2, 3, 9])
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert plan.requests == [a] and plan.n_tokens == [2]
    assert b.state == RequestState.PREFILLING and pool.in_use == 2  # admitted, waits for its turn
    assert plan.kv_copies == [KVCopy(first.slot, b.slot, 3)]  # its copy is due now all the same
    fake_step(s, plan)
    plan = s.schedule()
    assert plan.requests == [a] and plan.kv_copies == []  # one sequence per step, in running order
    s.max_seqs_per_step = None
    assert [r.id for r in s.schedule().requests] == ["a", "b"]


def test_slot_keeps_history_and_next_turn_continues_in_it():
    pool = SlotPool(2)
    g = pool.acquire("c1", [1, 2, 3, 4])
    assert g.reuse == 0
    pool.release(g.slot, [1, 2, 3, 4, 9])
    g2 = pool.acquire("c1", [1, 2, 3, 4, 9, 10, 11])
    assert (g2.slot.index, g2.reuse, g2.copy_from) == (g.slot.index, 5, None)


def test_shared_prefix_is_copied_not_stolen():
    pool = SlotPool(2)
    g = pool.acquire("c1", [1, 2, 3, 4, 5])
    pool.release(g.slot, [1, 2, 3, 4, 5])
    g2 = pool.acquire("c2", [1, 2, 3, 8])  # shares 3 tokens with c1's history
    assert g2.slot is not g.slot and g2.reuse == 3 and g2.copy_from == g.slot.index
    assert g.slot.tokens == [1, 2, 3, 4, 5]  # c1's history intact


def test_lru_idle_slot_is_evicted_and_at_least_one_token_is_left_to_compute():
    pool = SlotPool(2)
    slot_of = {}
    for conv, toks in (("a", [1, 2]), ("b", [3, 4]), ("a", [1, 2, 7])):  # a used last
        g = pool.acquire(conv, toks)
        slot_of[conv] = g.slot.index
        pool.release(g.slot, toks)
    assert slot_of["a"] != slot_of["b"]
    g = pool.acquire("c", [5, 6])
    assert g.slot.index == slot_of["b"], "the least recently used slot (b's) is the one evicted"
    assert g.slot.conversation == "c" and pool.evictions == 1
    assert pool.slots[slot_of["a"]].tokens == [1, 2, 7]  # the recent conversation is intact
    pool.release(g.slot, [5, 6])
    same = pool.acquire("c", [5, 6])  # identical prompt: reuse all but the last token
    assert same.reuse == 1
    assert pool.acquire("x", [1]) is not None and pool.acquire("y", [1]) is None  # all busy
