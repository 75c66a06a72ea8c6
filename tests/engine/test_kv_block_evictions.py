"""What the block pool hands the KV snapshots (engine/kv/persistence.py) at eviction: the
evicted block's whole sequence, blocks and tokens from position 0, noted once per sequence
while its KV is still in place; the chain ends the engine saves at stop."""

from __future__ import annotations

from panechat.backends.paged_kv import BLOCK_TOKENS as B
from panechat.engine.kv.blocks import ROOT, BlockPool


def _cache(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Admit `tokens`, register every computed block as a finished sequence would, release."""
    g = pool.admit(tokens)
    parent = g.last_hash
    full = len(tokens) // B
    for j in range(g.n_shared, full):
        parent = pool.register(g.blocks[j], parent, tuple(tokens[j * B:(j + 1) * B]))
    if len(tokens) > full * B:
        pool.register_partial(g.blocks[full], parent, tuple(tokens[full * B:]))
    pool.release(g.blocks)
    return g.blocks


def test_an_eviction_notes_the_whole_sequence_once_tail_first():
    pool = BlockPool(4)
    pool.track_evictions = True
    seq = list(range(100, 100 + 2 * B + 5))  # two full blocks and a partial one
    blocks = _cache(pool, seq)
    assert pool.chain(blocks[2]) == (blocks, seq)
    assert pool.leaves() == [blocks[2]]
    assert pool.allocate() is not None  # the free block: nothing evicted
    assert pool.take_evicted() == []
    b = pool.allocate()  # the least recently used cached block: the sequence's tail
    assert b == blocks[2] and pool.evictions == 1
    assert pool.take_evicted() == [(blocks, seq)]  # the whole sequence, before b is reused
    pool.allocate()
    pool.allocate()  # the rest of the same sequence: already noted
    assert pool.evictions == 3 and pool.take_evicted() == []


def test_evictions_are_not_noted_when_snapshots_are_off_and_a_broken_chain_is_skipped():
    pool = BlockPool(3)
    _cache(pool, list(range(2 * B)))
    pool.allocate(), pool.allocate()
    assert pool.evictions == 1 and pool.take_evicted() == []
    pool = BlockPool(2)
    pool.track_evictions = True
    blocks = _cache(pool, list(range(2 * B)))
    pool._forget(blocks[0])  # the head is gone: the tail's tokens from position 0 are unknown
    assert pool.chain(blocks[1]) is None
    pool.allocate(), pool.allocate()
    assert pool.take_evicted() == []


def test_chains_and_leaves_of_two_sequences_sharing_a_prefix():
    pool = BlockPool(8)
    head = list(range(B))
    a = _cache(pool, head + list(range(500, 500 + B)) + [1])
    b = _cache(pool, head + list(range(700, 700 + B)) + [1])
    assert b[0] == a[0]  # the shared first block
    ends = sorted(pool.leaves())
    assert ends == sorted([a[2], b[2]])
    assert pool.chain(b[2]) == (b, head + list(range(700, 700 + B)) + [1])
    assert pool.key[a[0]][0] == ROOT
