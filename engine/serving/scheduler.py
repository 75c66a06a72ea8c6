"""Continuous batching at token boundaries (vLLM v1 scheduler style, no model inside).

Each step, every running request lets its computed tokens catch up with its known
tokens: a decoding request contributes one token, a prefilling one a chunk of its prompt
within a shared per-step prefill budget, so a long newcomer is spread over several steps
with decode steps for everyone else between its chunks.

The scheduler only decides: `schedule()` returns a `StepPlan` (plain data, like vLLM's
`SchedulerOutput`) and touches no device itself; the engine performs the plan's KV block
copies, then the forward pass, and never changes the plan.

KV memory is one pool of blocks, managed by the `KVManager` (engine/kv/manager.py), which
the scheduler asks while planning. A request is admitted when the blocks for its known
tokens are available (cached prefix blocks are shared, not counted; a KV snapshot may
restore more of its prefix then and there); a decoding request takes one more block each
BLOCK_TOKENS tokens. When none is left, the youngest running request is preempted: its
computed blocks stay cached, it goes back to the head of its client's queue and is
recomputed later from its prompt and the tokens it already produced (vLLM's recompute
preemption), so the oldest always progresses: no deadlock.

The queue is fair across clients (fair_queue.py): the next admitted request is the head of
the client with the fewest running requests. A client with none running whose request
finds no place (every slot, or too many blocks, held) takes one from the client holding
the most, if that client holds two or more: its youngest is preempted as above. So one
client's flood delays another's first token by a step or two, not by the flood (issue
25). Who is admitted when changes; what a row computes never does.

Threads: `add` may be called from any thread while `schedule` runs on the engine's; the
queue moves under a small lock of its own, so a slow admission (a snapshot read from disk)
never holds up a submit.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from panechat.engine.kv.blocks import BlockKey
from panechat.engine.kv.manager import BlockCopy, KVManager
from panechat.engine.serving.fair_queue import FairQueue
from panechat.engine.serving.request import Request, RequestState
from panechat.engine.serving.speculation import StepCost

__all__ = ["BlockCopy", "ClientQueueFull", "QueueFull", "Scheduler", "StepPlan"]


class QueueFull(Exception):
    """The waiting queue is at --max-queue; the server maps this to HTTP 429.

    `retry_after`: seconds after which to try again (set by the engine from the queue and
    the recent pace; None where unknown)."""

    retry_after: int | None = None


class ClientQueueFull(QueueFull):
    """This client's own requests fill its share of the queue (--max-queue-per-client);
    other clients are still admitted. `client` and `waiting` (its queued requests) let
    the engine estimate `retry_after`."""

    def __init__(self, message: str, client: str, waiting: int):
        super().__init__(message)
        self.client, self.waiting = client, waiting


@dataclass
class StepPlan:
    """What one step does, in order: the block copies (before the forward pass), then one
    forward pass computing, per request, its next `n_tokens` known tokens (in row order)
    into the KV blocks of its table in `block_tables`. Final: the engine executes it as
    it is."""

    requests: list[Request]
    n_tokens: list[int]
    block_tables: list[list[int]] = field(default_factory=list)
    kv_copies: list[BlockCopy] = field(default_factory=list)
    # a decoding request's n_tokens is 1 + len(r.drafts): its draft tokens follow its known
    # one as rows of their own (speculation.py); set here, read by the engine


@dataclass
class _PlannedRows:
    """While a step is planned: its rows so far, the tokens they are expected to give, and
    how many are plain (one a decoding request; the rest are drafts)."""

    rows: int = 0
    tokens: float = 0.0
    plain: int = 0


class Scheduler:
    """Owns the waiting queue and the running set; asks the `KVManager` for blocks.

    `max_seqs_per_step` caps the sequences in one step (None: up to max_concurrent); the
    engine sets it to 1 when batching is off. Admission does not depend on it: every
    admitted request holds its blocks, and they take turns. `max_queue_per_client`: the
    waiting requests one client may have (None: up to `max_queue`)."""

    def __init__(self, kv: KVManager, max_concurrent: int = 4, max_queue: int = 8,
                 prefill_chunk: int = 512, max_seqs_per_step: int | None = None,
                 max_queue_per_client: int | None = None):
        if max_concurrent < 1 or max_queue < 0 or prefill_chunk < 1:
            raise ValueError("max-concurrent and prefill-chunk must be >= 1, max-queue >= 0")
        if max_queue_per_client is not None and max_queue_per_client < 1:
            raise ValueError("max-queue-per-client must be >= 1 (or None)")
        if max_seqs_per_step is not None and max_seqs_per_step < 1:
            raise ValueError("max_seqs_per_step must be >= 1 (or None)")
        self.kv = kv
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.max_seqs_per_step = max_seqs_per_step
        self.max_queue_per_client = max_queue_per_client
        self.speculate = True  # requests with a Speculation get drafts (the engine's self-check may say no)
        self.step_cost = StepCost()  # the engine records each step's time; drafts are weighed by it
        self._plan = _PlannedRows()  # while planning: the rows so far and what they are expected to give
        self.waiting = FairQueue()
        self.running: list[Request] = []
        self.preemptions = 0
        self._queue_lock = threading.Lock()  # waiting and running change together under it

    def add(self, req: Request) -> None:
        """Queue a request; raises QueueFull at once when the queue is full, ClientQueueFull
        when its client's part of it is.

        The queue is FIFO within a client: a queued request is never overtaken by a later
        one of its client (a preempted one goes back to the head). It holds `max_queue`
        (a client: `max_queue_per_client`) plus the free places' worth (requests that the
        next step admits at once)."""
        with self._queue_lock:
            free = max(0, self.max_concurrent - len(self.running))
            cap, mine = self.max_queue_per_client, self.waiting.count(req.client)
            if cap is not None and mine >= cap + free:
                raise ClientQueueFull(
                    f"{_who(req.client)} already has {mine} requests waiting (max-queue-per-client {cap}); "
                    "wait for a reply before sending more, or raise --max-queue-per-client", req.client, mine)
            if len(self.waiting) >= self.max_queue + free:
                raise QueueFull(
                    f"server busy: {len(self.running)} generating and {len(self.waiting)} waiting "
                    f"(max-queue {self.max_queue}); retry shortly"
                )
            self.waiting.append(req)

    def add_first(self, reqs: list[Request]) -> None:
        """Queue `reqs` at the head, in order, past the queue's limit: the other samples of a
        request already admitted (its `forks`), which wait for nobody else: at the head of
        their client's queue."""
        with self._queue_lock:
            for r in reversed(reqs):
                self.waiting.appendleft(r)

    def schedule(self) -> StepPlan:
        """Admit what fits, then plan the next step (no requests when nothing runs; the
        copies of requests admitted now are in the plan either way). Called on the engine
        thread once the previous plan was executed."""
        kv = self.kv
        for r in self.running:
            kv.commit(r.id, r.computed, r.known_slice)
        copies = self._admit()
        reqs, counts = [], []
        budget = self.prefill_chunk
        limit = self.max_seqs_per_step or len(self.running)
        n_decoding = sum(r.state == RequestState.DECODING for r in self.running[:limit])
        self._plan = _PlannedRows(n_decoding, float(n_decoding), n_decoding)
        for r in list(self.running):
            if len(reqs) >= limit:
                break
            if r.state == RequestState.WAITING:
                continue  # preempted below on behalf of an older request
            todo = r.n_known - r.computed
            if r.state == RequestState.DECODING:
                if r.computed >= kv.slots(r.id) and not self._grow(r):
                    continue  # it was the youngest: preempted itself
                r.drafts = self._drafts(r) if r.spec is not None and self.speculate else []
                reqs.append(r)
                counts.append(1 + len(r.drafts))
            elif budget > 0 and todo > 0:
                r.drafts = []
                n = min(todo, budget)
                budget -= n
                reqs.append(r)
                counts.append(n)
        return StepPlan(reqs, counts, [kv.blocks(r.id) for r in reqs], copies)

    def _admit(self) -> list[BlockCopy]:
        """Move waiting requests into the running set, fairly across clients, while places
        and blocks are available (a client with none running may take one: `_yield_place`);
        returns the block copies they need."""
        copies: list[BlockCopy] = []
        if not self.waiting:  # the usual step: nothing to admit, nothing to count
            return copies
        running = Counter(r.client for r in self.running)
        admitted: set[str] = set()  # ids admitted now: never preempted in the same call (their copies are planned)
        while True:
            with self._queue_lock:
                req = self.waiting.head(running)  # (only this thread takes from the queue)
            if req is None:
                break
            got = (self.kv.admit(req.id, req.known, reuse=req.prompt_lps is None)  # prompt logprobs: all computed
                   if len(self.running) < self.max_concurrent else None)
            if got is None:
                if self._yield_place(req.client, running, admitted):
                    continue
                break  # no place or too few blocks now: wait for a running request to finish
            copies.extend(got.copies)
            if req.preemptions == 0:
                req.reused = got.computed
            req.computed = got.computed
            req.state = RequestState.PREFILLING
            with self._queue_lock:
                self.waiting.pop(req)
                self.running.append(req)
            running[req.client] += 1
            admitted.add(req.id)
        return copies

    def _yield_place(self, client: str, running: Counter, admitted: set[str]) -> bool:
        """For a `client` with nothing running: preempt the youngest request of the client
        running the most, if that one runs two or more (never its last, so two clients
        cannot take a place from each other in turn). False when nothing was preempted."""
        if running[client] > 0 or not running:
            return False
        heavy, n = running.most_common(1)[0]
        if n < 2:
            return False
        victim = next((r for r in reversed(self.running) if r.client == heavy and r.id not in admitted), None)
        if victim is None:
            return False
        self.preempt(victim)
        running[heavy] -= 1
        return True

    def _drafts(self, r: Request) -> list[int]:
        """Decoding request r's draft tokens for this step: within its max_tokens and the
        KV slots it holds, plus one more block if one is free (never by preempting), and
        only as many as speed the whole step up by the measured cost of its rows
        (`StepCost`) and r's chance of acceptance."""
        room = r.params.max_tokens - len(r.output_ids) - 1
        if room <= 0:
            return []
        p, cost = self._plan, self.step_cost
        # the step as planned so far against a plain one (other requests' drafts in it)
        planned = cost.ratio(p.plain, p.rows - p.plain) if p.rows > p.plain else 1.0

        def worth(expected: float, k: int) -> float:  # the step's tokens per second, relative
            return cost.speedup(p.tokens, expected, p.plain, p.rows - p.plain + k, planned)

        drafts = r.spec.propose(room, worth if p.tokens > 0 else None)
        if drafts:
            slots = self.kv.slots(r.id)
            if r.computed + 1 + len(drafts) > slots and self.kv.grow(r.id):
                slots = self.kv.slots(r.id)
            drafts = drafts[:slots - r.computed - 1]
            p.rows, p.tokens = p.rows + len(drafts), p.tokens + r.spec.expected - 1
        return drafts

    def _grow(self, r: Request) -> bool:
        """One more block for decoding request r; preempts the youngest running requests
        until one is available. False when r itself was preempted."""
        while not self.kv.grow(r.id):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is r:
                return False
        return True

    def preempt(self, r: Request) -> None:
        """Take r's blocks back (computed full ones stay cached) and put r at the head of
        its client's queue; it is recomputed from its known tokens when admitted again."""
        self.kv.free(r.id, r.computed, r.known_slice)
        r.computed = 0
        r.state = RequestState.WAITING
        r.preemptions += 1
        self.preemptions += 1
        with self._queue_lock:
            self.running.remove(r)
            self.waiting.appendleft(r)

    def finish(self, req: Request, keep_cache: bool = True) -> list[tuple[int, BlockKey]]:
        """Remove a request; its computed full blocks stay cached (unless `keep_cache` is
        False: its KV may be incomplete), the rest are freed. Returns the leading blocks it
        leaves cached, with their keys (`KVManager.free`)."""
        held: list[tuple[int, BlockKey]] = []
        with self._queue_lock:
            was_running = req in self.running
            if was_running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
        if was_running:
            held = self.kv.free(req.id, req.computed, req.known_slice, keep_cache)
        req.state = RequestState.FINISHED
        return held


def _who(client: str) -> str:
    """A client as the refusal names it."""
    return f"client {client!r}" if client else "this client"
