"""The folder of KV snapshots of one model, its index and its size bound.

Snapshots live in `<root>/<model id>/<tokens key>.kvsnap` (root: $XDG_CACHE_HOME/panechat/kv
by default), so a snapshot is found by the model file that made it and the token ids it
covers. The index (token ids of every snapshot of this model, read from the headers at
start) answers "which snapshot shares the longest prefix with this prompt". The whole root
is bounded (`max_bytes`, --kv-snapshot-memory): after each write the least recently used
files (oldest mtime; a restore touches its file) go first, any model's.

A file that fails any check (snapshot.read_snapshot: its sizes, its HMAC under the
installation's key, its model and shape) is ignored with ONE log line naming it and why,
and deleted; it is never used, and the other files stay in use. Thread-safe: the engine
thread looks up and loads, the writer thread saves.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import platformdirs

from panechat.engine.kv.snapshot_key import installation_key
from panechat.engine.kv.snapshot import SUFFIX, KVShape, SnapshotError, read_header, read_snapshot, tokens_key, write_snapshot

__all__ = ["SnapshotStore", "default_root", "common_prefix", "reason"]

log = logging.getLogger(__name__)


def default_root() -> Path:
    """$XDG_CACHE_HOME/panechat/kv (the platform's user cache dir elsewhere)."""
    return Path(platformdirs.user_cache_dir("panechat", appauthor=False)) / "kv"


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids two int32 arrays share (vectorised: no per-token Python)."""
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class SnapshotStore:
    """The snapshots of one model (`model_id`) and KV `shape` under `root`."""

    def __init__(self, root: Path, model_id: str, shape: KVShape, max_bytes: int, key: bytes | None = None):
        self.root = Path(root)
        self.dir = self.root / model_id
        self.model_id, self.shape, self.max_bytes = model_id, shape, max_bytes
        # signs and checks every file; default the installation's (snapshot_key.py)
        self.key = installation_key() if key is None else key
        self._lock = threading.Lock()
        self._index: dict[Path, np.ndarray] = {}
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in sorted(self.dir.glob("*" + SUFFIX)):
            try:
                head = read_header(p)
                if head.model_id != model_id or head.shape != shape:
                    raise SnapshotError("made by another model or for another KV shape")
            except Exception as e:  # noqa: BLE001 - one bad file never turns snapshots off
                self._reject(p, e)
                continue
            self._index[p] = head.tokens
        for p in self.dir.glob(".*.tmp"):  # a write cut short by a crash (not another live server's)
            if not _writer_alive(p):
                _unlink(p)

    def __len__(self) -> int:
        return len(self._index)

    def path_for(self, tokens: np.ndarray) -> Path:
        return self.dir / (tokens_key(tokens) + SUFFIX)

    def has(self, tokens: np.ndarray) -> bool:
        with self._lock:
            return self.path_for(tokens) in self._index

    def longest_prefix(self, prompt: np.ndarray) -> tuple[Path, int] | None:
        """The snapshot sharing the most leading ids with `prompt`, and how many; None when
        none shares any."""
        best: tuple[Path, int] | None = None
        with self._lock:
            for p, toks in self._index.items():
                n = common_prefix(toks, prompt)
                if n and (best is None or n > best[1]):
                    best = (p, n)
        return best

    def load(self, path: Path) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]] | None:
        """The snapshot at `path`, checked; None (one log line, file deleted) when it fails."""
        try:
            tokens, arrays = read_snapshot(path, self.model_id, self.shape, key=self.key)
        except FileNotFoundError:  # superseded or trimmed meanwhile by the writer: no damage
            with self._lock:
                self._index.pop(path, None)
            return None
        except Exception as e:  # noqa: BLE001 - SnapshotError, OSError, or a file too large to hold
            self._reject(path, e)
            return None
        with self._lock:
            self._index[path] = tokens
        try:
            os.utime(path)  # recently used: the size bound keeps it longest
        except OSError:
            pass
        return tokens, arrays

    def save(self, tokens: np.ndarray, arrays: list[tuple[np.ndarray, np.ndarray]]) -> Path | None:
        """Write a snapshot of `tokens` (replacing any of the same ids), drop the snapshots
        whose ids it extends (it serves all their prefixes), then trim the root to
        `max_bytes`. None when it does not fit the bound at all."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        need = self.shape.bytes_per_token() * tokens.size
        if need > self.max_bytes:
            return None
        path = self.path_for(tokens)
        write_snapshot(path, self.model_id, self.shape, tokens, arrays, key=self.key)
        with self._lock:
            superseded = [p for p, t in self._index.items()
                          if p != path and t.size < tokens.size and common_prefix(t, tokens) == t.size]
            for p in superseded:
                del self._index[p]
            self._index[path] = tokens
        for p in superseded:
            _unlink(p)
        self.trim(keep=path)
        return path

    def trim(self, keep: Path | None = None) -> None:
        """Delete the least recently used snapshots under the root (any model's) until the
        total is within `max_bytes`; `keep` goes last."""
        files = []
        for p in self.root.glob("*/*" + SUFFIX):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((p == keep, st.st_mtime_ns, st.st_size, p))
        total = sum(f[2] for f in files)
        for _, _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            _unlink(p)
            total -= size
            with self._lock:
                self._index.pop(p, None)

    def discard(self, path: Path) -> None:
        with self._lock:
            self._index.pop(path, None)
        _unlink(path)

    def _reject(self, path: Path, why: Exception) -> None:
        """The one log line for a snapshot that is not used, and its deletion."""
        log.warning("KV snapshot %s ignored and deleted: %s", path, reason(why))
        self.discard(path)


def reason(e: BaseException) -> str:
    """A never-empty one-line reason for an exception (MemoryError() says nothing)."""
    text = " ".join(str(e).split())
    return text if isinstance(e, SnapshotError) and text else (
        f"{type(e).__name__}: {text}" if text else type(e).__name__)


def _writer_alive(tmp: Path) -> bool:
    """Whether the process whose pid a temporary file's name holds (`.<name>.<pid>.<thread>.tmp`,
    snapshot.write_snapshot) is still running (POSIX; elsewhere: assume not)."""
    parts = tmp.name.split(".")
    if os.name != "posix" or len(parts) < 4 or not parts[-3].isdigit() or int(parts[-3]) == os.getpid():
        return False
    try:
        os.kill(int(parts[-3]), 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _unlink(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass
