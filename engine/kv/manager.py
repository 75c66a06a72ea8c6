"""The KV manager: every sequence's KV blocks, from admission to release (vLLM v1
`KVCacheManager`).

It owns the block pool, each sequence's block table and how far its hash chain is
registered, and the KV snapshots. The scheduler asks it while planning (admit, grow,
commit, free), so what the plan says is final: a sequence admitted here has its cached
prefix shared, its copy-on-write copies planned and its snapshot already restored, and
the engine only executes the plan (the copies, then the forward pass).

Order of KV writes: blocks taken from the cache may be evicted ones whose chain the
snapshots still have to export, so that export happens right after the allocation, before
a restore (now) or a copy or the forward pass (later) writes into them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from collections.abc import Callable, Hashable, Sequence

from panechat.backends.paged_kv import BLOCK_TOKENS
from panechat.engine.kv.block_hash import ROOT
from panechat.engine.kv.blocks import BlockKey, BlockPool, Grant
from panechat.engine.kv.persistence import KVPersistence

__all__ = ["Admission", "BlockCopy", "KVManager"]

log = logging.getLogger(__name__)

#: known[start:start+n] of a sequence (its `known_slice`): tokens are read only for the
#: blocks being registered, never the whole sequence each step.
TokensAt = Callable[[int, int], Sequence[int]]


@dataclass(frozen=True)
class BlockCopy:
    """Copy KV block `src` into block `dst` (every layer): copy-on-write of a cached block
    whose first tokens a new sequence shares."""

    src: int
    dst: int


@dataclass(frozen=True)
class Admission:
    """A sequence given its blocks: its first `computed` positions hold KV already (shared,
    restored from a snapshot, or brought by `copies`, which the engine does before the
    next forward pass)."""

    computed: int
    copies: list[BlockCopy] = field(default_factory=list)


@dataclass
class _Sequence:
    blocks: list[int]  # the block table: position p in blocks[p // BLOCK_TOKENS]
    n_hashed: int = 0  # leading blocks registered in the prefix cache (or shared from it)
    chain: bytes = ROOT  # chain digest through them


class KVManager:
    """The KV blocks of every running sequence (keyed by the caller's id), over one
    `BlockPool`; with `snapshots`, evicted chains are exported and admissions restored."""

    def __init__(self, pool: BlockPool, snapshots: KVPersistence | None = None):
        self.pool = pool
        self.snapshots = snapshots
        pool.track_evictions = snapshots is not None
        self._seqs: dict[Hashable, _Sequence] = {}
        self._pinned: list[tuple[int, int]] = []  # copies planned: sources held until done

    def blocks(self, seq: Hashable) -> list[int]:
        """The block table of `seq` (empty when it holds no blocks)."""
        s = self._seqs.get(seq)
        return s.blocks if s is not None else []

    def slots(self, seq: Hashable) -> int:
        """Positions the blocks of `seq` hold."""
        return len(self._seqs[seq].blocks) * BLOCK_TOKENS

    def copies_done(self) -> None:
        """The engine did the planned copies (or failed them): release their sources. The
        engine calls it after every step's copies, so no source stays pinned."""
        if self._pinned:
            self.pool.unpin(self._pinned)
            self._pinned = []

    def admit(self, seq: Hashable, tokens: list[int], reuse: bool = True) -> Admission | None:
        """Blocks for the `tokens` of `seq`: its cached prefix shared, then the longer of a
        copy-on-write and a snapshot restore (neither when not `reuse`: every token is
        computed); None (taking nothing) when too few blocks are available now. At least
        the last token is left to compute."""
        if seq in self._seqs:
            raise RuntimeError(f"KV sequence {seq!r} admitted twice")
        grant = self.pool.admit(tokens, reuse)
        if grant is None:
            return None
        self._seqs[seq] = _Sequence(grant.blocks, grant.n_shared, grant.last_hash)
        self._save_evicted()
        computed, copies = grant.reuse, grant.copies
        restored = self._restore(grant, tokens) if reuse else 0
        if restored > computed:
            if copies:  # the restore wrote the copy's block: no copy
                self.pool.unpin(copies)
                copies = []
            computed = restored
        self._pinned.extend(copies)
        return Admission(computed, [BlockCopy(s, d) for s, d in copies])

    def grow(self, seq: Hashable) -> bool:
        """One more block at the end of the table of `seq`; False when none is available."""
        b = self.pool.allocate()
        if b is None:
            return False
        self._seqs[seq].blocks.append(b)
        self._save_evicted()
        return True

    def commit(self, seq: Hashable, computed: int, tokens_at: TokensAt) -> None:
        """Register the blocks of `seq` that its first `computed` positions filled, so
        others may share them (one digest per block, as it fills)."""
        self._register_full(self._seqs[seq], computed, tokens_at)

    def free(self, seq: Hashable, computed: int, tokens_at: TokensAt,
             keep_cache: bool = True) -> list[tuple[int, BlockKey]]:
        """Give the blocks of `seq` back. With `keep_cache`, its computed blocks stay cached
        (a partly filled last one as a copy-on-write source); without, its KV is dropped (it
        may be incomplete). Returns the leading blocks left cached with the key each is
        cached under (for the dashboard's idle conversations)."""
        s = self._seqs.pop(seq, None)
        if s is None:
            return []
        held = []
        if keep_cache:
            full = self._register_full(s, computed, tokens_at)
            if computed > full * BLOCK_TOKENS:  # it is not written again: a copy-on-write source
                self.pool.register_partial(s.blocks[full], s.chain,
                                           tuple(tokens_at(full * BLOCK_TOKENS, computed - full * BLOCK_TOKENS)))
            for b in s.blocks[:s.n_hashed]:
                key = self.pool.key[b]
                if key is None:  # a duplicate of a block cached earlier: the chain goes on elsewhere
                    break
                held.append((b, key))
        self.pool.release(s.blocks, keep_cache)
        return held

    def close(self, timeout: float | None = 50) -> None:
        """Graceful stop: snapshot every cached sequence's KV (the longest first; one whose
        tokens another saved one starts with is skipped), then wait for the writes."""
        if self.snapshots is None:
            return
        try:
            self._save_evicted()
            pool = self.pool
            chains = [c for c in map(pool.chain, pool.leaves()) if c is not None]
            saved: list[list[int]] = []
            for blocks, tokens in sorted(chains, key=lambda c: -len(c[1])):
                if any(t[:len(tokens)] == tokens for t in saved):
                    continue
                saved.append(tokens)
                self.snapshots.save(blocks, tokens)
        except Exception:  # noqa: BLE001 - a failed export must not hang the stop
            log.exception("KV snapshots at stop failed")
        self.snapshots.close(timeout=timeout)

    def _register_full(self, s: _Sequence, computed: int, tokens_at: TokensAt) -> int:
        """Register the full blocks of the first `computed` positions of `s` not registered
        yet; returns how many blocks are full."""
        full = computed // BLOCK_TOKENS
        while s.n_hashed < full:
            j = s.n_hashed
            s.chain = self.pool.register(s.blocks[j], s.chain, tuple(tokens_at(j * BLOCK_TOKENS, BLOCK_TOKENS)))
            s.n_hashed += 1
        return full

    def _save_evicted(self) -> None:
        """Snapshot the chains whose cached blocks were just evicted (their KV is still in
        place: nothing has written into the blocks yet)."""
        if self.snapshots is not None:
            for blocks, tokens in self.pool.take_evicted():
                self.snapshots.save(blocks, tokens)

    def _restore(self, grant: Grant, tokens: list[int]) -> int:
        """The positions a KV snapshot restored into the granted blocks past the shared ones
        (0 when none beat what the cache gave)."""
        if self.snapshots is None:
            return 0
        try:
            return self.snapshots.restore(grant.blocks, tokens, grant.reuse, grant.n_shared * BLOCK_TOKENS)
        except Exception:  # noqa: BLE001 - the positions are prefilled instead
            log.exception("KV snapshot restore failed; the prompt is prefilled")
            return 0
