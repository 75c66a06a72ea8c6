"""The KV snapshot file and its folder: written atomically, read back bit for bit, and any
damage or mismatch (truncated, one byte flipped, another model, another shape) refused
with one line, the file then deleted and never used; the folder bounded by size (LRU)."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from panechat.engine.kv.snapshot import (
    KVShape,
    SnapshotError,
    model_identity,
    read_header,
    read_snapshot,
    write_snapshot,
)
from panechat.engine.kv.snapshot_store import SnapshotStore

SHAPE = KVShape("float32", 3, 2, 8)


def _arrays(n, seed=0, shape=SHAPE):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((shape.n_kv, n, shape.head_dim)).astype(np.float32),
             rng.standard_normal((shape.n_kv, n, shape.head_dim)).astype(np.float32))
            for _ in range(shape.n_layer)]


def _tokens(n, start=0):
    return np.arange(start, start + n, dtype=np.int32) % 500


def test_write_then_read_is_bit_exact(tmp_path):
    arrays, toks = _arrays(17), _tokens(17)
    p = tmp_path / "a.kvsnap"
    size = write_snapshot(p, "model-a", SHAPE, toks, arrays)
    assert size == p.stat().st_size
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]  # renamed into place
    got_toks, got = read_snapshot(p, "model-a", SHAPE)
    assert got_toks.tolist() == toks.tolist()
    for (k0, v0), (k1, v1) in zip(arrays, got):
        assert k0.tobytes() == k1.tobytes() and v0.tobytes() == v1.tobytes()
    head = read_header(p)
    assert head.model_id == "model-a" and head.shape == SHAPE and head.tokens.tolist() == toks.tolist()


def _damaged(tmp_path, how):
    p = tmp_path / "a.kvsnap"
    write_snapshot(p, "model-a", SHAPE, _tokens(17), _arrays(17))
    data = bytearray(p.read_bytes())
    if how == "truncated":
        data = data[: len(data) - 100]
    elif how == "flipped":
        data[len(data) // 2] ^= 0x01  # one bit of one payload byte
    elif how == "flipped-token":
        data[80] ^= 0x01
    elif how == "padded":
        data += b"\0"
    elif how == "magic":
        data[0] ^= 0xFF
    p.write_bytes(bytes(data))
    return p


@pytest.mark.parametrize("how,why", [("truncated", "truncated"), ("flipped", "checksum"),
                                     ("flipped-token", "checksum|damaged"), ("padded", "truncated or padded"),
                                     ("magic", "bad magic")])
def test_damage_is_refused_in_one_line(tmp_path, how, why):
    p = _damaged(tmp_path, how)
    with pytest.raises(SnapshotError, match=why) as e:
        read_snapshot(p, "model-a", SHAPE)
    assert "\n" not in str(e.value)


def test_another_model_or_shape_is_refused(tmp_path):
    p = tmp_path / "a.kvsnap"
    write_snapshot(p, "model-a", SHAPE, _tokens(5), _arrays(5))
    with pytest.raises(SnapshotError, match="another model"):
        read_snapshot(p, "model-b", SHAPE)
    with pytest.raises(SnapshotError, match="another KV shape"):
        read_snapshot(p, "model-a", KVShape("float32", 3, 2, 16))
    with pytest.raises(SnapshotError, match="another KV shape"):
        read_snapshot(p, "model-a", KVShape("float16", 3, 2, 8))


def test_model_identity_changes_with_the_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\1" * 100)
    a = model_identity(f, 50)
    assert a == model_identity(f, 50)
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    b = model_identity(f, 50)
    assert b != a
    f.write_bytes(b"GGUF" + b"\2" * 100)  # header bytes differ, same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert model_identity(f, 50) != b


def test_store_finds_the_longest_shared_prefix(tmp_path):
    store = SnapshotStore(tmp_path, "m", SHAPE, 1 << 30)
    a = _tokens(40)
    b = np.concatenate([_tokens(10), _tokens(30, start=300)])
    pa, pb = store.save(a, _arrays(40, 1)), store.save(b, _arrays(40, 2))
    prompt = np.concatenate([a[:25], [7, 7]]).astype(np.int32)
    assert store.longest_prefix(prompt) == (pa, 25)
    assert store.longest_prefix(np.concatenate([b, [1]]).astype(np.int32)) == (pb, 40)
    assert store.longest_prefix(np.array([499], np.int32)) is None
    # a reopened store indexes the same files
    again = SnapshotStore(tmp_path, "m", SHAPE, 1 << 30)
    assert len(again) == 2 and again.longest_prefix(prompt) == (pa, 25)


def test_a_longer_snapshot_supersedes_its_prefixes(tmp_path):
    store = SnapshotStore(tmp_path, "m", SHAPE, 1 << 30)
    short = store.save(_tokens(20), _arrays(20))
    long_ = store.save(_tokens(30), _arrays(30))
    assert not short.exists() and long_.exists() and len(store) == 1


def test_store_is_bounded_least_recently_used_first(tmp_path):
    per = SHAPE.bytes_per_token() * 20 + 4 * 20 + 200  # ~ one file
    store = SnapshotStore(tmp_path, "m", SHAPE, int(2.5 * per))
    paths = [store.save(_tokens(20, start=100 * i), _arrays(20, i)) for i in range(2)]
    os.utime(paths[0], ns=(1, 1))  # the first is the oldest ...
    assert store.load(paths[0]) is not None  # ... until it is used
    third = store.save(_tokens(20, start=300), _arrays(20, 3))
    assert paths[0].exists() and not paths[1].exists() and third.exists()
    assert store.save(_tokens(100, start=5), _arrays(100)) is None  # never fits: not written


def test_store_ignores_and_deletes_bad_files_with_one_log_line(tmp_path, caplog):
    store = SnapshotStore(tmp_path, "m", SHAPE, 1 << 30)
    good = store.save(_tokens(20), _arrays(20))
    bad = store.save(_tokens(20, start=200), _arrays(20, 1))
    data = bytearray(bad.read_bytes())
    data[-40] ^= 0x10
    bad.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="panechat.engine.kv.snapshot_store")
    assert store.load(bad) is None
    assert not bad.exists()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "checksum" in lines[0] and bad.name in lines[0]
    assert store.load(good) is not None
    # at open: a truncated file and one of another model are dropped, one line each
    caplog.clear()
    cut = store.dir / ("0" * 32 + ".kvsnap")
    cut.write_bytes(good.read_bytes()[:300])
    other = tmp_path / "m" / ("1" * 32 + ".kvsnap")
    write_snapshot(other, "another-model", SHAPE, _tokens(3), _arrays(3))
    again = SnapshotStore(tmp_path, "m", SHAPE, 1 << 30)
    assert len(again) == 1 and not cut.exists() and not other.exists()
    assert len(caplog.records) == 2
