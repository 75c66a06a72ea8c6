"""The KV manager without a model: collision-resistant prefix-cache keys, snapshot restore
at admission inside the plan, evicted KV exported before anything writes into it, and one
digest per block (never per token)."""

from __future__ import annotations

import sys

import pytest

from panechat.backends.paged_kv import BLOCK_TOKENS as B
from panechat.engine.kv import blocks as blocks_module
from panechat.engine.kv.blocks import BlockPool
from panechat.engine.kv.manager import BlockCopy, KVManager
from panechat.engine.serving.request import Request, RequestState
from panechat.engine.serving.sampling import SamplingParams
from panechat.engine.serving.scheduler import Scheduler

#: Two different first blocks (token ids < 32000, valid for the default model's vocabulary)
#: with one CPython hash(): a birthday search over 2**26 random 15-token prefixes, the 16th
#: token solved (tuplehash adds the last item's hash(int) == int before a bijection, so two
#: prefixes whose states differ by k * XXPRIME_2, k < 32000, collide with last tokens k, 0).
COLLIDING = (
    (26494, 3293, 13008, 18656, 20811, 26511, 8597, 23427, 22888, 4935, 22994, 20322, 15115, 30335, 1460, 10069),
    (29256, 2873, 29670, 23578, 1080, 18529, 14054, 31632, 4200, 3904, 28399, 6478, 3248, 3828, 26031, 0),
)
TAIL = list(range(2000, 2000 + B)) + [7]  # the same second block and one more token after either


def req(rid, prompt, max_tokens=1):
    return Request(id=rid, conversation=rid, prompt_ids=list(prompt), params=SamplingParams(max_tokens=max_tokens),
                   sampler=lambda logits: 0, emit=lambda ev: None, stop_ids=frozenset())


def cache(kv, rid, tokens):
    """Admit `tokens` as sequence `rid`, compute them all, free it: its blocks stay cached."""
    got = kv.admit(rid, tokens)
    kv.copies_done()
    blocks = list(kv.blocks(rid))
    kv.free(rid, len(tokens), lambda start, n: tokens[start:start + n])
    return got, blocks


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="the collision is CPython's tuple hash")
def test_the_pair_collides_under_the_old_keys():
    a, b = COLLIDING
    assert a != b and max(a + b) < 32000 and min(a + b) >= 0
    assert hash(a) == hash(b)
    # the old scheme: block 2 was cached under (hash((parent, block 1 tokens)), block 2 tokens)
    tail = tuple(TAIL[:B])
    assert (hash((0, a)), tail) == (hash((0, b)), tail)


def test_two_token_chains_with_equal_builtin_hash_share_no_blocks():
    """Under the old keys the second sequence found the first one's second block (KV
    computed after other tokens); under blake2b chain digests it finds nothing of it."""
    a, b = COLLIDING
    kv = KVManager(BlockPool(8))
    _, first = cache(kv, "a", list(a) + TAIL)
    got = kv.admit("b", list(b) + TAIL)
    mine = kv.blocks("b")
    assert not set(mine) & set(first)
    assert got.computed == 0 and got.copies == []  # (their first tokens differ: nothing to copy either)


def test_a_chain_is_found_again_by_the_same_tokens_only():
    kv = KVManager(BlockPool(8))
    seq = list(range(100, 100 + 2 * B)) + [1]
    _, first = cache(kv, "a", seq)
    got = kv.admit("same", seq)
    assert kv.blocks("same")[:2] == first[:2] and got.computed == 2 * B
    other = seq[:B] + [seq[B] + 1] + seq[B + 1:]  # one token differs in block 2
    got = kv.admit("other", other)
    assert kv.blocks("other")[0] == first[0] and kv.blocks("other")[1] != first[1]
    assert got.computed == B  # block 1 shared; block 2 no copy (its first token differs)


