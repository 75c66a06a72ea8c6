"""Scheduler and KV block bookkeeping without a model: small request builders, fake steps."""

import pytest

from panechat.backends.paged_kv import BLOCK_TOKENS

from panechat.engine.kv.blocks import BlockPool
from panechat.engine.kv.manager import KVManager
from panechat.engine.serving.request import Request, RequestState
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.serving.scheduler import BlockCopy, QueueFull, Scheduler


def req(rid, prompt, conversation=None, max_tokens=4):
    return Request(id=rid, conversation=conversation or rid, prompt_ids=list(prompt),
                   params=SamplingParams(max_tokens=max_tokens), sampler=lambda l: 0,
                   emit=lambda ev: None, stop_ids=frozenset())


def scheduler(pool, **kw):
    """A Scheduler over `pool` (through a KVManager, no snapshots), noting the block table
    each plan gives a request (`tables`: a finished request's table is gone from the
    manager, its blocks stay cached)."""
    s = Scheduler(KVManager(pool), **kw)
    s.tables = {}
    return s


def blocks(s, r):
    """r's block table: the manager's while r holds blocks, else the last plan's."""
    return s.kv.blocks(r.id) or s.tables.get(r.id, [])


def fake_step(sched, plan, next_token=7):
    """What the engine does with a plan: the copies, then after the forward pass advance
    computed and sample when caught up."""
    sched.kv.copies_done()
    assert len(plan.block_tables) == len(plan.requests)
    for r, n, table in zip(plan.requests, plan.n_tokens, plan.block_tables):
        assert r.computed + n <= len(table) * BLOCK_TOKENS  # the plan's table holds the row's positions
        sched.tables[r.id] = list(table)
        r.computed += n
        if r.computed == r.n_known:
            r.state = RequestState.DECODING
            r.output_ids.append(next_token)
            if len(r.output_ids) >= r.params.max_tokens:
                sched.finish(r)


def run_all(s, limit=1000):
    """Schedule and fake-step until nothing runs or waits."""
    for _ in range(limit):
        if not s.running and not s.waiting:
            return
        fake_step(s, s.schedule())
    raise AssertionError("did not finish")


def all_free(pool):
    return pool.in_use == 0 and not any(pool.ref) and pool.shared == 0


def test_decode_rows_and_prefill_chunks_share_a_step():
    s = scheduler(BlockPool(16), max_concurrent=4, max_queue=4, prefill_chunk=8)
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
    s = scheduler(BlockPool(16), max_concurrent=2, max_queue=1, prefill_chunk=64)
    for i in range(3):  # 2 can run + 1 may wait
        s.add(req(f"r{i}", [i, i + 1]))
    with pytest.raises(QueueFull):
        s.add(req("r3", [9]))
    plan = s.schedule()
    assert {r.id for r in plan.requests} == {"r0", "r1"} and len(s.waiting) == 1


def test_admission_waits_for_blocks_and_a_finished_request_frees_them():
    pool = BlockPool(2)
    s = scheduler(pool, max_concurrent=2, max_queue=2, prefill_chunk=64)
    a, b = req("a", range(20), max_tokens=1), req("b", range(100, 110))
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert plan.requests == [a] and len(blocks(s, a)) == 2  # b waits although concurrency allows 2
    fake_step(s, plan)
    assert a.state == RequestState.FINISHED and pool.in_use == 0
    assert s.schedule().requests == [b]
    run_all(s)
    assert all_free(pool)


def test_full_blocks_of_a_finished_request_are_shared_by_the_next():
    pool = BlockPool(16)
    s = scheduler(pool, max_concurrent=2, max_queue=2, prefill_chunk=64)
    a = req("a", range(40), max_tokens=1)
    s.add(a)
    fake_step(s, s.schedule())
    b = req("b", list(range(32)) + [900, 901])
    s.add(b)
    plan = s.schedule()
    assert blocks(s, b)[:2] == blocks(s, a)[:2] and b.computed == b.reused == 32 and plan.kv_copies == []
    assert [(r.id, n) for r, n in zip(plan.requests, plan.n_tokens)] == [("b", 2)]
    c = req("c", list(range(32)) + [700])
    s.add(c)
    s.schedule()
    assert blocks(s, c)[:2] == blocks(s, a)[:2] and pool.shared == 2  # held by b and c
    run_all(s)
    assert all_free(pool) and pool.hits == 64


def test_a_partly_matching_cached_block_is_copied_on_write():
    pool = BlockPool(16)
    s = scheduler(pool, max_concurrent=2, max_queue=2, prefill_chunk=64)
    a = req("a", range(48), max_tokens=1)
    s.add(a)
    fake_step(s, s.schedule())  # three full blocks cached
    b = req("b", list(range(40)) + [999] * 10)
    s.add(b)
    plan = s.schedule()
    assert blocks(s, b)[:2] == blocks(s, a)[:2] and blocks(s, b)[2] != blocks(s, a)[2]
    assert plan.kv_copies == [BlockCopy(blocks(s, a)[2], blocks(s, b)[2])] and b.computed == 40
    assert s.schedule().kv_copies == []  # a copy is planned once
    same = req("same", range(48))  # identical prompt: all but the last token, via a copy
    s.add(same)
    plan = s.schedule()
    assert same.computed == 47 and plan.kv_copies == [BlockCopy(blocks(s, a)[2], blocks(s, same)[2])]
    run_all(s)
    assert all_free(pool)


