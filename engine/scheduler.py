"""Continuous batching at token boundaries (vLLM v1 scheduler style, no model inside).

Each step, every running request lets its computed tokens catch up with its known
tokens: a decoding request contributes one token, a prefilling one a chunk of its prompt
within a shared per-step prefill budget, so a long newcomer is spread over several steps
with decode steps for everyone else between its chunks.

The scheduler only decides: `schedule()` returns a `StepPlan` (plain data, like vLLM's
`SchedulerOutput`) and touches no device; the engine performs the plan's KV copies, then
the forward pass.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_slots import SlotPool
from .request import Request, RequestState


class QueueFull(Exception):
    """The waiting queue is at --max-queue; the server maps this to HTTP 429.

    `retry_after`: seconds after which to try again (set by the engine from the queue and
    the recent pace; None where unknown)."""

    retry_after: int | None = None


@dataclass(frozen=True)
class KVCopy:
    """Copy the KV of positions 0..n_tokens-1 from slot `src` into slot `dst`."""

    src: int
    dst: int
    n_tokens: int


@dataclass
class StepPlan:
    """What one step does, in order: the KV copies (prefixes shared by requests admitted
    this step; before the forward pass, in list order), then one forward pass computing,
    per request, its next `n_tokens` known tokens (in row order). `admitted`: the requests
    given a slot this step (the engine may restore their prefix from a KV snapshot)."""

    requests: list[Request]
    n_tokens: list[int]
    kv_copies: list[KVCopy] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)


class Scheduler:
    """Owns the waiting queue, the running set and the KV slot bookkeeping.

    `max_seqs_per_step` caps the sequences in one step (None: up to max_concurrent); the
    engine sets it to 1 when batching is off. Admission does not depend on it: every
    admitted request holds its slot, and they take turns."""

    def __init__(self, pool: SlotPool, max_concurrent: int = 4, max_queue: int = 8,
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

    def add(self, req: Request) -> None:
        """Queue a request; raises QueueFull at once when the queue is full.

        The queue is FIFO: `_admit` takes only from its head, so a queued request is never
        overtaken. It holds `max_queue` plus the free slots' worth (requests that the next
        step admits at once)."""
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
        admitted: list[Request] = []
        copies = self._admit(admitted)
        reqs, counts = [], []
        budget = self.prefill_chunk
        limit = self.max_seqs_per_step or len(self.running)
        for r in self.running:
            if len(reqs) >= limit:
                break
            todo = r.n_known - r.computed
            if r.state == RequestState.DECODING:
                reqs.append(r)
                counts.append(1)
            elif budget > 0 and todo > 0:
                n = min(todo, budget)
                budget -= n
                reqs.append(r)
                counts.append(n)
        return StepPlan(reqs, counts, copies, admitted)

    def _admit(self, admitted: list[Request]) -> list[KVCopy]:
        """Move waiting requests into free slots, in order (appended to `admitted`); returns
        the KV copies they need."""
        copies: list[KVCopy] = []
        while self.waiting and len(self.running) < self.max_concurrent:
            req = self.waiting[0]
            grant = self.pool.acquire(req.conversation, req.prompt_ids)
            if grant is None:
                break  # every slot busy: wait for a running request to finish
            if grant.copy_from is not None:
                copies.append(KVCopy(grant.copy_from, grant.slot.index, grant.reuse))
            self.waiting.popleft()
            req.slot, req.reused, req.computed = grant.slot.index, grant.reuse, grant.reuse
            req.state = RequestState.PREFILLING
            self.running.append(req)
            admitted.append(req)
        return copies

    def finish(self, req: Request, keep_cache: bool = True) -> None:
        """Remove a request; its slot keeps the tokens whose KV was written."""
        if req in self.running:
            self.running.remove(req)
            slot = self.pool.slots[req.slot]
            self.pool.release(slot, req.known[: req.computed] if keep_cache else None)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.state = RequestState.FINISHED
