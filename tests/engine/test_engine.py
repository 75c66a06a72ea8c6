"""The engine end to end on the default model: concurrency never changes the answer,
and limits, cancellation and eviction never lose or leak anything."""

import asyncio
import random
import threading
import time

import pytest

from panechat.backends.paged_kv import BLOCK_TOKENS, bytes_per_block
from panechat.engine.serving.engine import Engine, EngineConfig, PromptTooLong, QueueFull
from panechat.engine.serving.events import FinishEvent, PrefillEvent, TokenEvent
from panechat.engine.serving.sampling import SamplingParams

QUESTIONS = ["Name a fruit.", "Why is the sky blue?", "Write a haiku about the sea.",
             "What is the capital of France?"]


def _msgs(q):
    return [{"role": "user", "content": q}]


def _solo(make_engine, params, questions=QUESTIONS):
    e = make_engine(max_concurrent=1)
    return [e.submit(_msgs(q), params=params).result() for q in questions]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=16),
                                    SamplingParams(temperature=0.8, seed=7, max_tokens=16)],
                         ids=["greedy", "seeded-t0.8"])
def test_concurrent_conversations_get_their_solo_tokens(make_engine, params):
    solo = _solo(make_engine, params)
    e = make_engine(max_concurrent=4)
    assert e.batching, e.invariance_problem
    gens = [e.submit(_msgs(q), params=params) for q in QUESTIONS]
    together = [g.result() for g in gens]
    assert [f.token_ids for f in together] == [f.token_ids for f in solo]
    assert max(i for i, n in enumerate(e.stats().step_hist) if n) == 4  # really batched


def test_a_failed_self_check_runs_one_sequence_per_step(make_engine, monkeypatch):
    monkeypatch.setattr("panechat.engine.serving.engine.check_model_invariance", lambda model, kv: "forced for the test")
    e = make_engine(max_concurrent=3)
    assert not e.batching and "NOT batched" in e.startup_lines()[-1]
    gens = [e.submit(_msgs(q), params=SamplingParams(max_tokens=6)) for q in QUESTIONS[:3]]
    assert all(g.result().reason in ("stop", "length") for g in gens)
    hist = e.stats().step_hist
    assert hist[1] > 0 and sum(hist[2:]) == 0, hist


def test_chunked_prefill_gives_the_same_reply(make_engine):
    long_q = "Summarize: " + " ".join(f"item {i} is a {['cat', 'dog', 'fish'][i % 3]}." for i in range(40))
    whole = make_engine(prefill_chunk=512).submit(_msgs(long_q), params=SamplingParams(max_tokens=12)).result()
    e = make_engine(prefill_chunk=16, max_concurrent=2)
    other = e.submit(_msgs("Name a river."), params=SamplingParams(max_tokens=40))
    gen = e.submit(_msgs(long_q), params=SamplingParams(max_tokens=12))
    events = list(gen.events())
    progress = [ev.done for ev in events if isinstance(ev, PrefillEvent)]
    assert len(progress) > 5 and progress == sorted(progress)  # prefilled in pieces
    assert events[-1].token_ids == whole.token_ids
    other.result()


def test_second_turn_reuses_the_cached_prefix(make_engine):
    e = make_engine()
    first = e.submit(_msgs("Name a fruit."), params=SamplingParams(max_tokens=12)).result()
    history = _msgs("Name a fruit.") + [{"role": "assistant", "content": first.text},
                                          {"role": "user", "content": "Another one."}]
    second = e.submit(history, params=SamplingParams(max_tokens=12)).result()
    assert second.usage["reused_tokens"] > first.usage["prompt_tokens"] - 2
    stats = e.stats()
    assert stats.reused_tokens >= second.usage["reused_tokens"]
    # the latest turn's whole prompt stays cached between turns (its full KV blocks), the
    # first turn's blocks within it (shared); the stats follow the finish within a loop turn
    want = second.usage["prompt_tokens"] // BLOCK_TOKENS * BLOCK_TOKENS
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (e.stats().idle and e.stats().idle[0].cached_tokens >= want):
        time.sleep(0.05)
    idle = e.stats().idle
    assert (idle[0].conversation, idle[0].cached_tokens >= want) == (second.request_id, True), idle


def test_a_prefix_copied_from_another_conversations_slot_gives_the_solo_reply(make_engine):
    params = SamplingParams(max_tokens=12)
    solo = make_engine().submit(_msgs("Why is the sky blue?"), params=params).result()
    e = make_engine()
    e.submit(_msgs("Name a fruit."), params=params, conversation="a").result()
    b = e.submit(_msgs("Why is the sky blue?"), params=params, conversation="b").result()
    assert b.usage["reused_tokens"] > 0  # the shared system prompt, copied from a's slot into b's
    assert b.token_ids == solo.token_ids


