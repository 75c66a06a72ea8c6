"""Numbered schema migrations for panechat's SQLite files: the TUI's history (app/store.py)
and the server's conversations (app/server/conversation_db.py). oterm's store does the same.

A store lists its migrations oldest first, each an SQL script; migration n takes a file
from `PRAGMA user_version` n - 1 to n. `migrate` applies the pending ones in one
transaction, so a file is either upgraded whole or left as it was, and refuses a file newer
than the code (`SchemaTooNew`, which each store words in one line). Never edit a shipped
migration: add the next one.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Sequence

from .sqlite_transaction import transaction

__all__ = ["SchemaTooNew", "schema_version", "check_known", "migrate", "schema_tables"]


class SchemaTooNew(Exception):
    """The file's schema is newer than this panechat knows; it must be left as it is.
    `str()` is "schema 4, this one knows 3", for the store's own one-line message."""

    def __init__(self, version: int, known: int):
        super().__init__(f"schema {version}, this one knows {known}")
        self.version, self.known = version, known


def schema_version(db: sqlite3.Connection) -> int:
    """The file's `PRAGMA user_version`: the number of migrations applied (0: none)."""
    return db.execute("PRAGMA user_version").fetchone()[0]


def check_known(version: int, migrations: Sequence[str]) -> None:
    """SchemaTooNew when `version` is past the last of `migrations`."""
    if version > len(migrations):
        raise SchemaTooNew(version, len(migrations))


def _statements(script: str) -> list[str]:
    """The statements of `script` (a `;` inside a string or a trigger stays in its statement):
    `executescript` would commit the open transaction first."""
    out, buf = [], ""
    for piece in script.split(";"):
        buf += piece + ";"
        if sqlite3.complete_statement(buf):
            if buf.strip(" \t\r\n;"):
                out.append(buf.strip())
            buf = ""
    if buf.strip(" \t\r\n;"):
        out.append(buf.strip())
    return out


def migrate(db: sqlite3.Connection, migrations: Sequence[str]) -> int:
    """Bring the file (a connection in autocommit mode) up to the last of `migrations`: the
    pending ones and the new user_version in one transaction. Returns the version now;
    raises SchemaTooNew for a newer file (untouched) and sqlite3.Error as SQLite does (the
    transaction rolled back)."""
    version = schema_version(db)
    check_known(version, migrations)
    if version == len(migrations):
        return version
    with transaction(db):
        version = schema_version(db)  # under the write lock: another process may have migrated meanwhile
        check_known(version, migrations)
        for script in migrations[version:]:
            for stmt in _statements(script):
                db.execute(stmt)
        db.execute(f"PRAGMA user_version = {len(migrations)}")
    return len(migrations)


@functools.lru_cache(maxsize=None)
def schema_tables(migrations: tuple[str, ...], version: int) -> frozenset[str]:
    """The tables a file has at schema `version` (its first `version` migrations, run in memory)."""
    db = sqlite3.connect(":memory:")
    try:
        for script in migrations[:version]:
            db.executescript(script)
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        db.close()
    return frozenset(n for n in names if not n.startswith("sqlite_"))