class FakeSnapshots:
    """Stands in for KVPersistence (the disk): records the calls, restores `restorable`
    positions of any prompt."""

    def __init__(self):
        self.restorable = 0
        self.calls = []

    def save(self, blocks, tokens):
        self.calls.append(("save", list(blocks), list(tokens)))
        return True

    def restore(self, where, prompt, resident, start=0):
        self.calls.append(("restore", list(where), resident, start))
        return max(resident, min(self.restorable, len(prompt) - 1))

    def close(self, timeout=None):
        self.calls.append(("close",))


def test_a_snapshot_restore_at_admission_is_final_in_the_plan_and_replaces_the_copy():
    snaps = FakeSnapshots()
    pool = BlockPool(16)
    kv = KVManager(pool, snaps)
    s = Scheduler(kv, max_concurrent=2, max_queue=2, prefill_chunk=64)
    a = list(range(48))
    cache(kv, "a", a)
    snaps.restorable, snaps.calls = 10_000, []
    r = req("b", a[:40] + [999] * 10)
    s.add(r)
    plan = s.schedule()
    assert r.computed == r.reused == 49  # restored: all but the last token
    assert plan.requests == [r] and plan.n_tokens == [1] and plan.kv_copies == []
    restore = [c for c in snaps.calls if c[0] == "restore"]
    assert restore == [("restore", kv.blocks("b"), 40, 2 * B)]  # past the 2 shared blocks; a copy gave 40
    assert pool.shared == 0 and sum(pool.ref) == len(kv.blocks("b"))  # the copy's source is not pinned


def test_without_a_better_snapshot_the_copy_stays_in_the_plan():
    snaps = FakeSnapshots()
    kv = KVManager(BlockPool(16), snaps)
    s = Scheduler(kv, max_concurrent=2, max_queue=2, prefill_chunk=64)
    _, first = cache(kv, "a", list(range(48)))
    r = req("b", list(range(40)) + [999] * 10)
    s.add(r)
    plan = s.schedule()
    assert r.computed == 40 and plan.n_tokens == [10]
    assert plan.kv_copies == [BlockCopy(first[2], kv.blocks("b")[2])]


def test_evicted_kv_is_exported_before_the_restore_writes_into_its_blocks():
    snaps = FakeSnapshots()
    pool = BlockPool(3)
    kv = KVManager(pool, snaps)
    old = list(range(500, 500 + 2 * B + 3))
    _, old_blocks = cache(kv, "old", old)  # 3 blocks, all idle cached now
    assert [c[0] for c in snaps.calls] == ["restore"]  # (nothing evicted: nothing saved)
    snaps.restorable, snaps.calls = 10_000, []
    kv.admit("new", list(range(40)))  # needs all 3: evicts the old chain
    kinds = [c[0] for c in snaps.calls]
    assert kinds == ["save", "restore"]
    assert snaps.calls[0][1:] == (old_blocks, old)  # the whole old chain, before any write


def test_one_digest_per_block_not_per_token(monkeypatch):
    """Decoding 5 blocks' worth of tokens hashes each block once as it fills (and the
    partly filled last one once at the end), not each token."""
    calls = []
    real = blocks_module.block_digest

    def counting(parent, tokens):
        calls.append(len(tokens))
        return real(parent, tokens)

    monkeypatch.setattr(blocks_module, "block_digest", counting)
    kv = KVManager(BlockPool(16))
    s = Scheduler(kv, max_concurrent=1, max_queue=1, prefill_chunk=64)
    r = req("r", range(3), max_tokens=5 * B)
    s.add(r)
    steps = 0
    while r.state != RequestState.FINISHED:
        plan = s.schedule()
        kv.copies_done()
        for q, n in zip(plan.requests, plan.n_tokens):
            q.computed += n
            if q.computed == q.n_known:
                q.state = RequestState.DECODING
                q.output_ids.append(9)
                if len(q.output_ids) >= q.params.max_tokens:
                    s.finish(q)
        steps += 1
    full = r.n_known // B  # 83 tokens known, 82 computed: 5 full blocks
    assert steps == 5 * B and calls.count(B) == full and len(calls) == full + 1  # + the partial last block
