"""`--tokens FILE`: named access tokens, one `name token` per line, so requests and
terminals are attributed to a person and one person can be let go by deleting a line.

The file is re-read when its modification time or size changes (polled at most once a
second, on use and by each open websocket). A presented token is compared with every
entry in constant time (hmac.compare_digest over SHA-256 digests, no early exit), so the
time taken says nothing about which entry, or how much of one, matched.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from pathlib import Path

__all__ = ["NamedTokens", "TokensFileError", "parse_tokens"]

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
MIN_TOKEN = 8  # characters; a shorter token is guessed too easily
POLL_S = 1.0  # the file's mtime is looked at most this often


class TokensFileError(ValueError):
    """The tokens file cannot be used; one line naming the file, the line and the fix."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def parse_tokens(text: str, path: str = "--tokens") -> dict[str, bytes]:
    """name -> SHA-256 of its token, from the file's text (`#` comments and blank lines
    skipped). TokensFileError naming the first bad line."""
    out: dict[str, bytes] = {}
    seen: dict[bytes, str] = {}
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"{path} line {i}"
        if len(parts) != 2:
            raise TokensFileError(f"{where}: expected 'name token' (two words), got {len(parts)}")
        name, token = parts
        if not NAME.fullmatch(name):
            raise TokensFileError(f"{where}: the name {name[:64]!r} must be letters, digits and _ . @ - "
                                  "(at most 64), starting with a letter or digit")
        if len(token) < MIN_TOKEN:
            raise TokensFileError(f"{where}: the token of {name!r} is shorter than {MIN_TOKEN} characters; "
                                  "use a long random one (python -c 'import secrets; print(secrets.token_urlsafe())')")
        if name in out:
            raise TokensFileError(f"{where}: {name!r} is named twice; give each person one line")
        d = _digest(token)
        if d in seen:
            raise TokensFileError(f"{where}: {name!r} has the same token as {seen[d]!r}; give each its own")
        out[name], seen[d] = d, name
    return out


class NamedTokens:
    """The names and tokens of a --tokens file, kept current with the file.

    Construction reads it (TokensFileError, OSError). A later change that cannot be read
    or parsed keeps the previous entries and logs one line; a good one replaces them."""

    def __init__(self, path: str | os.PathLike, logger: logging.Logger | None = None):
        self.path = Path(path)
        self.log = logger or logging.getLogger("panechat.server")
        self._stamp = self._stat()
        self._entries = self._read()
        if not self._entries:
            raise TokensFileError(f"{self.path} names nobody: add a line 'name token' per person")
        self._checked = time.monotonic()
        self.generation = 0  # counts the reloads that changed the entries

    @property
    def names(self) -> tuple[str, ...]:
        """The names now in the file, in file order."""
        return tuple(self._entries)

    def name_of(self, presented: object) -> str | None:
        """The name whose token `presented` is, else None; every entry is compared."""
        self.refresh()
        if not isinstance(presented, str):
            return None
        d = _digest(presented)
        found = None
        for name, want in self._entries.items():
            if hmac.compare_digest(d, want) and found is None:
                found = name
        return found

    def still_valid(self, name: str, presented: str) -> bool:
        """True while `presented` is still `name`'s token (an open socket's check)."""
        return self.name_of(presented) == name

    def refresh(self, force: bool = False) -> None:
        """Re-read the file if it changed since it was last looked at (at most once a
        second unless `force`)."""
        now = time.monotonic()
        if not force and now - self._checked < POLL_S:
            return
        self._checked = now
        try:
            stamp = self._stat()
        except OSError as e:
            self.log.warning("--tokens %s cannot be read (%s); keeping the %d names it had", self.path,
                             e.strerror or e, len(self._entries))
            return
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            entries = self._read()
        except (OSError, TokensFileError) as e:
            self.log.warning("--tokens: %s; keeping the %d names it had", e, len(self._entries))
            return
        gone = [n for n in self._entries if n not in entries]
        self._entries = entries
        self.generation += 1
        self.log.info("--tokens %s re-read: %d names%s", self.path, len(entries),
                      f" ({', '.join(gone)} removed)" if gone else "")

    def _stat(self) -> tuple[int, int]:
        st = self.path.stat()
        return st.st_mtime_ns, st.st_size

    def _read(self) -> dict[str, bytes]:
        return parse_tokens(self.path.read_text(encoding="utf-8"), str(self.path))