def test_max_seqs_per_step_limits_the_rows_but_not_admission_or_copies():
    pool = BlockPool(8)
    s = scheduler(pool, max_concurrent=3, max_queue=3, prefill_chunk=64, max_seqs_per_step=1)
    first = req("first", range(20), max_tokens=1)
    s.add(first)
    fake_step(s, s.schedule())  # leaves block 0 ([0..15]) cached
    a, b = req("a", [50, 51]), req("b", list(range(10)) + [77])
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert plan.requests == [a] and plan.n_tokens == [2]
    assert b.state == RequestState.PREFILLING  # admitted, waits for its turn
    assert plan.kv_copies == [BlockCopy(blocks(s, first)[0], blocks(s, b)[0])]  # its copy is due now all the same
    fake_step(s, plan)
    plan = s.schedule()
    assert plan.requests == [a] and plan.kv_copies == []  # one sequence per step, in running order
    s.max_seqs_per_step = None
    assert [r.id for r in s.schedule().requests] == ["a", "b"]


def test_idle_cached_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(6)
    s = scheduler(pool, max_concurrent=1, max_queue=4, prefill_chunk=64)
    a, b, a2 = req("a", range(32), max_tokens=1), req("b", range(100, 132), max_tokens=1), req("a2", range(32), max_tokens=1)
    for r in (a, b, a2):  # a used last (a2 is the same prompt: it shares a's blocks)
        s.add(r)
        run_all(s)
    assert a2.reused == 31 and len(pool.idle) == 4 and len(pool.free) == 2 and pool.evictions == 0
    s.add(req("c", range(200, 233), max_tokens=1))  # 3 blocks: 2 free + 1 evicted
    run_all(s)
    assert pool.evictions == 1  # b's tail block: least recently used, a sequence's tail before its head
    assert pool.key[blocks(s, a)[0]] is not None and pool.key[blocks(s, a)[1]] is not None  # a's blocks kept
    d = req("d", list(range(100, 132)) + [6])
    s.add(d)
    run_all(s)
    assert d.reused == 16 and all_free(pool)


def test_an_ended_sequences_partly_filled_block_is_a_copy_source_for_its_next_turn():
    pool = BlockPool(8)
    s = scheduler(pool, max_concurrent=1, max_queue=2, prefill_chunk=64)
    t1 = req("t1", range(30), max_tokens=5)  # computes 34 positions: 2 full blocks + 2 tokens
    s.add(t1)
    run_all(s)
    t2 = req("t2", t1.known[:34] + [50, 51, 52])
    s.add(t2)
    plan = s.schedule()
    assert t2.computed == 34 and plan.kv_copies == [BlockCopy(blocks(s, t1)[2], blocks(s, t2)[2])]
    run_all(s)
    assert all_free(pool)


def test_a_decode_that_runs_out_of_blocks_preempts_the_youngest_and_recomputes_it():
    pool = BlockPool(3)
    s = scheduler(pool, max_concurrent=2, max_queue=2, prefill_chunk=64)
    a, b = req("a", range(15), max_tokens=20), req("b", range(50, 64), max_tokens=20)
    s.add(a)
    s.add(b)
    seen_waiting = False
    for _ in range(200):
        if not s.running and not s.waiting:
            break
        plan = s.schedule()
        seen_waiting |= b.state == RequestState.WAITING
        assert a in plan.requests or a.state == RequestState.FINISHED  # the oldest always progresses
        fake_step(s, plan)
    assert seen_waiting and s.preemptions >= 1 and b.preemptions >= 1
    assert len(a.output_ids) == len(b.output_ids) == 20
    assert all_free(pool)


def test_cancelled_and_failed_requests_return_their_blocks():
    pool = BlockPool(8)
    s = scheduler(pool, max_concurrent=3, max_queue=3, prefill_chunk=64)
    a, b, c = req("a", range(40)), req("b", range(40)), req("c", range(5))
    for r in (a, b, c):
        s.add(r)
    fake_step(s, s.schedule())
    s.finish(a)  # cancelled: its full blocks stay cached
    s.finish(b, keep_cache=False)  # failed: its KV is dropped
    s.finish(c)
    assert all_free(pool)


def test_a_copy_source_that_does_not_fit_beside_the_prompt_is_recomputed_instead():
    """The copy-on-write source is held until the copy is done; when the budget cannot hold
    it beside the new prompt's blocks, admission skips the copy rather than wait forever."""
    pool = BlockPool(3)
    s = scheduler(pool, max_concurrent=1, max_queue=2, prefill_chunk=64)
    s.add(req("a", range(40), max_tokens=1))
    run_all(s)  # blocks 0..1 of a cached
    b = req("b", list(range(20)) + [500] * 27, max_tokens=1)  # 47 tokens: all 3 blocks
    s.add(b)
    plan = s.schedule()
    assert plan.requests == [b] and plan.kv_copies == [] and b.computed == 16
    run_all(s)
    assert all_free(pool)