def test_evicted_conversation_comes_back_with_the_same_reply(make_engine, loaded_model):
    def conversation(e, first_q):
        a1 = e.submit(_msgs(first_q), params=SamplingParams(max_tokens=10), conversation="a").result()
        e.submit(_msgs("Interrupting question with quite a few more words in it, so that together with the "
                       "system prompt it fills almost all of the small KV budget of this test?"),
                 params=SamplingParams(max_tokens=10), conversation="b").result()  # 64 + 10 tokens
        hist = _msgs(first_q) + [{"role": "assistant", "content": a1.text}, {"role": "user", "content": "And then?"}]
        return e.submit(hist, params=SamplingParams(max_tokens=10), conversation="a").result()

    a = loaded_model.model.args
    block = bytes_per_block(a.n_layer, a.n_kv_head, a.head_dim, "f16")
    kept = conversation(make_engine(max_concurrent=1), "Name a planet.")
    evicting = make_engine(max_concurrent=1, kv_memory=5 * block)  # 80 tokens: b evicts a's first turn
    rebuilt = conversation(evicting, "Name a planet.")
    # Rebuilt: only the system prompt it shares with "b" is still cached.
    assert rebuilt.usage["reused_tokens"] < kept.usage["reused_tokens"] - 10
    assert evicting.stats().evictions >= 2
    assert rebuilt.token_ids == kept.token_ids


def test_full_queue_is_refused_at_once(make_engine):
    e = make_engine(max_concurrent=1, max_queue=1)
    e.metrics.record_finish("stop", 0.1, 2.0)  # the recent pace: 2 s a request
    running = e.submit(_msgs("Count to fifty."), params=SamplingParams(max_tokens=200))
    waiting = e.submit(_msgs("Hi"), params=SamplingParams(max_tokens=4))
    t = time.perf_counter()
    with pytest.raises(QueueFull, match="max-queue") as refused:
        e.submit(_msgs("Hi again"), params=SamplingParams(max_tokens=4))
    assert time.perf_counter() - t < 1.0
    # Retry-After: at least the one waiting request ahead, one at a time, at 2 s each
    assert refused.value.retry_after >= 2
    running.cancel()
    assert running.result().reason == "cancelled"
    assert waiting.result().reason in ("stop", "length")


def test_cancel_frees_the_slot(make_engine):
    e = make_engine(max_concurrent=2, kv_sessions=2)
    gen = e.submit(_msgs("Tell me a long story."), params=SamplingParams(max_tokens=300))
    for ev in gen.events():
        if isinstance(ev, TokenEvent):
            gen.cancel()
            break
    fin = gen.result()
    assert fin.reason == "cancelled" and 0 < len(fin.token_ids) < 300
    _wait_idle(e)
    assert e.stats().kv_in_use == 0


def test_a_generation_ended_by_a_shutdown_says_so(make_engine):
    """cancel(reason) ends running and queued generations with that reason (a server going
    away says 'shutdown', not 'cancelled'); the first cancel's reason wins."""
    e = make_engine(max_concurrent=1, kv_sessions=1, max_queue=2)
    running = e.submit(_msgs("Tell me a long story."), params=SamplingParams(max_tokens=300))
    queued = e.submit(_msgs("Hi"), params=SamplingParams(max_tokens=4))
    for ev in running.events():
        if isinstance(ev, TokenEvent):
            break
    running.cancel("shutdown")
    running.cancel()  # too late to change the reason
    queued.cancel("shutdown")
    fin = running.result()
    assert fin.reason == "shutdown" and 0 < len(fin.token_ids) < 300
    assert queued.result().reason == "shutdown"
    _wait_idle(e)
    assert e.stats().requests_finished["shutdown"] == 2


def test_prompt_longer_than_context_is_refused(make_engine):
    e = make_engine(ctx_size=64)
    with pytest.raises(PromptTooLong, match="ctx-size"):
        e.submit(_msgs("word " * 100))
    with pytest.raises(ValueError):
        e.submit([])
    with pytest.raises(ValueError):
        e.submit(_msgs("hi"), params=SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="seed"):
        e.submit(_msgs("hi"), params=SamplingParams(temperature=0.5, seed=0.5))


def test_stop_strings_end_the_reply_before_the_stop_text(make_engine):
    e = make_engine()
    full = e.submit(_msgs("What is the capital of France?"), params=SamplingParams(max_tokens=12)).result()
    word = full.text.split()[2]
    cut = e.submit(_msgs("What is the capital of France?"), params=SamplingParams(max_tokens=12),
                   stop=[word]).result()
    assert cut.reason == "stop" and word not in cut.text and full.text.startswith(cut.text)


