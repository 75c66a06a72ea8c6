"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket (CuPy backend).

A decode step (every row one token, every row's logits wanted) launches the same kernels
with the same shapes step after step; only the values of the token embeddings, slots and
positions change. So the step's device work -- every layer and the output head, everything
after the host's embedding lookup -- is captured once per (model, KV store, bucket) into a
CUDA graph reading *static* input buffers, and replayed each step: one graph launch
instead of ~30 kernel launches per layer, no Python between them.

Rows are padded up to the bucket (1, 2, 4, ..., 256). A padded row has a zero embedding,
position 0 and a sequence whose block table lists only the paged KV store's *spare block*
(`CupyBackend.new_paged_kv` allocates one block more than asked; the block pool never
hands it out), so it writes and reads only that block. The block tables are a static
input too, their width padded up to a power of two (part of the graph's key) with the
spare block; a slotted store (no tables) pads with its spare slot, whose row lists only
the spare block. The KV buffers are allocated once, so the graph's pointers into them
stay valid for the store's life. Every
kernel computes a row from that row's own inputs alone (the backend's numerical
contract), so padding never changes a real row's arithmetic: the graph's logits for a row
equal the eager forward pass's bit for bit (tested through the emulation; checked on the
device by gpu_check and at start-up by the invariance check, which runs decode batches).

Memory: the graphs' intermediate arrays come from a private CuPy memory pool (the graph
keeps using their addresses on every replay, so no other allocation may ever reuse them);
the first run of a bucket runs eagerly once on that pool (warm-up: kernels loaded, the
pool's blocks cached), then captures. Capture failure (an old driver, an operation that
cannot be captured) turns graphs off for this backend, logged once; the step then runs
eagerly, with identical results.

`GraphCapture` (real CUDA) and `ReplayByRerun` (the emulation: "replay" re-runs the
captured Python function on the same static buffers) share one interface, so the padding
and bucket logic is tested without a GPU.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import numpy as np

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# (kv, x [B, D], seqs [B], positions [B], tables [B, W] or None) -> logits [B, V]
StepBody = Callable[[Any, Any, Any, Any, Any], Any]


def bucket_for(rows: int) -> int | None:
    """The smallest bucket holding `rows` rows, or None past the largest (run eagerly)."""
    for b in BUCKETS:
        if rows <= b:
            return b
    return None


class ReplayByRerun:
    """The emulation's stand-in for graph capture: replaying re-runs the function (which
    reads the same static buffers), so everything but the CUDA graph itself is exercised."""

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        self.captures += 1
        return fn


class GraphCapture:
    """CUDA graph capture on a private non-blocking stream and a private memory pool.
    Replays are ordered after the current stream's work and before its later work by
    events, so eager steps on the current stream and graph replays never overlap."""

    def __init__(self, cp: Any):
        self.cp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.pool = cp.cuda.MemoryPool()
        self.captures = 0

    def _after_current(self) -> Any:
        cp = self.cp
        cur = cp.cuda.get_current_stream()
        self.stream.wait_event(cur.record())
        return cur

    def capture(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        cp = self.cp
        cur = self._after_current()
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            fn()  # warm-up: loads every kernel, caches the pool's blocks for the capture
            self.stream.begin_capture()
            try:
                out = fn()
            finally:
                graph = self.stream.end_capture()
        cur.wait_event(self.stream.record())
        self.captures += 1
        stream = self.stream

        def replay() -> Any:
            current = self._after_current()
            graph.launch(stream)
            current.wait_event(stream.record())
            return out

        return replay


class StepGraphs:
    """The captured decode steps of one backend, keyed by KV store (weakly), model and
    bucket; `run` pads, fills the static inputs, and replays (capturing on first use)."""

    def __init__(self, xp: Any, capturer: Any):
        self.xp = xp
        self.capturer = capturer
        self.enabled = True
        self.disabled_because: str | None = None
        self._by_kv: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

    def run(self, kv: Any, owner: Any, body: StepBody, x: Any, slots: np.ndarray,
            positions: np.ndarray, tables: np.ndarray | None = None) -> Any | None:
        """Logits [R, V] (device) of a decode step through the bucket's graph, or None when
        graphs are off or R is past the largest bucket (the caller runs `body` eagerly).
        `slots`: each row's sequence, a row of `tables` (host block tables [S, nb]), or a
        slot of the store's `slot_table` when `tables` is None."""
        R = int(x.shape[0])
        b = bucket_for(R)
        if not self.enabled or b is None or R == 0:
            return None
        pad = b - R
        spare_block = getattr(kv, "spare_block", None)
        if tables is None:  # a slotted store: padded rows use its spare slot
            spare_slot = getattr(kv, "spare_slot", None)
            if spare_slot is None:
                return None
            width, seq_pad, t = 0, np.full(pad, spare_slot, np.int32), None
        else:  # row i reads its own copy of its sequence's table row (the same blocks)
            nb = tables.shape[1]
            width = bucket_for(nb) or nb
            if spare_block is None:
                return None
            t = np.full((b, width), spare_block, np.int32)  # padded rows and columns: the spare block
            t[:R, :nb] = np.asarray(tables, np.int32)[np.asarray(slots, np.int64)]
            slots = np.arange(R, dtype=np.int32)
            seq_pad = np.arange(R, b, dtype=np.int32)
        xp = self.xp
        per_kv = self._by_kv.setdefault(kv, {})
        key = (id(owner), b, width)
        entry = per_kv.get(key)
        if entry is None:
            entry = per_kv[key] = _Entry(owner, xp, b, int(x.shape[1]), width)
        s = np.concatenate([np.asarray(slots, np.int32), seq_pad])
        p = np.concatenate([np.asarray(positions, np.int32), np.zeros(pad, np.int32)])
        entry.slots[...] = xp.asarray(s)
        entry.positions[...] = xp.asarray(p)
        if t is not None:
            entry.tables[...] = xp.asarray(t)
        entry.x[:R] = x
        if pad:
            entry.x[R:] = 0.0
        if entry.replay is None:
            kv_ref = weakref.ref(kv)  # the entry must not keep its key (the KV store) alive
            try:
                entry.replay = self.capturer.capture(
                    lambda: body(kv_ref(), entry.x, entry.slots, entry.positions, entry.tables))
            except Exception as e:  # no graphs on this device / driver: eager from now on
                self.enabled = False
                self.disabled_because = f"{type(e).__name__}: {e}"
                per_kv.pop(key, None)
                log.warning("CUDA graphs off, decode steps run eagerly (same results): %s",
                            self.disabled_because)
                return None
        return entry.replay()[:R]


class _Entry:
    """One bucket's static inputs and its replay."""

    def __init__(self, owner: Any, xp: Any, rows: int, width: int, table_width: int = 0):
        self.owner = owner  # keeps id(owner) unique while the entry lives
        self.x = xp.zeros((rows, width), xp.float32)
        self.slots = xp.zeros(rows, xp.int32)
        self.positions = xp.zeros(rows, xp.int32)
        self.tables = xp.zeros((rows, table_width), xp.int32) if table_width else None
        self.replay: Callable[[], Any] | None = None
