"""Conversations, messages, pane layout and settings in SQLite (oterm's store, numbered migrations).

The database lives in the platform's user data dir (platformdirs), or in $PANECHAT_DATA_DIR
when set (the tests point it at a temporary folder). Every call runs on the UI thread and
touches a handful of rows, so plain synchronous sqlite3 is cheap enough; message text is
written once per finished reply, never per token.

The store survives damage (docs/tui.md, "History store"): opening runs `PRAGMA quick_check`
on a read-only connection; a damaged file is moved aside untouched, with its side files,
and a new store begins, said in one line. A file the store cannot use for another reason
(locked, read-only, another application's database, a newer schema) is left alone and
`StoreError` says why. An SQLite error later on never reaches the caller: one line, and
nothing more is written to that file.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import platformdirs

from .sqlite_migrations import SchemaTooNew, check_known, migrate, schema_tables, schema_version
from .sqlite_transaction import transaction

DATA_DIR_ENV = "PANECHAT_DATA_DIR"
DB_NAME = "panechat.db"
SIDE_FILES = ("-wal", "-shm", "-journal")  # SQLite keeps these next to the database; they belong to it
SQLITE_MAGIC = b"SQLite format 3\x00"
BUSY_TIMEOUT_S = 5.0  # another panechat holds the write lock for milliseconds; longer is a real lock
_DAMAGE_CODES = (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB (primary codes)

T = TypeVar("T")
Report = Callable[[str], None]

# Each entry upgrades the schema by one version (app/sqlite_migrations.py); never edit a shipped one.
MIGRATIONS: tuple[str, ...] = (
    # 1: conversations with per-conversation sampling settings, their messages, key/value settings
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        title TEXT NOT NULL,
        system TEXT NOT NULL DEFAULT '',
        temperature REAL NOT NULL DEFAULT 0.0,
        max_tokens INTEGER NOT NULL DEFAULT 512,
        seed INTEGER,
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        meta TEXT NOT NULL DEFAULT '{}',
        created REAL NOT NULL
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    """,
    # 2: pane layout per profile (local engine, or each --connect URL), in grid order
    """
    CREATE TABLE layout (
        profile TEXT NOT NULL,
        position INTEGER NOT NULL,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        PRIMARY KEY (profile, position)
    );
    """,
    # 3: the model a conversation talks to ('' = the default model), so a restart reopens it on it
    """
    ALTER TABLE conversations ADD COLUMN model TEXT NOT NULL DEFAULT '';
    """,
    # 4: a conversation's JSON output ('' free text, 'json' any object, or a JSON schema file's path)
    """
    ALTER TABLE conversations ADD COLUMN json_output TEXT NOT NULL DEFAULT '';
    """,
    # 5: the other continuations of a conversation (an earlier reply before a regenerate, the turns
    # after a user message before its edit): one row per branch point, its position in the history
    """
    CREATE TABLE branches (
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        state TEXT NOT NULL,
        PRIMARY KEY (conversation_id, position)
    );
    """,
    # 6: the conversation's other sampling settings (top_p, top_k, min_p, stop, penalties) as a JSON
    # object of the request schema's field names, only those set away from their defaults
    """
    ALTER TABLE conversations ADD COLUMN sampling TEXT NOT NULL DEFAULT '{}';
    """,
)

_CONV_COLUMNS = "id, title, system, temperature, max_tokens, seed, created, updated, model, json_output, sampling"


def data_dir() -> Path:
    """$PANECHAT_DATA_DIR, else the platform user data dir for panechat."""
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override).expanduser() if override else Path(platformdirs.user_data_dir("panechat", appauthor=False))


class StoreError(Exception):
    """The store file cannot be used and was left untouched (locked, unreadable, read-only,
    another application's database, a newer panechat's schema); the message is one line."""


def report_to_stderr(line: str) -> None:
    """The default way a store says something: one line on stderr."""
    print(f"panechat: {line}", file=sys.stderr)


