"""The websocket conversations on disk: `/ws` conversations survive a server restart.

`ConversationDB` mirrors the server's `ConversationStore` (conversations.py) in SQLite,
`server-conversations.db` in the state folder (`--state-dir`, default the panechat data
folder, app/store.py's `data_dir()`). Every change is written through as it happens, on
the event loop, one small transaction each (WAL, synchronous=NORMAL: a killed server keeps
every committed change; well under a millisecond a message). The store's limits bound it
too: a conversation the store drops for memory is deleted here as well. At start the
server loads them back, least recently used first, within the same limits.

Patterns from the TUI's store (app/store.py): a read-only `quick_check` before use; a
damaged file is moved aside untouched (with its side files) and a new one begins, said in
one log line; after an SQLite error, one log line and nothing more is written (the server
keeps serving from memory). The schema grows by the same numbered migrations
(app/sqlite_migrations.py): a file a newer panechat wrote is left as it is.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from ..sqlite_migrations import SchemaTooNew, check_known, migrate, schema_version
from ..sqlite_transaction import transaction
from ..store import BUSY_TIMEOUT_S, SQLITE_MAGIC, is_damage, move_aside, read_only_uri

__all__ = ["ConversationDB", "StoredConversation", "DB_NAME"]

DB_NAME = "server-conversations.db"
# Each entry upgrades the schema by one version (app/sqlite_migrations.py); never edit a shipped one.
MIGRATIONS: tuple[str, ...] = (
    # 1: conversations and their messages, in order
    """
    CREATE TABLE IF NOT EXISTS conversations (
        id TEXT PRIMARY KEY,
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE IF NOT EXISTS messages (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL
    );
    CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, seq);
    """,
    # 2: a reply cut off by its terminal leaving (or the server stopping) is kept, marked
    """
    ALTER TABLE messages ADD COLUMN cut_off INTEGER NOT NULL DEFAULT 0;
    """,
)


class ConversationDBError(Exception):
    """The file cannot be used and was left as it is (one line)."""


@dataclass
class StoredConversation:
    id: str
    created: float
    updated: float
    messages: list[dict]


def _damage(path: Path) -> str | None:
    """Why the file is damaged, or None (missing, empty, or sound). Reads only."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    with open(path, "rb") as f:
        if f.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
            return "not an SQLite database"
    try:
        db = sqlite3.connect(read_only_uri(path), uri=True, timeout=BUSY_TIMEOUT_S)
        try:
            rows = db.execute("PRAGMA quick_check").fetchall()
            version = schema_version(db)
        finally:
            db.close()
    except sqlite3.Error as e:
        if is_damage(e):
            return str(e)
        raise ConversationDBError(f"the conversation store {path} cannot be read ({e})") from None
    if rows != [("ok",)]:
        return "quick_check: " + " ".join(str(r[0]) for r in rows[:3])[:200]
    try:
        check_known(version, MIGRATIONS)
    except SchemaTooNew as e:
        raise _too_new(path, e) from None
    return None


def _too_new(path: Path, e: SchemaTooNew) -> ConversationDBError:
    return ConversationDBError(f"the conversation store {path} is from a newer panechat ({e}); "
                               "it was left as it is: upgrade panechat or pass another --state-dir")


class ConversationDB:
    """The conversations of one server in SQLite; every method is safe to call after a
    failure (it then does nothing)."""

    def __init__(self, folder: Path, log: logging.Logger):
        self.path = Path(folder) / DB_NAME
        self.log = log
        self.failed: str | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConversationDBError(f"cannot create the state folder {self.path.parent} "
                                      f"({e.strerror or e})") from None
        damage = _damage(self.path)
        if damage is not None:
            aside = move_aside(self.path)
            log.warning("the conversation store %s was damaged (%s); moved it to %s and started a new one",
                        self.path, damage, aside)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_S,
                                      check_same_thread=False)
            self.db.execute("PRAGMA foreign_keys = ON")
            self.db.execute("PRAGMA journal_mode = WAL")
            self.db.execute("PRAGMA synchronous = NORMAL")
            migrate(self.db, MIGRATIONS)
        except SchemaTooNew as e:  # written by a newer panechat since _damage looked
            self.db.close()
            raise _too_new(self.path, e) from None
        except sqlite3.Error as e:
            raise ConversationDBError(f"the conversation store {self.path} cannot be written ({e})") from None

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.db.close()

    def _write(self, sql_batches: list[tuple[str, tuple]]) -> None:
        """Run the statements in one transaction; after an SQLite error, one log line and
        nothing more is written."""
        if self.failed is not None:
            return
        try:
            with transaction(self.db):
                for sql, params in sql_batches:
                    self.db.execute(sql, params)
        except sqlite3.Error as e:
            self.failed = str(e)
            self.log.warning("the conversation store %s failed (%s); conversations are kept in memory only "
                             "from now on", self.path, e)

    # -- what the ConversationStore calls --------------------------------------------------
    def created(self, cid: str, created: float, updated: float) -> None:
        self._write([("INSERT OR REPLACE INTO conversations (id, created, updated) VALUES (?, ?, ?)",
                      (cid, created, updated))])

    def appended(self, cid: str, role: str, content: str, updated: float, cut_off: bool = False) -> None:
        self._write([("INSERT INTO messages (conversation_id, role, content, cut_off) VALUES (?, ?, ?, ?)",
                      (cid, role, content, int(cut_off))),
                     ("UPDATE conversations SET updated = ? WHERE id = ?", (updated, cid))])

    def rewritten(self, cid: str, messages: list[dict], created: float, updated: float) -> None:
        stmts = [("INSERT OR REPLACE INTO conversations (id, created, updated) VALUES (?, ?, ?)",
                  (cid, created, updated)),
                 ("DELETE FROM messages WHERE conversation_id = ?", (cid,))]
        stmts += [("INSERT INTO messages (conversation_id, role, content, cut_off) VALUES (?, ?, ?, ?)",
                   (cid, m["role"], m["content"], int(bool(m.get("cut_off"))))) for m in messages]
        self._write(stmts)

    def deleted(self, cid: str) -> None:
        self._write([("DELETE FROM conversations WHERE id = ?", (cid,))])

    # -- start-up ----------------------------------------------------------------------------
    def load(self) -> list[StoredConversation]:
        """Every stored conversation, least recently updated first."""
        try:
            convs = {cid: StoredConversation(cid, created, updated, []) for cid, created, updated in
                     self.db.execute("SELECT id, created, updated FROM conversations ORDER BY updated, id")}
            for cid, role, content, cut_off in self.db.execute(
                    "SELECT conversation_id, role, content, cut_off FROM messages ORDER BY seq"):
                if cid in convs:
                    convs[cid].messages.append({"role": role, "content": content, **({"cut_off": True} if cut_off else {})})
        except sqlite3.Error as e:
            self.failed = str(e)
            self.log.warning("the conversation store %s could not be read (%s); starting without it", self.path, e)
            return []
        return list(convs.values())
