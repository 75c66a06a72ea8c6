"""Continuous batching at token boundaries (vLLM v1 scheduler style, no model inside).

Each step, every running request lets its computed tokens catch up with its known
tokens: a decoding request contributes one token, a prefilling one a chunk of its prompt
within a shared per-step prefill budget, so a long newcomer is spread over several steps
with decode steps for everyone else between its chunks.

The scheduler only decides: `schedule()` returns a `StepPlan` (plain data, like vLLM's
`SchedulerOutput`) and touches no device; the engine performs the plan's KV block copies,
then the forward pass.

KV memory is one pool of blocks (`BlockPool`). A request is admitted when the blocks for
its known tokens are available (cached prefix blocks are shared, not counted); a decoding
request takes one more block each BLOCK_TOKENS tokens. When none is left, the youngest
running request is preempted: its computed blocks stay cached, it goes back to the head
of the queue and is recomputed later from its prompt and the tokens it already produced
(vLLM's recompute preemption), so the oldest always progresses: no deadlock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from panechat.backends.paged_kv import BLOCK_TOKENS
from panechat.engine.kv.blocks import ROOT, BlockPool
from panechat.engine.serving.request import Request, RequestState


class QueueFull(Exception):
    """The waiting queue is at --max-queue; the server maps this to HTTP 429.

    `retry_after`: seconds after which to try again (set by the engine from the queue and
    the recent pace; None where unknown)."""

    retry_after: int | None = None


@dataclass(frozen=True)
class BlockCopy:
    """Copy KV block `src` into block `dst` (every layer): copy-on-write of a cached block
    whose first tokens a new sequence shares."""

    src: int
    dst: int


@dataclass
class StepPlan:
    """What one step does, in order: the block copies (for requests admitted this step;
    before the forward pass), then one forward pass computing, per request, its next
    `n_tokens` known tokens (in row order) into the KV blocks of its `blocks` table.
    `admitted`: the requests given blocks this step (the engine may restore their prefix
    from a KV snapshot, after the copies)."""

    requests: list[Request]
    n_tokens: list[int]
    kv_copies: list[BlockCopy] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)


class Scheduler:
    """Owns the waiting queue, the running set and the KV block bookkeeping.

    `max_seqs_per_step` caps the sequences in one step (None: up to max_concurrent); the
    engine sets it to 1 when batching is off. Admission does not depend on it: every
    admitted request holds its blocks, and they take turns."""

    def __init__(self, pool: BlockPool, max_concurrent: int = 4, max_queue: int = 8,
                 prefill_chunk: int = 512, max_seqs_per_step: int | None = None):
        if max_concurrent < 1 or max_queue < 0 or prefill_chunk < 1:
            raise ValueError("max-concurrent and prefill-chunk must be >= 1, max-queue >= 0")
        if max_seqs_per_step is not None and max_seqs_per_step < 1:
            raise ValueError("max_seqs_per_step must be >= 1 (or None)")
        self.pool = pool
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.max_seqs_per_step = max_seqs_per_step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self._pinned: list[tuple[int, int]] = []  # copies of the last plan: sources held until done

    def add(self, req: Request) -> None:
        """Queue a request; raises QueueFull at once when the queue is full.

        The queue is FIFO: `_admit` takes only from its head, so a queued request is never
        overtaken (a preempted one goes back to the head). It holds `max_queue` plus the
        free places' worth (requests that the next step admits at once)."""
        free = max(0, self.max_concurrent - len(self.running))
        if len(self.waiting) >= self.max_queue + free:
            raise QueueFull(
                f"server busy: {len(self.running)} generating and {len(self.waiting)} waiting "
                f"(max-queue {self.max_queue}); retry shortly"
            )
        self.waiting.append(req)

    def schedule(self) -> StepPlan:
        """Admit what fits, then plan the next step (no requests when nothing runs; the
        copies of requests admitted now are in the plan either way)."""
        self.copies_done()  # (the engine says so itself after each plan's copies)
        for r in self.running:
            self._commit(r)
        admitted: list[Request] = []
        copies = self._admit(admitted)
        reqs, counts = [], []
        budget = self.prefill_chunk
        limit = self.max_seqs_per_step or len(self.running)
        for r in list(self.running):
            if len(reqs) >= limit:
                break
            if r.state == RequestState.WAITING:
                continue  # preempted below on behalf of an older request
            todo = r.n_known - r.computed
            if r.state == RequestState.DECODING:
                if r.computed >= len(r.blocks) * BLOCK_TOKENS and not self._grow(r):
                    continue  # it was the youngest: preempted itself
                reqs.append(r)
                counts.append(1)
            elif budget > 0 and todo > 0:
                n = min(todo, budget)
                budget -= n
                reqs.append(r)
                counts.append(n)
        return StepPlan(reqs, counts, copies, admitted)

    def copies_done(self) -> None:
        """The engine has done the last plan's block copies: release their sources."""
        if self._pinned:
            self.pool.unpin(self._pinned)
            self._pinned = []

    def _admit(self, admitted: list[Request]) -> list[BlockCopy]:
        """Move waiting requests into the running set, in order, while their blocks are
        available (appended to `admitted`); returns the block copies they need."""
        copies: list[BlockCopy] = []
        while self.waiting and len(self.running) < self.max_concurrent:
            req = self.waiting[0]
            grant = self.pool.admit(req.known)
            if grant is None:
                break  # too few blocks now: wait for a running request to finish
            copies.extend(BlockCopy(s, d) for s, d in grant.copies)
            self._pinned.extend(grant.copies)
            self.waiting.popleft()
            if req.preemptions == 0:
                req.reused = grant.reuse
            req.blocks, req.computed = grant.blocks, grant.reuse
            req.n_hashed, req.last_hash = grant.n_shared, grant.last_hash
            req.state = RequestState.PREFILLING
            self.running.append(req)
            admitted.append(req)
        return copies

    def _grow(self, r: Request) -> bool:
        """One more block for decoding request r; preempts the youngest running requests
        until one is available. False when r itself was preempted."""
        while True:
            b = self.pool.allocate()
            if b is not None:
                r.blocks.append(b)
                return True
            victim = self.running[-1]
            self.preempt(victim)
            if victim is r:
                return False

    def preempt(self, r: Request) -> None:
        """Take r's blocks back (computed full ones stay cached) and put r at the head of
        the queue; it is recomputed from its known tokens when admitted again."""
        self._commit(r, ended=True)
        self.pool.release(r.blocks)
        r.blocks, r.computed, r.n_hashed, r.last_hash = [], 0, 0, ROOT
        r.state = RequestState.WAITING
        r.preemptions += 1
        self.preemptions += 1
        self.running.remove(r)
        self.waiting.appendleft(r)

    def _commit(self, r: Request, ended: bool = False) -> None:
        """Register r's blocks that became full and computed, so others may share them;
        when r's blocks are being given up (`ended`), its partly filled last block too, as a
        copy-on-write source."""
        full = r.computed // BLOCK_TOKENS
        while r.n_hashed < full:
            j = r.n_hashed
            toks = tuple(r.known_slice(j * BLOCK_TOKENS, BLOCK_TOKENS))
            r.last_hash = self.pool.register(r.blocks[j], r.last_hash, toks)
            r.n_hashed += 1
        if ended and r.computed > full * BLOCK_TOKENS:
            toks = tuple(r.known_slice(full * BLOCK_TOKENS, r.computed - full * BLOCK_TOKENS))
            self.pool.register_partial(r.blocks[full], r.last_hash, toks)

    def finish(self, req: Request, keep_cache: bool = True) -> None:
        """Remove a request; its computed full blocks stay cached (unless `keep_cache` is
        False: its KV may be incomplete), the rest are freed."""
        if req in self.running:
            self.running.remove(req)
            if keep_cache:
                self._commit(req, ended=True)
            self.pool.release(req.blocks, keep_cache)  # (req.blocks keeps the table, for reading)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.state = RequestState.FINISHED
