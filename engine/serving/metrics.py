"""Engine statistics: updated once per step by the engine thread, read by anyone.

`snapshot()` builds an `EngineStats` (engine/serving/stats.py) under a lock, cheap enough for 10
reads a second."""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from panechat.backends.paged_kv import BLOCK_TOKENS
from panechat.engine.serving.stats import EngineStats, IdleConversation, StreamStats, TTFTHistogram

#: Upper bounds (seconds) of the cumulative time-to-first-token histogram (Prometheus `le`).
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Finished requests whose time in a KV slot makes the recent mean (`mean_request_s`).
RECENT_REQUESTS = 32
#: Retry-After bounds (seconds): never "now", never longer than a client will wait.
RETRY_AFTER_MIN, RETRY_AFTER_MAX = 1, 60


def retry_after_estimate(waiting: int, max_concurrent: int, mean_request_s: float | None) -> int:
    """Seconds until the `waiting` requests ahead have been served, `max_concurrent` at a
    time, each taking `mean_request_s` in its slot: ceil(waiting / max_concurrent * mean),
    clamped to 1..60 (1 with no history yet)."""
    if not mean_request_s or waiting <= 0:
        return RETRY_AFTER_MIN
    est = math.ceil(waiting / max(1, max_concurrent) * mean_request_s)
    return max(RETRY_AFTER_MIN, min(RETRY_AFTER_MAX, est))


class EngineMetrics:
    """Counters and recent history; every mutation happens on the engine thread."""

    def __init__(self, max_batch: int, window_s: float = 60.0):
        self._lock = threading.Lock()
        self.max_batch = max_batch
        self.step_hist = [0] * (max_batch + 1)  # steps by number of sequences in the step
        self.batch_now = 0
        self.rows_now = 0
        self.steps = 0
        self.requests_total = 0
        self.requests_finished = {"stop": 0, "length": 0, "cancelled": 0, "error": 0, "shutdown": 0}
        self.refused = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.reused_tokens = 0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)  # per bucket (last: over the top), cumulative
        self.ttft_sum = 0.0
        self._recent: deque[tuple[float, int, int]] = deque()  # (t, sequences, tokens) per step
        self._request_s: deque[float] = deque(maxlen=RECENT_REQUESTS)  # slot time of recent completions
        self.window_s = window_s
        self.streams: tuple[StreamStats, ...] = ()  # running and queued requests
        self.idle_conversations: tuple[IdleConversation, ...] = ()  # KV cached between turns
        self.queue_depth = 0
        self.kv_in_use = 0
        self.kv_resident = 0
        self.kv_total = 0
        self.kv_bytes_per_block = 0
        self.kv = {}  # the other KV counters of set_state (EngineStats field -> value)
        self.evictions = 0
        self.kv_snapshots_written = 0  # KV snapshot files written (kv_persistence.py)
        self.kv_snapshots_restored = 0  # admitted requests whose prefix came from a snapshot
        self.spec_draft_tokens = 0  # draft tokens checked by speculative decoding (speculation.py)
        self.spec_accepted = 0  # ... and accepted (each saved a step)
        self.spec_steps = 0  # a sequence's steps that checked drafts

    def record_snapshots(self, written: int = 0, restored: int = 0) -> None:
        """Called by the snapshot writer thread (written) and the engine thread (restored)."""
        with self._lock:
            self.kv_snapshots_written += written
            self.kv_snapshots_restored += restored

    def record_step(self, n_seqs: int, n_rows: int, n_sampled: int, now: float) -> None:
        with self._lock:
            self.steps += 1
            self.batch_now, self.rows_now = n_seqs, n_rows
            self.step_hist[min(n_seqs, self.max_batch)] += 1
            self.generated_tokens += n_sampled
            self._recent.append((now, n_seqs, n_sampled))
            while self._recent and now - self._recent[0][0] > self.window_s:
                self._recent.popleft()

    def record_spec(self, drafted: int, accepted: int, steps: int) -> None:
        """One step's draft tokens checked and accepted, over all its requests, and how many
        of its requests checked drafts."""
        with self._lock:
            self.spec_draft_tokens += drafted
            self.spec_accepted += accepted
            self.spec_steps += steps

    def set_state(self, streams: tuple[StreamStats, ...], idle: tuple[IdleConversation, ...], queue_depth: int,
                  kv_in_use: int,
                  kv_resident: int, kv_total: int, evictions: int, **kv: int) -> None:
        """`kv`: more KV counters by their EngineStats names (kv_shared, preemptions,
        prefix_cache_queries, prefix_cache_hits, kv_peak_in_use, ...)."""
        with self._lock:
            self.streams, self.idle_conversations, self.queue_depth = streams, idle, queue_depth
            self.kv_in_use, self.kv_resident, self.kv_total = kv_in_use, kv_resident, kv_total
            self.evictions = evictions
            self.kv = kv

    def record_finish(self, reason: str, ttft: float | None, slot_s: float | None = None) -> None:
        """One generation ended; `slot_s`: its time from admission to the end (None when it
        never got a slot). Only completed ones (stop, length) make the recent mean."""
        with self._lock:
            self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
            if slot_s is not None and reason in ("stop", "length"):
                self._request_s.append(slot_s)
            if ttft is not None:
                self.ttft_sum += ttft
                self.ttft_counts[next((i for i, b in enumerate(TTFT_BUCKETS) if ttft <= b),
                                      len(TTFT_BUCKETS))] += 1

    def mean_request_s(self) -> float | None:
        """Mean time in a slot of the last RECENT_REQUESTS completed generations (None: none yet)."""
        with self._lock:
            return sum(self._request_s) / len(self._request_s) if self._request_s else None

    def record_admit(self, prompt_tokens: int, reused: int) -> None:
        with self._lock:
            self.requests_total += 1
            self.prompt_tokens += prompt_tokens
            self.reused_tokens += reused

    def mark_idle(self) -> None:
        with self._lock:
            self.batch_now = self.rows_now = 0

    def snapshot(self, batching: bool | None = None, ctx: int | None = None) -> EngineStats:
        """A consistent copy of everything, plus tok/s over the last second."""
        now = time.perf_counter()
        with self._lock:
            last = [(t, n, k) for t, n, k in self._recent if now - t <= 1.0]
            return EngineStats(
                batch_now=self.batch_now,
                batch_max=self.max_batch,
                rows_now=self.rows_now,
                steps=self.steps,
                step_hist=tuple(self.step_hist),
                tok_s=float(sum(k for _, _, k in last)),
                queue_depth=self.queue_depth,
                kv_in_use=self.kv_in_use,
                kv_resident=self.kv_resident,
                kv_total=self.kv_total,
                kv_bytes_per_block=self.kv_bytes_per_block or None,
                kv_block_tokens=BLOCK_TOKENS if self.kv_total else None,
                evictions=self.evictions,
                **self.kv,
                streams=self.streams,  # immutable: rebuilt, never changed, by set_state
                idle=self.idle_conversations,
                requests_total=self.requests_total,
                requests_finished=dict(self.requests_finished),
                refused=self.refused,
                prompt_tokens=self.prompt_tokens,
                generated_tokens=self.generated_tokens,
                reused_tokens=self.reused_tokens,
                ttft_hist=TTFTHistogram(TTFT_BUCKETS, tuple(self.ttft_counts), self.ttft_sum),
                batching=batching,
                ctx=ctx,
                kv_snapshots_written=self.kv_snapshots_written,
                kv_snapshots_restored=self.kv_snapshots_restored,
                spec_draft_tokens=self.spec_draft_tokens,
                spec_accepted=self.spec_accepted,
                spec_steps=self.spec_steps,
            )
