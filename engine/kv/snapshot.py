"""The KV snapshot file: one conversation's cached keys and values, on disk.

A snapshot holds the K and V of positions 0..n-1 of one sequence, for every layer, exactly
as the KV cache holds them (the bytes `Backend.kv_export` returns and `kv_import` puts
back), with the token ids they cover and the identity of the model that computed them.
KV at position i depends only on tokens 0..i, so a snapshot serves any prompt that shares
a prefix with its tokens, for that prefix.

Layout (docs/protocol.md, "KV snapshot files"; integers little-endian)::

    magic    8 bytes  b"PCKVSNAP"
    version  u32      2
    hlen     u32      bytes of the JSON header
    header   hlen     UTF-8 JSON: model_id, dtype, n_layer, n_kv, head_dim, n_tokens
    tokens   int32 x n_tokens
    payload  per layer: K then V, each [n_kv, n_tokens, head_dim] in `dtype`, C order
    digest   32 bytes HMAC-SHA256 of every byte before it, under the installation's key
                      (snapshot_key.py)

Reading checks everything: magic, version, header, the exact file size (against the sizes
the header claims, before anything is read or allocated), the digest, and that model,
dtype and shape are the reader's. Any mismatch raises `SnapshotError` (one line); the
caller deletes the file. The digest is keyed, so a file edited with any checksum
recomputed fails it too. Writing is atomic and durable: a temporary file in the same
folder, flushed to disk (fsync), then renamed into place and the folder synced, so a
reader sees a whole snapshot or none, also after a crash or a power cut.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from panechat.engine.kv.snapshot_key import installation_key

__all__ = ["MAGIC", "VERSION", "SUFFIX", "KVShape", "SnapshotHeader", "SnapshotError", "model_identity",
           "tokens_key", "write_snapshot", "read_header", "read_snapshot"]

MAGIC = b"PCKVSNAP"
VERSION = 2  # 2: the digest is an HMAC (1 had a plain blake2b, which anyone can recompute)
SUFFIX = ".kvsnap"
DIGEST_BYTES = 32
_PREAMBLE = struct.Struct("<8sII")  # magic, version, header length
_MAX_HEADER = 1 << 16  # the JSON header is ~150 bytes; a larger length is a damaged file
_MAX_TOKENS = 1 << 24  # more than any context: a header claiming more is damaged
_MAX_DIM = 1 << 16  # layers, KV heads, head dim


class SnapshotError(Exception):
    """A snapshot file that must not be used; the message is one line saying why."""


@dataclass(frozen=True)
class KVShape:
    """What a KV cache's snapshot must match: dtype name ('float32') and dimensions."""

    dtype: str
    n_layer: int
    n_kv: int
    head_dim: int

    def bytes_per_token(self) -> int:
        return 2 * self.n_layer * self.n_kv * self.head_dim * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class SnapshotHeader:
    model_id: str
    shape: KVShape
    tokens: np.ndarray  # int32 [n_tokens]

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)


def model_identity(path: str | Path, header_end: int) -> str:
    """A hex id of the model file: its resolved path, size and mtime_ns, and a digest of
    its GGUF header (bytes 0..header_end: metadata, vocabulary, tensor table). A changed,
    replaced or moved file gets another id, so its old snapshots are never used."""
    p = Path(path).resolve()
    st = p.stat()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0".encode("utf-8", "surrogateescape"))
    with open(p, "rb") as f:
        remaining = max(0, header_end)
        while remaining:
            chunk = f.read(min(remaining, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            remaining -= len(chunk)
    return h.hexdigest()


def tokens_key(tokens: np.ndarray) -> str:
    """The file stem for a snapshot of `tokens`: a digest of the ids (same ids, same file)."""
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype="<i4").tobytes(), digest_size=16).hexdigest()


def _header_bytes(model_id: str, shape: KVShape, n_tokens: int) -> bytes:
    head = json.dumps({"model_id": model_id, "dtype": shape.dtype, "n_layer": shape.n_layer, "n_kv": shape.n_kv,
                       "head_dim": shape.head_dim, "n_tokens": n_tokens}, sort_keys=True).encode()
    return _PREAMBLE.pack(MAGIC, VERSION, len(head)) + head


def file_size(shape: KVShape, n_tokens: int, header_len: int) -> int:
    """The exact size of a snapshot of `n_tokens` whose preamble+header take `header_len`."""
    return header_len + 4 * n_tokens + shape.bytes_per_token() * n_tokens + DIGEST_BYTES


def _mac(key: bytes):
    return hmac.new(key, digestmod=hashlib.sha256)


