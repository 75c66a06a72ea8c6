"""KV block bookkeeping: refcounted blocks, a prefix cache keyed by token hash chains,
and LRU eviction of idle cached blocks (vLLM v1 `KVCacheManager` with automatic prefix
caching; the arrays live in the backend's `PagedKV`).

A full block (BLOCK_TOKENS computed positions) is registered under its chain digest
(block_hash.py: blake2b over the parent block's digest and its token ids), so a block is
only ever found by a sequence whose tokens up to and including it are the same: its KV is
then bit for bit what that sequence would compute (a position's K and V depend only on
the tokens up to it). A new sequence
shares the cached full blocks its tokens start with, and may copy (copy-on-write) the
first divergent cached block when its tokens match that block's first few (an ended
sequence's last, partly filled block is kept as such a source too, so a conversation's
next turn recomputes nothing it already has). Blocks whose sequences ended stay cached
until memory is needed, least recently used first.

With KV snapshots on (`track_evictions`), an eviction also notes the evicted block's whole
chain (its blocks and tokens from the first position on, walked back through the parent
digests) in `evicted`: their KV is still in place until the step that reuses the block, so
the engine exports it between steps (`take_evicted`, engine.py "snapshots"). A chain whose
tokens a noted one already holds (an older part of the same sequence) is not noted again.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

from panechat.backends.paged_kv import BLOCK_TOKENS
from panechat.engine.kv.block_hash import ROOT, block_digest

__all__ = ["ROOT", "BlockKey", "BlockPool", "Grant", "blocks_for"]


class BlockKey(NamedTuple):
    """What a registered block holds: `tokens` after the chain `parent`, and the chain
    `digest` through it (the key it is cached under)."""

    parent: bytes
    tokens: tuple[int, ...]
    digest: bytes


@dataclass
class Grant:
    """Blocks given to a sequence at admission: `blocks` cover its first `n_tokens`
    positions; the first `reuse` are already computed (shared blocks, plus what the
    `copies` (src, dst) bring, done before the next forward pass)."""

    blocks: list[int]
    reuse: int
    copies: list[tuple[int, int]] = field(default_factory=list)
    n_shared: int = 0  # leading blocks shared (registered, not written by this sequence)
    last_hash: bytes = ROOT  # chain digest through the shared blocks


def blocks_for(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK_TOKENS)


class BlockPool:
    """`n_blocks` KV blocks: free, in use (refcount > 0) or idle cached (refcount 0, still
    findable by prefix until evicted)."""

    def __init__(self, n_blocks: int, caching: bool = True):
        if n_blocks < 1:
            raise ValueError("the KV memory budget must hold at least one block")
        self.n_blocks = n_blocks
        self.caching = caching  # False: nothing is registered, so nothing is shared
        self.ref = [0] * n_blocks
        self.key: list[BlockKey | None] = [None] * n_blocks  # what a registered block holds
        # refcount 0, not cached; taken last-in first-out, so the pages a process touches stay
        # few (untouched blocks of a large budget cost no RAM)
        self.free: deque[int] = deque(range(n_blocks - 1, -1, -1))
        self.idle: OrderedDict[int, None] = OrderedDict()  # refcount 0, cached; oldest first
        self.cached: dict[bytes, int] = {}  # chain digest through a registered block -> that block
        self.children: dict[bytes, set[int]] = {}  # parent digest -> registered blocks
        self.shared = 0  # blocks with refcount > 1
        self.evictions = 0  # cached blocks given to another use
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of those, tokens found computed (shared or copied)
        self.peak_in_use = 0
        self.track_evictions = False  # True: evictions note their chains in `evicted`
        self.evicted: list[tuple[list[int], list[int]]] = []  # (blocks, tokens) per noted eviction
        self._noted: set[bytes] = set()  # chain digests inside noted chains

    # -- counts -------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Blocks an allocation can take now (free, or idle cached ones it may evict)."""
        return len(self.free) + len(self.idle)

    @property
    def in_use(self) -> int:
        return self.n_blocks - self.available

    @property
    def resident(self) -> int:
        """Blocks holding KV someone may read: in use, or idle cached."""
        return self.n_blocks - len(self.free)

    # -- primitives ---------------------------------------------------------------------
    def allocate(self) -> int | None:
        """A block for private use (refcount 1): a free one, else the least recently used
        idle cached one (evicted from the cache); None when every block is in use."""
        if self.free:
            b = self.free.pop()
        elif self.idle:
            b, _ = self.idle.popitem(last=False)
            if self.track_evictions:
                self._note_eviction(b)
            self._forget(b)
            self.evictions += 1
        else:
            return None
        self.ref[b] = 1
        self.peak_in_use = max(self.peak_in_use, self.n_blocks - len(self.free) - len(self.idle))
        return b

    def take(self, b: int) -> None:
        """One more reference to block b (a cached block being shared)."""
        if self.ref[b] == 0:
            self.idle.pop(b, None)
        elif self.ref[b] == 1:
            self.shared += 1
        self.ref[b] += 1
        if self.ref[b] == 1:
            self.peak_in_use = max(self.peak_in_use, self.in_use)

    def release(self, blocks: list[int], keep_cache: bool = True) -> None:
        """Drop one reference to each block, last block first (so a sequence's tail is
        evicted before its head). A block nobody holds stays cached if registered (unless
        `keep_cache` is False), else it is free."""
        for b in reversed(blocks):
            r = self.ref[b]
            if r <= 0:
                raise RuntimeError(f"KV block {b} released more often than taken")
            self.ref[b] = r - 1
            if r == 2:
                self.shared -= 1
            elif r == 1:
                if self.key[b] is not None and keep_cache:
                    self.idle[b] = None
                else:
                    self._forget(b)
                    self.free.append(b)

    def register(self, b: int, parent: bytes, tokens: tuple[int, ...]) -> bytes:
        """Block b now holds the computed KV of `tokens` after the chain `parent`: make it
        findable. Returns the chain digest through it. A block already cached under that
        digest stays the one found (b stays private)."""
        h = block_digest(parent, tokens)
        if self.caching and h not in self.cached:
            self.cached[h] = b
            self.key[b] = BlockKey(parent, tokens, h)
            self.children.setdefault(parent, set()).add(b)
        return h

    def register_partial(self, b: int, parent: bytes, tokens: tuple[int, ...]) -> None:
        """Block b holds the computed KV of fewer than BLOCK_TOKENS `tokens` after `parent`
        and will not be written again (its sequence ended): keep it findable as a
        copy-on-write source only (a full block's digest hashes BLOCK_TOKENS ids, so a
        full-block lookup never finds it)."""
        if 0 < len(tokens) < BLOCK_TOKENS:
            self.register(b, parent, tokens)

    def _forget(self, b: int) -> None:
        key = self.key[b]
        if key is not None:
            self.key[b] = None
            if self.cached.get(key.digest) == b:
                del self.cached[key.digest]
            kids = self.children.get(key.parent)
            if kids is not None:
                kids.discard(b)
                if not kids:
                    del self.children[key.parent]

    # -- snapshots -----------------------------------------------------------------------
    def chain(self, b: int) -> tuple[list[int], list[int]] | None:
        """(blocks, tokens) of registered block b's sequence from position 0 through b, or
        None when an earlier block of it is no longer cached."""
        blocks, parts = [], []
        key = self.key[b]
        while key is not None:
            blocks.append(b)
            parts.append(key.tokens)
            if key.parent == ROOT:
                blocks.reverse()
                return blocks, [t for part in reversed(parts) for t in part]
            b = self.cached.get(key.parent)
            key = None if b is None else self.key[b]
        return None

    def leaves(self) -> list[int]:
        """Registered blocks no registered block follows (the ends of cached sequences)."""
        return [b for b, key in enumerate(self.key)
                if key is not None and not self.children.get(key.digest)]

    def take_evicted(self) -> list[tuple[list[int], list[int]]]:
        """The chains noted since the last call, (blocks, tokens), oldest first."""
        out, self.evicted = self.evicted, []
        return out

    def _note_eviction(self, b: int) -> None:
        key = self.key[b]
        if key is None:
            return
        h = key.digest
        if h in self._noted:  # part of a chain noted already
            self._noted.discard(h)
            return
        found = self.chain(b)
        if found is None:
            return
        if len(self._noted) > 4 * self.n_blocks:
            self._noted.clear()
        for blk in found[0]:
            self._noted.add(self.key[blk].digest)
        self._noted.discard(h)  # (b itself is gone now)
        self.evicted.append(found)

    # -- sequences ------------------------------------------------------------------------
    def admit(self, tokens: list[int], reuse: bool = True) -> Grant | None:
        """Blocks for a sequence of `tokens` (all but the last may come from the cache; the
        last is always computed, so the step yields logits; none when not `reuse`), or None
        (taking nothing) when too few blocks are available now."""
        n = len(tokens)
        limit = n - 1 if reuse else 0
        parent, shared = ROOT, []
        i = 0
        while (i + 1) * BLOCK_TOKENS <= limit:  # one digest per full block
            h = block_digest(parent, tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
            b = self.cached.get(h)
            if b is None:
                break
            shared.append(b)
            parent = h
            i += 1
        reuse = i * BLOCK_TOKENS
        src, m = self._best_partial(parent, tokens[reuse:min(reuse + BLOCK_TOKENS, limit)])
        need = blocks_for(n) - len(shared)
        idle_shared = sum(1 for b in shared if self.ref[b] == 0)
        if src is not None and need > self.available - idle_shared - (self.ref[src] == 0):
            src, m = None, 0  # no room to keep the copy's source too: recompute those tokens
        if need > self.available - idle_shared:
            return None  # (never when nothing runs: blocks_for(n) <= n_blocks is checked at submit)
        for b in shared:
            self.take(b)
        if src is not None:
            self.take(src)  # pinned until the copy is done (`unpin`)
        blocks = list(shared)
        for _ in range(need):
            blocks.append(self.allocate())
        copies = []
        if src is not None:
            copies.append((src, blocks[len(shared)]))
            reuse += m
        self.queries += n
        self.hits += reuse
        return Grant(blocks, reuse, copies, len(shared), parent)

    def unpin(self, copies: list[tuple[int, int]]) -> None:
        """The copies are done: release their sources."""
        self.release([src for src, _ in copies])

    def _best_partial(self, parent: bytes, want: list[int]) -> tuple[int | None, int]:
        """The cached block after `parent` sharing the longest run of leading tokens with
        `want` (a copy-on-write source), and that length."""
        best, m = None, 0
        if want:
            for b in self.children.get(parent, ()):
                toks = self.key[b].tokens
                k, n = 0, min(len(want), len(toks))
                while k < n and toks[k] == want[k]:
                    k += 1
                if k > m:
                    best, m = b, k
        return best, m
