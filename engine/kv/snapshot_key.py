"""The per-installation key that signs KV snapshot files (HMAC-SHA256, snapshot.py).

A snapshot is read back only when its HMAC under this key matches, so a file this
installation did not write (copied from elsewhere, or edited with its checksum recomputed)
is never used: the cache folder is not trusted, the key is. The key is 32 random bytes in
`<state dir>/kv-snapshot.key` ($XDG_STATE_HOME/panechat, the platform's user state folder
elsewhere), made once, mode 0600. Creation is atomic (a temporary file linked into place),
so two processes starting at once end up with the same key.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

import platformdirs

__all__ = ["KEY_BYTES", "default_key_path", "installation_key"]

log = logging.getLogger(__name__)

KEY_BYTES = 32
KEY_FILE = "kv-snapshot.key"


def default_key_path() -> Path:
    """$XDG_STATE_HOME/panechat/kv-snapshot.key (the platform's user state dir elsewhere)."""
    return Path(platformdirs.user_state_dir("panechat", appauthor=False)) / KEY_FILE


def installation_key(path: Path | None = None) -> bytes:
    """The key in `path` (default `default_key_path()`), made on first use. A key file of
    the wrong size is replaced (one log line: the snapshots it signed are then refused);
    one readable by others is set back to 0600. OSError when the folder cannot be written."""
    path = Path(path) if path is not None else default_key_path()
    key = _read(path)
    if key is not None and len(key) == KEY_BYTES:
        return key
    if key is not None:
        log.warning("KV snapshot key %s was damaged (%d bytes); made a new one", path, len(key))
    _create(path, replace=key is not None)
    key = _read(path)
    if key is None or len(key) != KEY_BYTES:
        raise OSError(f"the KV snapshot key {path} could not be made")
    return key


def _read(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            key = f.read(KEY_BYTES + 1)
    except FileNotFoundError:
        return None
    if os.name == "posix" and stat.S_IMODE(mode) & 0o077:
        os.chmod(path, 0o600)  # a key others can read signs nothing
    return key


def _create(path: Path, replace: bool) -> None:
    """Write a new random key to a private temporary file, then link it into place (an
    existing key wins unless `replace`)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if replace:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process made it first: that one is the key
            pass
        except OSError:  # no hard links here: create-exclusive instead
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return
            try:
                with open(tmp, "rb") as f:
                    os.write(fd, f.read())
                os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
