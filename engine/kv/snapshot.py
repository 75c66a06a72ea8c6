"""The KV snapshot file: one conversation's cached keys and values, on disk.

A snapshot holds the K and V of positions 0..n-1 of one sequence, for every layer, exactly
as the KV cache holds them (the bytes `Backend.kv_export` returns and `kv_import` puts
back), with the token ids they cover and the identity of the model that computed them.
KV at position i depends only on tokens 0..i, so a snapshot serves any prompt that shares
a prefix with its tokens, for that prefix.

Layout (docs/protocol.md, "KV snapshot files"; integers little-endian)::

    magic    8 bytes  b"PCKVSNAP"
    version  u32      1
    hlen     u32      bytes of the JSON header
    header   hlen     UTF-8 JSON: model_id, dtype, n_layer, n_kv, head_dim, n_tokens
    tokens   int32 x n_tokens
    payload  per layer: K then V, each [n_kv, n_tokens, head_dim] in `dtype`, C order
    digest   32 bytes blake2b-256 of every byte before it

Reading checks everything: magic, version, header, the exact file size, the digest, and
that model, dtype and shape are the reader's. Any mismatch raises `SnapshotError` (one
line); the caller ignores the file. Writing is atomic: a temporary file in the same folder,
then a rename, so a reader sees a whole snapshot or none (a torn file after a power cut
fails its digest).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["MAGIC", "VERSION", "SUFFIX", "KVShape", "SnapshotHeader", "SnapshotError", "model_identity",
           "tokens_key", "write_snapshot", "read_header", "read_snapshot"]

MAGIC = b"PCKVSNAP"
VERSION = 1
SUFFIX = ".kvsnap"
DIGEST_BYTES = 32
_PREAMBLE = struct.Struct("<8sII")  # magic, version, header length
_MAX_HEADER = 1 << 16  # the JSON header is ~150 bytes; a larger length is a damaged file


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


def write_snapshot(path: Path, model_id: str, shape: KVShape, tokens: np.ndarray,
                   arrays: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """Write a snapshot atomically (temporary file in the same folder, then rename);
    returns its size in bytes. `arrays` as `Backend.kv_export` returns them, of exactly
    `tokens.size` positions; ValueError when they do not match `shape`."""
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
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
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
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return size


def _parse_header(buf: bytes, path: Path) -> tuple[str, KVShape, int, int]:
    """(model_id, shape, n_tokens, header length) from the start of a file."""
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
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotError(f"damaged header ({type(e).__name__})") from None
    if n < 1 or min(shape.n_layer, shape.n_kv, shape.head_dim) < 1:
        raise SnapshotError("damaged header (impossible sizes)")
    return model_id, shape, n, _PREAMBLE.size + hlen


def read_header(path: Path) -> SnapshotHeader:
    """The header and token ids of a snapshot, without reading or checking its payload
    (for the index; `read_snapshot` checks everything before any use)."""
    with open(path, "rb") as f:
        start = f.read(_PREAMBLE.size + _MAX_HEADER)
        model_id, shape, n, hl = _parse_header(start, path)
        f.seek(hl)
        raw = f.read(4 * n)
        size = f.seek(0, 2)
    if len(raw) != 4 * n or size != file_size(shape, n, hl):
        raise SnapshotError(f"truncated or padded ({size} bytes, a snapshot of {n} tokens has "
                            f"{file_size(shape, n, hl)})")
    return SnapshotHeader(model_id, shape, np.frombuffer(raw, dtype="<i4").astype(np.int32))


def read_snapshot(path: Path, model_id: str, shape: KVShape) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """(tokens, per-layer (K, V)) of a snapshot, after checking its size, digest, model and
    shape; SnapshotError (one line) for anything else."""
    with open(path, "rb") as f:
        buf = f.read()
    got_model, got_shape, n, hl = _parse_header(buf, path)
    expect = file_size(got_shape, n, hl)
    if len(buf) != expect:
        raise SnapshotError(f"truncated or padded ({len(buf)} bytes, a snapshot of {n} tokens has {expect})")
    view = memoryview(buf)
    if hashlib.blake2b(view[:-DIGEST_BYTES], digest_size=DIGEST_BYTES).digest() != bytes(view[-DIGEST_BYTES:]):
        raise SnapshotError("checksum mismatch (the file was altered or torn)")
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