def side_file(path: Path, suffix: str) -> Path:
    """SQLite's side file of `path` (`suffix` one of SIDE_FILES)."""
    return path.with_name(path.name + suffix)


def read_only_uri(path: Path) -> str:
    """An SQLite URI that opens `path` read-only: such a connection never writes the database."""
    return f"{path.absolute().as_uri()}?mode=ro"


def is_damage(e: sqlite3.Error) -> bool:
    """True when SQLite says the file is damaged (not a lock, a permission, a full disk)."""
    code = getattr(e, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in _DAMAGE_CODES
    return "malformed" in str(e) or "not a database" in str(e)


def unusable(path: Path, e: sqlite3.Error, verb: str) -> StoreError:
    """The one-line StoreError for an SQLite error that is not damage."""
    what = "is locked by another process" if "locked" in str(e) else f"cannot be {verb} ({e})"
    return StoreError(f"the history store {path} {what}; it was left as it is")


def find_damage(path: Path) -> str | None:
    """Why the store file at `path` is damaged, or None when it is usable: missing, empty (a new
    store), or a sound SQLite database with panechat's tables. Reads only (a read-only
    connection never checkpoints into the file). Raises StoreError for a file that is not
    damaged but must not be used: locked, unreadable, another application's, a newer schema."""
    try:
        size = path.stat().st_size if path.exists() else 0
        wal = side_file(path, "-wal")
        if size == 0:  # what sqlite3.connect leaves before the first write: no data to lose
            wal_size = wal.stat().st_size if wal.exists() else 0
            # SQLite would delete a WAL next to an empty database, and the messages in it
            return f"the database is empty but {wal.name} holds {wal_size} bytes" if wal_size else None
        with open(path, "rb") as f:
            if f.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
                return "not an SQLite database"
        db = sqlite3.connect(read_only_uri(path), uri=True, timeout=BUSY_TIMEOUT_S)
        try:
            # quick_check: every b-tree page, cell and freelist entry, in O(N); integrity_check
            # adds index-vs-table agreement at ~4x the time (0.16 vs 0.58 s for a 60 MB store)
            rows = db.execute("PRAGMA quick_check").fetchall()
            if rows != [("ok",)]:
                return "quick_check: " + " ".join(" ".join(str(r[0]) for r in rows[:3]).split())[:200]
            version = schema_version(db)
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            db.close()
    except sqlite3.Error as e:
        if is_damage(e):
            return str(e)
        raise unusable(path, e, "read") from None
    except OSError as e:
        raise StoreError(f"cannot read the history store {path} ({e.strerror or e})") from None
    tables = {t for t in tables if not t.startswith("sqlite_")}
    try:
        check_known(version, MIGRATIONS)
    except SchemaTooNew as e:
        raise too_new(path, e) from None
    if (version == 0 and tables) or not schema_tables(MIGRATIONS, version) <= tables:
        raise StoreError(f"{path} is not a panechat history store (its tables: {', '.join(sorted(tables)) or 'none'}); "
                         f"it was left as it is: move it or set ${DATA_DIR_ENV}")
    return None


def too_new(path: Path, e: SchemaTooNew) -> StoreError:
    """The one-line StoreError for a store a newer panechat wrote."""
    return StoreError(f"the history store {path} is from a newer panechat ({e}); it was left as it is: "
                      f"upgrade panechat or set ${DATA_DIR_ENV}")


def move_aside(path: Path) -> Path:
    """Rename the damaged store and its side files to `<name>.damaged-<local time>[-n]`,
    bytes untouched; returns the new path of the database. The side files move first: one
    left behind would be deleted by SQLite, with what it holds, when the new store is made."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside, n = path.with_name(f"{path.name}.damaged-{stamp}"), 1
    while any(side_file(aside, s).exists() for s in ("", *SIDE_FILES)):
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    for suffix in (*SIDE_FILES, ""):
        if side_file(path, suffix).exists():
            os.rename(side_file(path, suffix), side_file(aside, suffix))
    return aside


@dataclass
class Conversation:
    """One conversation: its title, system prompt and sampling settings."""

    id: str
    title: str
    system: str = ""
    temperature: float = 0.0
    max_tokens: int = 512
    seed: int | None = None
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    model: str = ""  # the model's name ('' = the backend's default model)
    json_output: str = ""  # '' free text, 'json' any JSON object, or a JSON schema file (app/tui/json_output.py)
    sampling: dict = field(default_factory=dict)  # the other request fields: top_p, stop, penalties, ...


def _conversation(row: tuple) -> Conversation:
    return Conversation(*row[:-1], sampling=json.loads(row[-1] or "{}"))


@dataclass
class Message:
    """A stored chat message; meta keeps the reply's finish reason, usage and timings."""

    role: str
    content: str
    meta: dict = field(default_factory=dict)
    id: int | None = None


class Store:
    """The SQLite store; `Store.open()` finds the data dir, checks the file and applies
    pending migrations.

    Opening a damaged file moves it aside (`move_aside`) and starts a new store, reported in
    one line; a file that must not be touched raises StoreError. Afterwards no read or write
    method raises an SQLite error: the first one is reported in one line (`report`, stderr
    by default; the TUI shows it as a notification) and kept in `write_error`; from then on
    writes are skipped (a damaged file is never written to) and failed reads return nothing.
    Every line reported is also kept in `notices`."""

    def __init__(self, path: Path, *, report: Report | None = None):
        self.path = path
        self.report: Report = report or report_to_stderr
        self.notices: list[str] = []  # every line reported so far, oldest first
        self.write_error: str | None = None  # why writing stopped; None while it goes on
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the history folder {path.parent} ({e.strerror or e})") from None
        damage = find_damage(path)
        if damage is not None:
            try:
                aside = move_aside(path)
            except OSError as e:
                raise StoreError(f"the history store {path} is damaged ({damage}) and could not be moved aside "
                                 f"({e.strerror or e})") from None
            self._say(f"the history store {path} was damaged ({damage}); moved it to {aside} and started a new one")
        self._connect()

    @classmethod
    def open(cls, folder: Path | None = None, *, report: Report | None = None) -> "Store":
        return cls((folder or data_dir()) / DB_NAME, report=report)

    def _connect(self) -> None:
        """Open the read-write connection and migrate, then probe a write (a read-only file or
        a lock held by another process is found now, not at the first message)."""
        db = self.db = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_S)
        try:
            db.execute("PRAGMA foreign_keys = ON")
            db.execute("PRAGMA journal_mode = WAL")
            # FULL: the WAL is fsynced at each commit (~4 ms here, once per message, never per token),
            # so even a power cut loses at most the message being written; NORMAL would be safe
            # for a killed process but could lose every message since the last checkpoint
            db.execute("PRAGMA synchronous = FULL")
            self.migrate()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(f"PRAGMA user_version = {self.version}")
            finally:
                db.execute("ROLLBACK")
        except SchemaTooNew as e:  # written by a newer panechat since find_damage looked
            db.close()
            raise too_new(self.path, e) from None
        except sqlite3.Error as e:
            db.close()
            raise unusable(self.path, e, "written") from None

    def close(self) -> None:
        """Close the connection. Once writing has stopped nothing more reaches the file: SQLite
        checkpoints the WAL into the database when its last connection closes, so a read-only
        connection holding a read lock stays open across the close (it cannot checkpoint itself)."""
        guard = None
        if self.write_error is not None:
            with contextlib.suppress(sqlite3.Error):
                guard = sqlite3.connect(read_only_uri(self.path), uri=True)
                guard.execute("PRAGMA user_version").fetchone()
        self.db.close()
        if guard is not None:
            guard.close()

    @property
    def version(self) -> int:
        return schema_version(self.db)

    def migrate(self) -> None:
        """Apply every migration newer than the file's user_version, in one transaction
        (app/sqlite_migrations.py)."""
        migrate(self.db, MIGRATIONS)

    # -- failures --------------------------------------------------------------------------
    def _say(self, line: str) -> None:
        self.notices.append(line)
        self.report(line)

    def _failed(self, e: sqlite3.Error) -> None:
        """Stop writing after an SQLite error, saying so once."""
        if self.write_error is not None:
            return
        self.write_error = str(e)
        if is_damage(e):
            self._say(f"the history store {self.path} is damaged ({e}); nothing more is written to it, "
                      "and the next start moves it aside")
        else:
            self._say(f"the history store {self.path} failed ({e}); nothing more is written to it this session")

    def _write(self, work: Callable[[sqlite3.Connection], T]) -> T | None:
        """Run `work` in one transaction; None, without writing, once writing has stopped."""
        if self.write_error is not None:
            return None
        try:
            with transaction(self.db):
                result = work(self.db)
        except sqlite3.Error as e:
            self._failed(e)
            return None
        return result

    def _read(self, sql: str, params: tuple = ()) -> list[tuple]:
        """The rows of one query; [] after an SQLite error (which also stops writing)."""
        try:
            return self.db.execute(sql, params).fetchall()
        except sqlite3.Error as e:
            self._failed(e)
            return []

    # -- conversations -------------------------------------------------------------------
    def new_conversation(self, title: str = "", *, conv_id: str | None = None, **settings) -> Conversation:
        """A new conversation (a fresh id unless `conv_id`, e.g. a server's conversation)."""
        conv = Conversation(id=conv_id or f"c-{uuid.uuid4().hex[:12]}", title=title or "New chat", **settings)
        self._write(lambda db: db.execute(
            f"INSERT INTO conversations ({_CONV_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (conv.id, conv.title, conv.system, conv.temperature, conv.max_tokens, conv.seed,
             conv.created, conv.updated, conv.model, conv.json_output, json.dumps(conv.sampling))))
        return conv

    def get_conversation(self, conv_id: str) -> Conversation | None:
        rows = self._read(f"SELECT {_CONV_COLUMNS} FROM conversations WHERE id = ?", (conv_id,))
        return _conversation(rows[0]) if rows else None

    def list_conversations(self) -> list[Conversation]:
        rows = self._read(f"SELECT {_CONV_COLUMNS} FROM conversations ORDER BY updated DESC")
        return [_conversation(r) for r in rows]

    def search_conversations(self, text: str) -> list[Conversation]:
        """The conversations whose title or any message holds `text` (case-insensitive for
        ASCII, SQLite's LIKE), most recently updated first; all of them for ''."""
        if not text.strip():
            return self.list_conversations()
        pattern = "%" + text.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self._read(
            f"SELECT {_CONV_COLUMNS} FROM conversations c WHERE title LIKE ? ESCAPE '\\' OR EXISTS "
            "(SELECT 1 FROM messages m WHERE m.conversation_id = c.id AND m.content LIKE ? ESCAPE '\\') "
            "ORDER BY updated DESC", (pattern, pattern))
        return [_conversation(r) for r in rows]

    def save_conversation(self, conv: Conversation) -> None:
        """Write back title, system prompt, sampling settings, model and JSON output."""
        conv.updated = time.time()
        self._write(lambda db: db.execute(
            "UPDATE conversations SET title = ?, system = ?, temperature = ?, max_tokens = ?, seed = ?, "
            "updated = ?, model = ?, json_output = ?, sampling = ? WHERE id = ?",
            (conv.title, conv.system, conv.temperature, conv.max_tokens, conv.seed, conv.updated, conv.model,
             conv.json_output, json.dumps(conv.sampling), conv.id)))

    def delete_conversation(self, conv_id: str) -> None:
        self._write(lambda db: db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,)))

    # -- messages --------------------------------------------------------------------------
    def add_message(self, conv_id: str, role: str, content: str, meta: dict | None = None) -> Message:
        """Store one message in one transaction (its id is None when it could not be stored)."""
        now = time.time()

        def insert(db: sqlite3.Connection) -> int | None:
            cur = db.execute(
                "INSERT INTO messages (conversation_id, role, content, meta, created) VALUES (?, ?, ?, ?, ?)",
                (conv_id, role, content, json.dumps(meta or {}), now))
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conv_id))
            return cur.lastrowid

        return Message(role, content, meta or {}, self._write(insert))

    def delete_message(self, message_id: int) -> None:
        """Forget one stored message (a prompt the backend refused)."""
        self._write(lambda db: db.execute("DELETE FROM messages WHERE id = ?", (message_id,)))

    def messages(self, conv_id: str) -> list[Message]:
        rows = self._read(
            "SELECT role, content, meta, id FROM messages WHERE conversation_id = ? ORDER BY id", (conv_id,))
        return [Message(role, content, json.loads(meta), mid) for role, content, meta, mid in rows]

    def replace_messages(self, conv_id: str, messages: list[Message]) -> None:
        """Make the stored history exactly `messages` (a remote server's copy wins, a
        branch flipped in); each message's `id` is its new row."""
        def replace(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM messages WHERE conversation_id = ?", (conv_id,))
            for m in messages:
                m.id = db.execute(
                    "INSERT INTO messages (conversation_id, role, content, meta, created) VALUES (?, ?, ?, ?, ?)",
                    (conv_id, m.role, m.content, json.dumps(m.meta), time.time())).lastrowid

        self._write(replace)

    # -- branches ----------------------------------------------------------------------------
    def save_branches(self, conv_id: str, branches: dict[int, dict]) -> None:
        """Make the stored branch points of `conv_id` exactly `branches` (position -> a JSON
        state, app/tui/branches.py)."""
        def save(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM branches WHERE conversation_id = ?", (conv_id,))
            db.executemany("INSERT INTO branches (conversation_id, position, state) VALUES (?, ?, ?)",
                           [(conv_id, pos, json.dumps(state)) for pos, state in sorted(branches.items())])

        self._write(save)

    def branches(self, conv_id: str) -> dict[int, dict]:
        """The branch points of `conv_id`: position in the history -> its state."""
        rows = self._read("SELECT position, state FROM branches WHERE conversation_id = ?", (conv_id,))
        return {pos: json.loads(state) for pos, state in rows}

    # -- layout ------------------------------------------------------------------------------
    def save_layout(self, profile: str, conversation_ids: list[str]) -> None:
        """Remember which conversations are open as panes, in grid order, for `profile`."""
        def save(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM layout WHERE profile = ?", (profile,))
            db.executemany(
                "INSERT INTO layout (profile, position, conversation_id) VALUES (?, ?, ?)",
                [(profile, i, cid) for i, cid in enumerate(conversation_ids)])

        self._write(save)

    def layout(self, profile: str) -> list[str]:
        rows = self._read("SELECT conversation_id FROM layout WHERE profile = ? ORDER BY position", (profile,))
        return [r[0] for r in rows]

    # -- settings ----------------------------------------------------------------------------
    def get_setting(self, key: str, default: str | None = None) -> str | None:
        rows = self._read("SELECT value FROM settings WHERE key = ?", (key,))
        return rows[0][0] if rows else default

    def set_setting(self, key: str, value: str) -> None:
        self._write(lambda db: db.execute(
            "INSERT INTO settings (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, value)))


def conversation_markdown(conv: Conversation, messages: list[Message]) -> str:
    """A conversation as a Markdown document (the export format)."""
    lines = [f"# {conv.title}", ""]
    settings = f"temperature {conv.temperature:g}, max tokens {conv.max_tokens}"
    if conv.seed is not None:
        settings += f", seed {conv.seed}"
    for name, value in conv.sampling.items():  # the other request fields set away from their defaults
        settings += f", {name.replace('_', ' ')} {json.dumps(value) if name == 'stop' else value}"
    lines += [f"*{settings}*", ""]
    if conv.system:
        lines += ["## System", "", conv.system, ""]
    for m in messages:
        lines += [f"## {m.role.capitalize()}", "", m.content.rstrip(), ""]
    return "\n".join(lines)
