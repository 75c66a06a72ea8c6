"""Prefix sharing never changes the answer: replies with shared KV blocks (full blocks
found by their token hash chain, copy-on-write of a partly matching block) equal replies
with sharing off and replies alone, bit for bit, greedy and seeded, on the default model."""

import time

import pytest

from panechat.backends.paged_kv import BLOCK_TOKENS
from panechat.engine.serving.sampling import SamplingParams

SYSTEM = {"role": "system", "content": "You are a careful assistant for a team of gardeners. " * 6}
QUESTIONS = ["Name a fruit.", "Name a flower.", "Name a fruit.", "Why do leaves fall?",
             "Name a tree that grows fast."]  # the repeat: an identical prompt, all but one token shared


def _msgs(q):
    return [SYSTEM, {"role": "user", "content": q}]


def _all_blocks_back(e):
    p = e.pool
    return p.in_use == 0 and not any(p.ref) and p.shared == 0


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24),
                                    SamplingParams(temperature=0.8, seed=7, max_tokens=24)],
                         ids=["greedy", "seeded-t0.8"])
def test_replies_with_sharing_equal_replies_without_and_alone(make_engine, params):
    alone = []
    for q in QUESTIONS:  # each on a fresh engine: nothing cached, nothing beside it
        e = make_engine(max_concurrent=1, prefix_caching=False, kv_sessions=1)
        alone.append(e.submit(_msgs(q), params=params).result().token_ids)

    off = make_engine(max_concurrent=5, prefix_caching=False)
    assert [g.result().token_ids for g in [off.submit(_msgs(q), params=params) for q in QUESTIONS]] == alone
    assert off.stats().prefix_cache_hits == 0

    on = make_engine(max_concurrent=5)
    first = on.submit(_msgs(QUESTIONS[0]), params=params).result()  # caches the shared prefix
    rest = [on.submit(_msgs(q), params=params) for q in QUESTIONS[1:]]  # batched, sharing it
    assert [first.token_ids] + [g.result().token_ids for g in rest] == alone
    reused = [g.finish.usage["reused_tokens"] for g in rest]
    n_prompt = [g.finish.usage["prompt_tokens"] for g in rest]
    assert min(reused) >= 2 * BLOCK_TOKENS  # several whole blocks shared ...
    assert any(r % BLOCK_TOKENS for r in reused)  # ... and copy-on-write inside a block
    assert reused[1] == n_prompt[1] - 1  # the identical prompt: everything but its last token
    s = on.stats()
    assert s.prefix_cache_hits == sum(reused) and s.kv_peak_in_use > 0
    assert _all_blocks_back(on) and _all_blocks_back(off)


def test_a_conversation_continues_on_its_own_cached_blocks(make_engine):
    """Turn 2 of a conversation reuses turn 1's full blocks (prompt and reply) and replies
    as a fresh engine does."""
    params = SamplingParams(max_tokens=20)
    hist = _msgs("Name a fruit.")

    def turn2(e):
        a1 = e.submit(hist, params=params, conversation="c").result()
        h2 = hist + [{"role": "assistant", "content": a1.text}, {"role": "user", "content": "And a vegetable?"}]
        return e.submit(h2, params=params, conversation="c").result()

    warm = make_engine(max_concurrent=2)
    got = turn2(warm)
    cold = make_engine(max_concurrent=2, prefix_caching=False)
    want = turn2(cold)
    assert got.token_ids == want.token_ids
    assert got.usage["reused_tokens"] >= got.usage["prompt_tokens"] - 2 * BLOCK_TOKENS
    assert want.usage["reused_tokens"] == 0
    want_cached = got.usage["prompt_tokens"] // BLOCK_TOKENS * BLOCK_TOKENS  # its whole prompt's full blocks
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the stats follow the finish within one engine loop turn
        idle = warm.stats().idle
        if idle and idle[0].conversation == "c" and idle[0].cached_tokens >= want_cached:
            break
        time.sleep(0.05)
    assert idle[0].conversation == "c" and idle[0].cached_tokens >= want_cached, idle