def write_snapshot(path: Path, model_id: str, shape: KVShape, tokens: np.ndarray,
                   arrays: list[tuple[np.ndarray, np.ndarray]], *, key: bytes | None = None) -> int:
    """Write a snapshot signed with `key` (default: the installation's), atomically and
    durably (temporary file in the same folder, fsync, rename, folder fsync); returns its
    size in bytes. `arrays` as `Backend.kv_export` returns them, of exactly `tokens.size`
    positions; ValueError when they do not match `shape`."""
    tokens = np.ascontiguousarray(tokens, dtype="<i4")
    n = int(tokens.size)
    want = (shape.n_kv, n, shape.head_dim)
    if len(arrays) != shape.n_layer:
        raise ValueError(f"snapshot of {len(arrays)} layers, the shape says {shape.n_layer}")
    dtype = np.dtype(shape.dtype).newbyteorder("<")
    for k, v in arrays:
        if k.shape != want or v.shape != want:
            raise ValueError(f"snapshot arrays of shape {k.shape}/{v.shape}, expected {want}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    h = _mac(installation_key() if key is None else key)
    size = 0
    try:
        with open(tmp, "wb") as f:
            def put(b) -> None:
                nonlocal size
                h.update(b)
                f.write(b)
                size += len(b)

            put(_header_bytes(model_id, shape, n))
            put(memoryview(tokens).cast("B"))
            for k, v in arrays:
                for a in (k, v):
                    put(memoryview(np.ascontiguousarray(a, dtype=dtype)).cast("B"))
            f.write(h.digest())
            size += DIGEST_BYTES
            f.flush()
            os.fsync(f.fileno())  # the bytes on disk before the name points at them
        os.replace(tmp, path)
        _sync_folder(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return size


def _sync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX; elsewhere the rename is what we have)."""
    if os.name != "posix":
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _parse_header(buf: bytes, path: Path) -> tuple[str, KVShape, int, int]:
    """(model_id, shape, n_tokens, header length) from the start of a file; the sizes it
    claims are bounded, so nothing sized by them can be huge."""
    if len(buf) < _PREAMBLE.size:
        raise SnapshotError("truncated (shorter than its header)")
    magic, version, hlen = _PREAMBLE.unpack_from(buf)
    if magic != MAGIC:
        raise SnapshotError("not a panechat KV snapshot (bad magic)")
    if version != VERSION:
        raise SnapshotError(f"snapshot format version {version}, this panechat reads {VERSION}")
    if hlen > _MAX_HEADER or len(buf) < _PREAMBLE.size + hlen:
        raise SnapshotError("truncated or damaged header")
    try:
        d = json.loads(bytes(buf[_PREAMBLE.size:_PREAMBLE.size + hlen]))
        shape = KVShape(str(d["dtype"]), int(d["n_layer"]), int(d["n_kv"]), int(d["head_dim"]))
        np.dtype(shape.dtype)
        n = int(d["n_tokens"])
        model_id = str(d["model_id"])
    except Exception as e:  # noqa: BLE001 - any garbage (nesting, inf, odd dtypes) is damage
        raise SnapshotError(f"damaged header ({type(e).__name__})") from None
    dims = (shape.n_layer, shape.n_kv, shape.head_dim)
    if not 1 <= n <= _MAX_TOKENS or not all(1 <= d <= _MAX_DIM for d in dims) or np.dtype(shape.dtype).itemsize < 1:
        raise SnapshotError(f"damaged header (impossible sizes: {n} tokens, {'x'.join(map(str, dims))} "
                            f"{shape.dtype})")
    return model_id, shape, n, _PREAMBLE.size + hlen


def _open_checked(f) -> tuple[str, KVShape, int, int]:
    """Parse the header of the open file `f` and check the file's size against it before
    anything else is read."""
    model_id, shape, n, hl = _parse_header(f.read(_PREAMBLE.size + _MAX_HEADER), Path(f.name))
    size = os.fstat(f.fileno()).st_size
    expect = file_size(shape, n, hl)
    if size != expect:
        raise SnapshotError(f"truncated or padded ({size} bytes, a snapshot of {n} tokens has {expect})")
    return model_id, shape, n, hl


def read_header(path: Path) -> SnapshotHeader:
    """The header and token ids of a snapshot, without reading or checking its payload
    (for the index; `read_snapshot` checks everything before any use)."""
    with open(path, "rb") as f:
        model_id, shape, n, hl = _open_checked(f)
        f.seek(hl)
        raw = f.read(4 * n)
    if len(raw) != 4 * n:
        raise SnapshotError("truncated (shrank while read)")
    return SnapshotHeader(model_id, shape, np.frombuffer(raw, dtype="<i4").astype(np.int32))


def read_snapshot(path: Path, model_id: str, shape: KVShape, *,
                  key: bytes | None = None) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """(tokens, per-layer (K, V)) of a snapshot, after checking its size (before reading
    it), its HMAC under `key` (default: the installation's), its model and shape;
    SnapshotError (one line) otherwise."""
    with open(path, "rb") as f:
        got_model, got_shape, n, hl = _open_checked(f)
        f.seek(0)
        buf = f.read()
    if len(buf) != file_size(got_shape, n, hl):
        raise SnapshotError("truncated (changed while read)")
    view = memoryview(buf)
    mac = _mac(installation_key() if key is None else key)
    mac.update(view[:-DIGEST_BYTES])
    if not hmac.compare_digest(mac.digest(), bytes(view[-DIGEST_BYTES:])):
        raise SnapshotError("checksum mismatch (its HMAC is not this installation's: the file was altered, "
                            "torn, or written elsewhere)")
    if got_model != model_id:
        raise SnapshotError(f"made by another model file (id {got_model[:12]}, this one is {model_id[:12]})")
    if got_shape != shape:
        raise SnapshotError(f"another KV shape ({got_shape.dtype} {got_shape.n_layer}x{got_shape.n_kv}x"
                            f"{got_shape.head_dim}, this cache is {shape.dtype} {shape.n_layer}x{shape.n_kv}x"
                            f"{shape.head_dim})")
    tokens = np.frombuffer(buf, dtype="<i4", count=n, offset=hl).astype(np.int32)
    dtype = np.dtype(shape.dtype).newbyteorder("<")
    per = n * shape.n_kv * shape.head_dim
    step = per * dtype.itemsize
    off = hl + 4 * n
    arrays = []
    for _ in range(shape.n_layer):
        k = np.frombuffer(buf, dtype=dtype, count=per, offset=off).reshape(shape.n_kv, n, shape.head_dim)
        v = np.frombuffer(buf, dtype=dtype, count=per, offset=off + step).reshape(shape.n_kv, n, shape.head_dim)
        arrays.append((k, v))
        off += 2 * step
    return tokens, arrays
