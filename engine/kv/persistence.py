"""KV snapshots for the engine: what it calls when KV is about to be lost or could be reused.

The engine calls a `KVPersistence` at three points (engine.py, "snapshots"):

- `save(blocks, tokens)`: cached KV blocks of a sequence are evicted by the block pool
  (or the engine stops): the KV of its tokens is exported from its blocks on the compute
  thread (a memory copy, between steps, before the blocks are reused) and written by a
  writer thread, so the step loop never waits for the disk;
- `restore(blocks, prompt, resident, start)`: a request was admitted into `blocks`; when a
  snapshot (on disk or still waiting to be written) shares more of its prompt than the
  prefix cache gave it, its KV is imported into the request's own blocks (positions from
  `start`, past the shared ones) instead of re-prefilled; returns the tokens now cached;
- `close()`: the engine stops; waits until every queued snapshot is on disk.

KV at position i depends only on tokens 0..i and is stored bit for bit, so a restored
prefix gives the same answer as a recomputed one. A snapshot holds the cache's own dtype
(float16 by default), so no value is rounded again on the way back.
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

from panechat.backends.paged_kv import BLOCK_TOKENS
from panechat.engine.gguf.header import read_gguf_header
from panechat.engine.kv.snapshot import KVShape, model_identity
from panechat.engine.kv.snapshot_store import SnapshotStore, common_prefix, reason

__all__ = ["KVPersistence"]

log = logging.getLogger(__name__)

#: Exported KV waiting for the writer at most (bytes); past it a snapshot is skipped.
MAX_PENDING_BYTES = 1 << 30
#: A restore must save at least this many prompt tokens over the resident cache (and at
#: least `min_tokens`): reading a snapshot costs its whole file, whatever it saves.
MIN_GAIN = 16

Arrays = list[tuple[np.ndarray, np.ndarray]]


class KVPersistence:
    """Snapshots of one engine's KV in a `SnapshotStore`; counts go to `count(written,
    restored)` (the engine's metrics)."""

    def __init__(self, store: SnapshotStore, backend: Any, kv: Any, min_tokens: int,
                 count: Callable[[int, int], None] | None = None):
        self.store, self.be, self.kv = store, backend, kv
        self.min_tokens = max(1, min_tokens)
        self.min_gain = max(MIN_GAIN, self.min_tokens)
        self.count = count or (lambda written, restored: None)
        self._lock = threading.Lock()
        self._pending: dict[Path, tuple[np.ndarray, Arrays]] = {}
        self._pending_bytes = 0
        self._q: queue.Queue[Path | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="panechat-kv-writer", daemon=True)
        self._writer.start()

    @classmethod
    def open(cls, root: Path, model_path: Path, shape: KVShape, max_bytes: int, backend: Any, kv: Any,
             min_tokens: int, count: Callable[[int, int], None] | None = None) -> "KVPersistence":
        """The snapshots of the model file at `model_path` under `root` (its folder is
        made; stale files are dropped, each with one log line)."""
        model_id = model_identity(model_path, read_gguf_header(model_path).data_start)
        return cls(SnapshotStore(root, model_id, shape, max_bytes), backend, kv, min_tokens, count)

    # -- the engine's calls (compute thread) ------------------------------------------------
    def save(self, where: list[int], tokens: list[int]) -> bool:
        """Queue a snapshot of the KV of `tokens` cached in blocks `where`; False when it is too
        short, already on disk or queued, or the writer is too far behind."""
        if len(tokens) < self.min_tokens:
            return False
        ids = np.asarray(tokens, dtype=np.int32)
        path = self.store.path_for(ids)
        need = self.store.shape.bytes_per_token() * ids.size
        with self._lock:
            if path in self._pending or self.store.has(ids):
                return False
            if self._pending_bytes + need > MAX_PENDING_BYTES:
                log.warning("KV snapshot of %d tokens skipped: %d MiB still waiting to be written",
                            ids.size, self._pending_bytes >> 20)
                return False
            arrays = self.be.kv_export(self.kv, where, int(ids.size))
            self._pending[path] = (ids, arrays)
            self._pending_bytes += need
        self._q.put(path)
        return True

    def restore(self, where: list[int], prompt: list[int], resident: int, start: int = 0) -> int:
        """Import the snapshot sharing the longest prefix with `prompt` into blocks `where`
        (the sequence's block table) when it beats the `resident` tokens by `min_gain`;
        returns the prompt tokens cached there now (`resident` when nothing was restored).
        Positions before `start` (a multiple of BLOCK_TOKENS, <= resident: blocks shared
        with other sequences) are not written. At least one prompt token is left to
        compute, so the step yields logits."""
        limit = len(prompt) - 1
        if limit - resident < self.min_gain:
            return resident
        ids = np.asarray(prompt, dtype=np.int32)
        best = self.store.longest_prefix(ids)
        with self._lock:
            for path, (toks, arrays) in self._pending.items():
                n = common_prefix(toks, ids)
                if best is None or n > best[1]:
                    best = (path, n)
            pending = self._pending.get(best[0]) if best is not None else None
        if best is None or min(best[1], limit) - resident < self.min_gain:
            return resident
        if pending is not None:
            arrays = pending[1]
        else:
            loaded = self.store.load(best[0])
            if loaded is None:  # failed a check: logged and deleted; the prompt is prefilled
                return resident
            toks, arrays = loaded
            if common_prefix(toks, ids) != best[1]:  # the index was stale: take no chances
                return resident
        n = min(best[1], limit)
        if start % BLOCK_TOKENS or start > resident:
            raise ValueError(f"restore: start {start} is not a block boundary within the resident tokens")
        self.be.kv_import(self.kv, list(where)[start // BLOCK_TOKENS:],
                          [(k[:, start:n], v[:, start:n]) for k, v in arrays])
        self.count(0, 1)
        return n

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, then stop the writer."""
        self._q.put(None)
        self._writer.join(timeout)

    # -- the writer thread ---------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            path = self._q.get()
            if path is None:
                return
            with self._lock:
                ids, arrays = self._pending[path]
            try:
                if self.store.save(ids, arrays) is not None:
                    self.count(1, 0)
            except Exception as e:  # a full disk, a removed folder: the cache just misses
                log.warning("KV snapshot of %d tokens not written: %s", ids.size, reason(e))
            finally:
                with self._lock:
                    del self._pending[path]
                    self._pending_bytes -= self.store.shape.bytes_per_token() * ids.size