def test_stress_random_requests_and_cancellations(make_engine):
    """40 requests from 8 threads, a third cancelled at random moments: every request
    ends (completed, cancelled or refused at once) and no slot or queue entry leaks."""
    e = make_engine(max_concurrent=4, kv_sessions=6, max_queue=6, ctx_size=256)
    rng = random.Random(5)
    outcomes, lock = [], threading.Lock()

    def client(seed):
        r = random.Random(seed)
        for _ in range(5):
            q = r.choice(QUESTIONS)
            try:
                gen = e.submit(_msgs(q), params=SamplingParams(max_tokens=r.randint(1, 8),
                                                               temperature=r.choice([0.0, 0.7]), seed=seed))
            except QueueFull:
                with lock:
                    outcomes.append("refused")
                continue
            cancel_after = r.randint(0, 4) if r.random() < 0.33 else None
            n = 0
            for ev in gen.events():
                n += isinstance(ev, TokenEvent)
                if cancel_after is not None and n >= cancel_after:
                    gen.cancel()
            with lock:
                outcomes.append(gen.finish.reason)

    threads = [threading.Thread(target=client, args=(rng.randrange(1 << 30),)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 40
    assert set(outcomes) <= {"stop", "length", "cancelled", "refused"}
    _wait_idle(e)
    s = e.stats()
    assert s.kv_in_use == 0 and s.queue_depth == 0 and not s.streams


def _wait_idle(e, timeout=5.0):
    end = time.time() + timeout
    while time.time() < end and (e.stats().kv_in_use or e.stats().streams):
        time.sleep(0.05)


def test_stats_show_a_stream_by_the_time_it_emits_anything(make_engine):
    """Stats are throttled while busy, but never so that a running generation reads as an
    idle engine: a client that saw a token and polls for idle must not pass straight through."""
    e = make_engine(max_concurrent=1)
    for _ in range(10):  # each submit lands just after the previous finish was published
        gen = e.submit(_msgs("Tell me a long story."), params=SamplingParams(max_tokens=200))
        ev = next(gen.events())
        assert isinstance(ev, (PrefillEvent, TokenEvent))
        s = e.stats()
        assert [st.id for st in s.streams] == [gen.id] and s.kv_in_use >= 1, s
        gen.cancel()
        assert gen.result().reason == "cancelled"
        _wait_idle(e)  # the FinishEvent comes first; the stats follow within one loop turn
        assert not e.stats().streams


def test_events_reach_the_reader_whichever_way_it_reads(make_engine):
    """A generation submitted off any event loop may be read on one, and one submitted on a
    loop may be read by a blocking thread: the reader picks, nothing is guessed at submit."""
    e = make_engine(max_concurrent=2)
    params = SamplingParams(max_tokens=6)
    plain = e.submit(_msgs("Name a fruit."), params=params)  # no loop running here

    async def read_async():
        return [ev async for ev in plain.aevents()]

    async def submit_on_loop_read_in_thread():
        gen = e.submit(_msgs("Name a fruit."), params=params)
        return await asyncio.wait_for(asyncio.to_thread(lambda: list(gen.events())), 60)

    async def both():
        return await asyncio.wait_for(read_async(), 60), await submit_on_loop_read_in_thread()

    via_loop, via_thread = asyncio.run(both())
    for events in (via_loop, via_thread):
        assert isinstance(events[-1], FinishEvent) and events[-1].reason in ("stop", "length")
        assert [ev.token_id for ev in events if isinstance(ev, TokenEvent) and ev.token_id >= 0] == \
            events[-1].token_ids
    assert via_loop[-1].token_ids == via_thread[-1].token_ids
    assert plain.finish is via_loop[-1]


def test_a_generation_whose_async_reader_and_loop_are_gone_is_cancelled(make_engine):
    e = make_engine(max_concurrent=1)
    gen = e.submit(_msgs("Tell me a long story."), params=SamplingParams(max_tokens=400))

    async def read_one():
        async for ev in gen.aevents():
            return ev

    asyncio.run(read_one())  # the loop closes with the generation still running
    _wait_idle(e)
    assert not e.stats().streams
    assert gen.result().reason == "cancelled"


def test_stop_finishes_every_generation_and_refuses_new_ones(loaded_model):
    e = Engine(loaded_model, EngineConfig(ctx_size=512)).start()
    gen = e.submit(_msgs("Tell me a long story."), params=SamplingParams(max_tokens=200))
    next(gen.events())
    e.stop()
    assert gen.result().reason == "cancelled"
    with pytest.raises(RuntimeError, match="stopped"):
        e.submit(_msgs("hi"))


def test_invalid_unicode_is_a_clear_value_error(make_engine):
    with pytest.raises(ValueError, match="surrogate"):
        make_engine().submit(_msgs("bad \ud800 text"))


def test_an_internal_error_fails_its_requests_and_the_engine_lives_on(make_engine, monkeypatch):
    e = make_engine()
    real = e.lm.model.forward
    calls = {"n": 0}

    def flaky(kv, batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real(kv, batch)

    monkeypatch.setattr(e.lm.model, "forward", flaky)
    fin = e.submit(_msgs("Name a fruit."), params=SamplingParams(max_tokens=4)).result()
    assert fin.reason == "error" and "simulated kernel failure" in fin.error
    assert e.submit(_msgs("Name a fruit."), params=SamplingParams(max_tokens=4)).result().reason in ("stop", "length")
    _wait_idle(e)
    assert e.stats().kv_in_use == 0
