"""Data derived from a model file, kept between runs in the user cache
($XDG_CACHE_HOME/panechat/derived, via platformdirs) under a key of the inputs' content.

A cache is only ever a shortcut: a missing, unreadable, corrupt or unwritable entry means
the caller derives the data again (and a fresh entry replaces the bad one). Each entry is
one int32 .npy array whose first row holds (rows, CRC-32 of the rest), so a damaged file
is detected, never used.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from pathlib import Path

import numpy as np


def cache_dir() -> Path:
    import platformdirs  # deferred: only when a cache is read or written

    return Path(platformdirs.user_cache_dir("panechat", appauthor=False)) / "derived"


def content_key(kind: str, *parts: bytes) -> str:
    """A file name for data of `kind` derived from `parts` (their SHA-256)."""
    h = hashlib.sha256(kind.encode())
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return f"{kind}-{h.hexdigest()[:32]}.npy"


def load_rows(key: str, width: int) -> np.ndarray | None:
    """The int32 [rows, width] array stored under `key`, or None (absent or damaged)."""
    try:
        a = np.load(cache_dir() / key, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if a.dtype != np.int32 or a.ndim != 2 or a.shape[1] != width or a.shape[0] < 1:
        return None
    rows = a[1:]
    head = a[0]
    if int(head[0]) != len(rows) or (width > 1 and int(head[1]) != _crc(rows)):
        return None
    return rows


def save_rows(key: str, rows: np.ndarray) -> None:
    """Store int32 [rows, width] (width >= 2) under `key`, atomically; failures are ignored."""
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    head = np.zeros((1, rows.shape[1]), np.int32)
    head[0, 0], head[0, 1] = len(rows), _crc(rows)
    target = cache_dir() / key
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, np.concatenate([head, rows]), allow_pickle=False)
        os.replace(tmp, target)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def _crc(rows: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(rows, dtype=np.int32).tobytes()) & 0x7FFFFFFF
