"""KV snapshot files are not trusted (issue 25, items 4 and 5): sizes in a header are
checked against the file before anything is allocated, a bad file is deleted with one line
naming it and why while the other files stay in use, and every file is signed with the
installation's key (HMAC-SHA256), so one edited with its checksum recomputed is refused."""

from __future__ import annotations

import hashlib
import json
import os
import logging
import stat
import struct

import numpy as np
import pytest

from panechat.engine.kv.snapshot import (MAGIC, VERSION, KVShape, SnapshotError, read_header, read_snapshot,
                                         write_snapshot)
from panechat.engine.kv.snapshot_key import KEY_BYTES, installation_key
from panechat.engine.kv.snapshot_store import SnapshotStore

SHAPE = KVShape("float32", 3, 2, 8)
LOGGER = "panechat.engine.kv.snapshot_store"


def _arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((2, n, 8)).astype(np.float32), rng.standard_normal((2, n, 8)).astype(np.float32))
            for _ in range(3)]


def _tokens(n, start=0):
    return (np.arange(start, start + n, dtype=np.int32) % 500).astype(np.int32)


def _forge(path):
    """Edit one K value and recompute a keyless checksum (blake2b-256, the version-1
    digest) over the file, as someone who can write the folder but lacks the key would."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    data[-32:] = hashlib.blake2b(bytes(data[:-32]), digest_size=32).digest()
    path.write_bytes(bytes(data))


def _header_claiming(path, n_tokens: int, body: int = 64) -> None:
    head = json.dumps({"model_id": "m", "dtype": "float32", "n_layer": 3, "n_kv": 2, "head_dim": 8,
                       "n_tokens": n_tokens}, sort_keys=True).encode()
    path.write_bytes(struct.pack("<8sII", MAGIC, VERSION, len(head)) + head + b"\0" * body)


def test_the_key_is_made_once_private_and_kept(tmp_path):
    path = tmp_path / "state" / "kv-snapshot.key"
    key = installation_key(path)
    assert len(key) == KEY_BYTES and path.read_bytes() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert installation_key(path) == key  # kept, not remade
    path.chmod(0o644)
    assert installation_key(path) == key and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_bytes(b"short")
    new = installation_key(path)
    assert len(new) == KEY_BYTES and new != key
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_a_file_edited_with_its_checksum_recomputed_is_refused(tmp_path):
    key = installation_key(tmp_path / "key")
    p = tmp_path / "a.kvsnap"
    write_snapshot(p, "m", SHAPE, _tokens(17), _arrays(17), key=key)
    read_snapshot(p, "m", SHAPE, key=key)  # whole and ours
    _forge(p)
    with pytest.raises(SnapshotError, match="checksum mismatch") as e:
        read_snapshot(p, "m", SHAPE, key=key)
    assert "HMAC" in str(e.value) and "\n" not in str(e.value)


def test_a_file_signed_by_another_installation_is_refused(tmp_path):
    p = tmp_path / "a.kvsnap"
    write_snapshot(p, "m", SHAPE, _tokens(17), _arrays(17), key=b"\1" * KEY_BYTES)
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        read_snapshot(p, "m", SHAPE, key=b"\2" * KEY_BYTES)


@pytest.mark.parametrize("n_tokens", [1 << 40, 1 << 20, 5])
def test_sizes_a_header_claims_are_checked_before_anything_is_read(tmp_path, n_tokens):
    p = tmp_path / "a.kvsnap"
    _header_claiming(p, n_tokens)
    for read in (lambda: read_header(p), lambda: read_snapshot(p, "m", SHAPE, key=b"k" * 32)):
        with pytest.raises(SnapshotError, match="impossible sizes|truncated or padded") as e:
            read()
        assert str(e.value) and "\n" not in str(e.value)


def test_a_bad_file_is_deleted_with_one_named_line_and_the_others_stay_in_use(tmp_path, caplog):
    key = installation_key(tmp_path / "key")
    store = SnapshotStore(tmp_path / "kv", "m", SHAPE, 1 << 30, key=key)
    good = store.save(_tokens(20), _arrays(20))
    forged = store.save(_tokens(20, start=200), _arrays(20, 1))
    _forge(forged)
    huge = store.dir / ("f" * 32 + ".kvsnap")
    _header_claiming(huge, 1 << 40)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    again = SnapshotStore(tmp_path / "kv", "m", SHAPE, 1 << 30, key=key)  # used to raise MemoryError
    (line,) = [r.getMessage() for r in caplog.records]
    assert str(huge) in line and "impossible sizes" in line and not huge.exists()
    assert len(again) == 2  # the forged file's header is whole: found by its payload's HMAC at use
    caplog.clear()
    assert again.load(forged) is None and not forged.exists()
    (line,) = [r.getMessage() for r in caplog.records]
    assert str(forged) in line and "checksum mismatch" in line
    tokens, _ = again.load(good)  # the other file is still used
    assert tokens.tolist() == _tokens(20).tolist() and len(again) == 1


def test_a_reason_is_never_empty():
    """`KV snapshots off: ` used to end there: MemoryError() says nothing."""
    from panechat.engine.kv.snapshot_store import reason

    assert reason(MemoryError()) == "MemoryError"
    assert reason(OSError(13, "Permission denied")) == "PermissionError: [Errno 13] Permission denied"
    assert reason(SnapshotError("truncated")) == "truncated"


def test_a_crashed_writers_temporary_file_is_deleted_a_live_ones_kept(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    folder = tmp_path / "kv" / "m"
    folder.mkdir(parents=True)
    crashed = folder / f".{'a' * 32}.kvsnap.{dead}.1.tmp"
    writing = folder / f".{'b' * 32}.kvsnap.{os.getppid()}.1.tmp"  # a live process (our parent)
    for p in (crashed, writing):
        p.write_bytes(b"partial")
    SnapshotStore(tmp_path / "kv", "m", SHAPE, 1 << 30, key=b"k" * 32)
    assert not crashed.exists() and writing.exists()
