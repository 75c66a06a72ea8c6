"""Continuous batching at token boundaries (vLLM v1 scheduler style, no model inside).

Each step, every running request lets its computed tokens catch up with its known
tokens: a decoding request contributes one token, a prefilling one a chunk of its prompt
within a shared per-step prefill budget, so a long newcomer is spread over several steps
with decode steps for everyone else between its chunks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_slots import SlotPool
from .request import Request, RequestState


class QueueFull(Exception):
    """The waiting queue is at --max-queue; the server maps this to HTTP 429."""


@dataclass
class StepPlan:
    """What one forward step computes: per request, how many of its tokens (in row order)."""

    requests: list[Request]
    n_tokens: list[int]

    @property
    def n_rows(self) -> int:
        return sum(self.n_tokens)


class Scheduler:
    """Owns the waiting queue, the running set and the KV slot bookkeeping."""

    def __init__(self, pool: SlotPool, max_concurrent: int = 4, max_queue: int = 8,
                 prefill_chunk: int = 512, copy_prefix=lambda src, dst, n: None):
        if max_concurrent < 1 or max_queue < 0 or prefill_chunk < 1:
            raise ValueError("max-concurrent and prefill-chunk must be >= 1, max-queue >= 0")
        self.pool = pool
        self.copy_prefix = copy_prefix  # (src slot, dst slot, n tokens): copies cached KV
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        """Queue a request; raises QueueFull at once when the queue is full."""
        free = max(0, self.max_concurrent - len(self.running))
        if len(self.waiting) >= self.max_queue + free:
            raise QueueFull(
                f"server busy: {len(self.running)} generating and {len(self.waiting)} waiting "
                f"(max-queue {self.max_queue}); retry shortly"
            )
        self.waiting.append(req)

    def schedule(self) -> StepPlan:
        """Admit what fits, then plan the next step (empty when nothing runs)."""
        self._admit()
        reqs, counts = [], []
        budget = self.prefill_chunk
        for r in self.running:
            todo = r.n_known - r.computed
            if r.state == RequestState.DECODING:
                reqs.append(r)
                counts.append(1)
            elif budget > 0 and todo > 0:
                n = min(todo, budget)
                budget -= n
                reqs.append(r)
                counts.append(n)
        return StepPlan(reqs, counts)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_concurrent:
            req = self.waiting[0]
            grant = self.pool.acquire(req.conversation, req.prompt_ids)
            if grant is None:
                return  # every slot busy: wait for a running request to finish
            if grant.copy_from is not None:
                self.copy_prefix(grant.copy_from, grant.slot.index, grant.reuse)
            self.waiting.popleft()
            req.slot, req.reused, req.computed = grant.slot.index, grant.reuse, grant.reuse
            req.state = RequestState.PREFILLING
            self.running.append(req)

    def finish(self, req: Request, keep_cache: bool = True) -> None:
        """Remove a request; its slot keeps the tokens whose KV was written."""
        if req in self.running:
            self.running.remove(req)
            slot = self.pool.slots[req.slot]
            self.pool.release(slot, req.known[: req.computed] if keep_cache else None)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.state = RequestState.FINISHED
