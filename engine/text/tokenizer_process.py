"""A model's Hugging Face tokenizer built and run in a helper process.

Building the HF tokenizer of a large vocabulary is one Rust call that holds the GIL: gemma's
262k tokens and 515k merges take 1-3 s in `models.BPE`, and `Tokenizer.from_str` of the same
tokenizer takes longer (both measured). In a server, every other model's stream stops for it.
A model loaded while others serve therefore has its tokenizer built in a child process, which
then encodes for it: the same library configured from the same file by the same code
(`Tokenizer.from_metadata`), so the ids are the same, and the child's GIL is its own.

The child is `tokenizer_child`. Protocol (its stdin and stdout): a request is a 4-byte length, then one flag byte
(1: parse special tokens) and the text as UTF-8 (surrogates passed through); a reply is a
4-byte length, then a status byte and the ids as int32 (status 0), or a one-line error.
The child exits when its stdin closes, so it never outlives the server.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import numpy as np

__all__ = ["TokenizerProcess"]

_LEN = struct.Struct("<I")
OK, ERROR = 0, 1


class TokenizerProcess:
    """The HF part of one model's tokenizer, in a child process started at construction
    (it builds while the caller loads the weights). `encode` is thread-safe; `wait_ready`
    raises `ValueError` (one line) when the child could not build the tokenizer. A child
    that dies later is started again once per request that finds it gone."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self._lock = threading.Lock()
        self._closed = False
        self._spawn()

    def _spawn(self) -> None:
        self._ready: str | None | bool = False  # False: not yet known; None: ready; str: the error
        self._p = subprocess.Popen(
            [sys.executable, "-m", "panechat.engine.text.tokenizer_child", self.path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, bufsize=0)
        # closing stdin ends the child; a dropped TokenizerProcess closes it too
        self._finalizer = weakref.finalize(self, _close, self._p)

    def wait_ready(self) -> None:
        """Block until the child has built the tokenizer; raise ValueError if it could not."""
        with self._lock:
            self._wait_ready()

    def _wait_ready(self) -> None:
        if self._ready is False:
            try:
                status, payload = self._read()
                self._ready = None if status == OK else payload.decode("utf-8", "replace")
            except ValueError:
                self._ready = f"the tokenizer process ended before it was built (exit status {self._p.wait()})"
        if self._ready is not None:
            raise ValueError(self._ready)

    def encode(self, text: str, parse_special: bool) -> list[int]:
        """The ids the model's HF tokenizer gives `text` (no BOS/EOS added)."""
        data = bytes([1 if parse_special else 0]) + text.encode("utf-8", "surrogatepass")
        with self._lock:
            self._wait_ready()
            try:
                status, payload = self._ask(data)
            except (OSError, ValueError):
                if self._closed:
                    raise RuntimeError(f"the tokenizer of {self.path} is closed") from None
                self._finalizer()
                self._spawn()  # it died (killed, out of memory): once more with a new one
                self._wait_ready()
                try:
                    status, payload = self._ask(data)
                except (OSError, ValueError) as e:
                    raise RuntimeError(f"the tokenizer process of {self.path} stopped: {e}") from None
        if status != OK:
            raise RuntimeError(payload.decode("utf-8", "replace"))
        return np.frombuffer(payload, np.int32).tolist()

    def close(self) -> None:
        """End the child (idempotent); encoding fails after."""
        self._closed = True
        self._finalizer()

    def _ask(self, data: bytes) -> tuple[int, bytes]:
        self._p.stdin.write(_LEN.pack(len(data)) + data)
        return self._read()

    def _read(self) -> tuple[int, bytes]:
        head = _read_exact(self._p.stdout, _LEN.size)
        body = _read_exact(self._p.stdout, _LEN.unpack(head)[0])
        return body[0], body[1:]


def _close(p: subprocess.Popen) -> None:
    try:
        p.stdin.close()
        p.wait(5)
    except (OSError, subprocess.TimeoutExpired):
        p.kill()


def _read_exact(stream, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise ValueError("the tokenizer process ended")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def reply(out, status: int, payload: bytes) -> None:
    """Write one reply of the protocol to `out` (the child's side)."""
    out.write(_LEN.pack(len(payload) + 1) + bytes([status]) + payload)
    out.flush()


def read_request(inp) -> tuple[str, bool] | None:
    """One request of the protocol from `inp`: (text, parse_special), or None at its end."""
    try:
        head = _read_exact(inp, _LEN.size)
        body = _read_exact(inp, _LEN.unpack(head)[0])
    except ValueError:
        return None
    return body[1:].decode("utf-8", "surrogatepass"), bool(body[0])
