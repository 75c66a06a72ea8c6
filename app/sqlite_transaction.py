"""One SQLite write transaction, for the connections opened with isolation_level=None
(autocommit) that panechat's stores use: BEGIN IMMEDIATE takes the write lock up front,
COMMIT on success, ROLLBACK (if SQLite has not already rolled back) on any exception,
which then propagates."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator


@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
        raise
