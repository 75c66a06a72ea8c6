"""One KV memory budget: a request that can never fit is refused at once with a clear
error, admission waits for blocks, a decode that runs out of blocks preempts the youngest
(which is recomputed and answers the same), and every block comes back."""

import pytest

from panechat.backends.paged_kv import bytes_per_block
from panechat.engine.serving.engine import Engine, EngineConfig, KVBudgetTooSmall
from panechat.engine.serving.events import TokenEvent
from panechat.engine.serving.sampling import SamplingParams


def _msgs(q):
    return [{"role": "user", "content": q}]


@pytest.fixture
def engine_with_blocks(loaded_model):
    engines = []
    a = loaded_model.model.args
    block = bytes_per_block(a.n_layer, a.n_kv_head, a.head_dim, "f16")

    def make(n_blocks, **kw):
        e = Engine(loaded_model, EngineConfig(ctx_size=512, kv_memory=n_blocks * block, **kw)).start()
        engines.append(e)
        assert e.pool.n_blocks == n_blocks
        return e

    yield make
    for e in engines:
        e.stop()


def _all_blocks_back(e):
    p = e.pool
    return p.in_use == 0 and not any(p.ref) and p.shared == 0


def test_a_request_that_can_never_fit_is_refused_at_once(engine_with_blocks):
    e = engine_with_blocks(4)  # 64 tokens in all
    with pytest.raises(KVBudgetTooSmall, match="raise --kv-memory") as err:
        e.submit(_msgs("Hi"), params=SamplingParams(max_tokens=200))
    assert "\n" not in str(err.value)
    assert e.submit(_msgs("Hi"), params=SamplingParams(max_tokens=8)).result().reason in ("stop", "length")
    assert _all_blocks_back(e)


def test_running_out_of_blocks_preempts_and_the_answers_do_not_change(engine_with_blocks):
    """Four generations that together need more blocks than the budget: the youngest are
    preempted and recomputed; each reply equals its reply alone; nothing leaks."""
    qs = ["Tell me a story about a cat.", "Tell me a story about a dog.", "Count from one to forty.",
          "Describe the sea."]
    params = SamplingParams(max_tokens=60)
    alone = engine_with_blocks(64, max_concurrent=1, prefix_caching=False)
    want = [alone.submit(_msgs(q), params=params).result().token_ids for q in qs]
    e = engine_with_blocks(14, max_concurrent=4)  # each needs ~6 blocks
    gens = [e.submit(_msgs(q), params=params) for q in qs]
    got = [g.result() for g in gens]
    assert [f.token_ids for f in got] == want
    assert e.stats().preemptions >= 1
    assert _all_blocks_back(e) and e.pool.peak_in_use <= 14


def test_admission_waits_for_blocks_instead_of_failing(engine_with_blocks):
    e = engine_with_blocks(8, max_concurrent=4, prefix_caching=False)
    gens = [e.submit(_msgs(f"Say the number {i}."), params=SamplingParams(max_tokens=40)) for i in range(4)]
    assert all(g.result().reason in ("stop", "length") for g in gens)
    assert _all_blocks_back(e)


def test_cancel_and_errors_return_every_block(engine_with_blocks):
    e = engine_with_blocks(64, max_concurrent=3)
    long = e.submit(_msgs("Tell me a long story."), params=SamplingParams(max_tokens=300))
    failing = e.submit(_msgs("Tell me another long story."), params=SamplingParams(max_tokens=300))

    def boom(logits):
        raise RuntimeError("sampler broke")

    e._by_id[failing.id].sampler = boom  # its next sample fails this row alone
    for ev in long.events():
        if isinstance(ev, TokenEvent):
            long.cancel()
            break
    ok = e.submit(_msgs("Name a fruit."), params=SamplingParams(max_tokens=20))
    assert long.result().reason == "cancelled" and failing.result().reason == "error"
    assert ok.result().reason in ("stop", "length")
    assert _all_blocks_back(e) and e.stats().kv_in_use == 0
