"""Admission is fair across clients (engine/serving/fair_queue.py), without a model: a
light client beside a flooding one is admitted at once, FIFO holds within a client, and
the per-client cap refuses only the client past it."""

import pytest

from panechat.engine.kv.blocks import BlockPool
from panechat.engine.serving.fair_queue import FairQueue
from panechat.engine.serving.request import RequestState
from panechat.engine.serving.scheduler import ClientQueueFull, QueueFull

from .test_scheduler import fake_step, req, run_all, scheduler


def client_req(rid, client, prompt=(1, 2, 3), max_tokens=4):
    r = req(rid, prompt, max_tokens=max_tokens)
    r.client = client
    return r


def admitted_order(s, limit=1000):
    """Ids in the order the scheduler admits them, stepping until everything finished."""
    order = []
    for _ in range(limit):
        if not s.running and not s.waiting:
            return order
        plan = s.schedule()
        order += [r.id for r in s.running if r.id not in order]
        fake_step(s, plan)
    raise AssertionError("did not finish")


def test_a_light_client_is_admitted_before_a_flood_queued_ahead_of_it():
    s = scheduler(BlockPool(64), max_concurrent=2, max_queue=64, prefill_chunk=64)
    for i in range(10):
        s.add(client_req(f"b{i}", "bob", max_tokens=20))
    fake_step(s, s.schedule())  # b0, b1 run
    s.add(client_req("a0", "alice"))
    s.schedule()
    assert "a0" in {r.id for r in s.running}  # it took a place from bob's youngest, at once
    assert s.preemptions == 1 and [r.id for r in s.waiting][:1] == ["b1"]  # back at the head of bob's queue
    run_all(s)


def test_fifo_holds_within_a_client_and_clients_take_turns():
    s = scheduler(BlockPool(64), max_concurrent=1, max_queue=64, prefill_chunk=64)
    for i in range(3):
        s.add(client_req(f"b{i}", "bob"))
    for i in range(3):
        s.add(client_req(f"a{i}", "alice"))
    order = admitted_order(s)
    assert order == ["b0", "a0", "b1", "a1", "b2", "a2"]


def test_one_client_alone_is_served_in_arrival_order():
    s = scheduler(BlockPool(64), max_concurrent=2, max_queue=64, prefill_chunk=64)
    for i in range(8):
        s.add(client_req(f"r{i}", ""))
    assert admitted_order(s) == [f"r{i}" for i in range(8)]
    assert s.preemptions == 0


def test_no_place_is_taken_from_a_client_with_only_one():
    s = scheduler(BlockPool(64), max_concurrent=2, max_queue=64, prefill_chunk=64)
    s.add(client_req("b0", "bob", max_tokens=20))
    s.add(client_req("c0", "carol", max_tokens=20))
    fake_step(s, s.schedule())
    s.add(client_req("a0", "alice"))
    s.schedule()
    assert {r.id for r in s.running} == {"b0", "c0"} and s.preemptions == 0
    run_all(s)


def test_too_few_blocks_also_yield_to_a_client_with_none():
    pool = BlockPool(4)  # 16 tokens each block: bob's two requests hold all of them
    s = scheduler(pool, max_concurrent=4, max_queue=8, prefill_chunk=64)
    s.add(client_req("b0", "bob", prompt=range(30), max_tokens=2))
    s.add(client_req("b1", "bob", prompt=range(100, 130), max_tokens=2))
    fake_step(s, s.schedule())
    s.add(client_req("a0", "alice", prompt=range(200, 210), max_tokens=2))
    s.schedule()
    assert "a0" in {r.id for r in s.running} and s.preemptions == 1
    run_all(s)
    assert pool.in_use == 0


def test_the_per_client_cap_refuses_that_client_only():
    s = scheduler(BlockPool(64), max_concurrent=1, max_queue=8, prefill_chunk=64, max_queue_per_client=2)
    for i in range(3):  # one place free + 2 waiting
        s.add(client_req(f"b{i}", "bob"))
    with pytest.raises(ClientQueueFull) as e:
        s.add(client_req("b3", "bob"))
    assert "max-queue-per-client 2" in str(e.value) and "'bob'" in str(e.value)
    assert isinstance(e.value, QueueFull) and e.value.waiting == 3
    s.add(client_req("a0", "alice"))  # another client is still queued
    assert [r.client for r in s.waiting].count("alice") == 1


def test_fair_queue_bookkeeping():
    q = FairQueue()
    a, b, c = client_req("a", "x"), client_req("b", "x"), client_req("c", "y")
    for r in (a, b, c):
        q.append(r)
    assert len(q) == 3 and q.count("x") == 2 and q.clients() == 2
    assert q.head({"x": 0, "y": 0}) is a and q.head({"x": 1}) is c
    q.remove(b)
    assert b not in q and a in q and len(q) == 2
    q.pop(a)
    assert q.count("x") == 0 and q.clients() == 1 and list(q) == [c]
    with pytest.raises(ValueError):
        q.remove(a)
    assert c.state == RequestState.WAITING


def test_a_place_taken_for_another_client_changes_no_reply(make_engine):
    """On the real engine: alice's request takes a place from bob's youngest (preempted,
    recomputed later), and every reply, the preempted one's included, is its solo reply."""
    import time

    from panechat.engine.serving.sampling import SamplingParams
    from panechat.engine.serving.stats import StreamState

    from .test_engine import QUESTIONS, _msgs, _solo

    # bob's two first questions have long replies, so both still decode when alice comes (a
    # short one first finished as she arrived and left her a free place: no preemption)
    params = SamplingParams(max_tokens=64)
    asked = [QUESTIONS[1], QUESTIONS[2], QUESTIONS[0], QUESTIONS[3]]
    solo = _solo(make_engine, params, asked)
    e = make_engine(max_concurrent=2)
    bob = [e.submit(_msgs(q), params=params, client="bob") for q in asked[:3]]
    t0 = time.monotonic()
    while sum(1 for x in e.stats().streams if x.state == StreamState.DECODING and x.tokens >= 2) < 2:
        assert time.monotonic() - t0 < 60
        time.sleep(0.01)
    alice = e.submit(_msgs(asked[3]), params=params, client="alice")
    replies = [g.result() for g in (*bob, alice)]
    assert e.stats().preemptions >= 1
    assert [f.token_ids for f in replies] == [f.token_ids for f in solo]
