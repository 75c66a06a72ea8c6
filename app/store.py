"""Conversations, messages, pane layout and settings in SQLite (oterm's store, numbered migrations).

The database lives in the platform's user data dir (platformdirs), or in $PANECHAT_DATA_DIR
when set (the tests point it at a temporary folder). Every call runs on the UI thread and
touches a handful of rows, so plain synchronous sqlite3 is cheap enough; message text is
written once per finished reply, never per token.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

DATA_DIR_ENV = "PANECHAT_DATA_DIR"
DB_NAME = "panechat.db"

# Each entry upgrades the schema by one version (PRAGMA user_version); never edit a shipped one.
MIGRATIONS: list[str] = [
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
]


def data_dir() -> Path:
    """$PANECHAT_DATA_DIR, else the platform user data dir for panechat."""
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override).expanduser() if override else Path(platformdirs.user_data_dir("panechat", appauthor=False))


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


@dataclass
class Message:
    """A stored chat message; meta keeps the reply's finish reason, usage and timings."""

    role: str
    content: str
    meta: dict = field(default_factory=dict)
    id: int | None = None


class Store:
    """The SQLite store; `Store.open()` finds the data dir and applies pending migrations."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, isolation_level=None)  # autocommit; `with self.db` for transactions
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = NORMAL")  # WAL: no fsync per commit, never corrupt
        self.migrate()

    @classmethod
    def open(cls, folder: Path | None = None) -> "Store":
        return cls((folder or data_dir()) / DB_NAME)

    def close(self) -> None:
        self.db.close()

    @property
    def version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def migrate(self) -> None:
        """Apply every migration newer than the file's user_version, each in one transaction."""
        for n, script in enumerate(MIGRATIONS, start=1):
            if n <= self.version:
                continue
            self.db.execute("BEGIN")
            try:
                for stmt in filter(str.strip, script.split(";")):
                    self.db.execute(stmt)
                self.db.execute(f"PRAGMA user_version = {n}")
                self.db.execute("COMMIT")
            except Exception:
                self.db.execute("ROLLBACK")
                raise

    # -- conversations -------------------------------------------------------------------
    def new_conversation(self, title: str = "", *, conv_id: str | None = None, **settings) -> Conversation:
        """A new conversation (a fresh id unless `conv_id`, e.g. a server's conversation)."""
        conv = Conversation(id=conv_id or f"c-{uuid.uuid4().hex[:12]}", title=title or "New chat", **settings)
        self.db.execute(
            "INSERT INTO conversations (id, title, system, temperature, max_tokens, seed, created, updated) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (conv.id, conv.title, conv.system, conv.temperature, conv.max_tokens, conv.seed,
             conv.created, conv.updated),
        )
        return conv

    def get_conversation(self, conv_id: str) -> Conversation | None:
        row = self.db.execute(
            "SELECT id, title, system, temperature, max_tokens, seed, created, updated "
            "FROM conversations WHERE id = ?", (conv_id,)).fetchone()
        return Conversation(*row) if row else None

    def list_conversations(self) -> list[Conversation]:
        rows = self.db.execute(
            "SELECT id, title, system, temperature, max_tokens, seed, created, updated "
            "FROM conversations ORDER BY updated DESC").fetchall()
        return [Conversation(*r) for r in rows]

    def save_conversation(self, conv: Conversation) -> None:
        """Write back title, system prompt and sampling settings."""
        conv.updated = time.time()
        self.db.execute(
            "UPDATE conversations SET title = ?, system = ?, temperature = ?, max_tokens = ?, seed = ?, "
            "updated = ? WHERE id = ?",
            (conv.title, conv.system, conv.temperature, conv.max_tokens, conv.seed, conv.updated, conv.id),
        )

    def delete_conversation(self, conv_id: str) -> None:
        self.db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))

    # -- messages --------------------------------------------------------------------------
    def add_message(self, conv_id: str, role: str, content: str, meta: dict | None = None) -> Message:
        now = time.time()
        with self.db:
            self.db.execute("BEGIN")
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, role, content, meta, created) VALUES (?, ?, ?, ?, ?)",
                (conv_id, role, content, json.dumps(meta or {}), now),
            )
            self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conv_id))
        return Message(role, content, meta or {}, cur.lastrowid)

    def messages(self, conv_id: str) -> list[Message]:
        rows = self.db.execute(
            "SELECT role, content, meta, id FROM messages WHERE conversation_id = ? ORDER BY id",
            (conv_id,)).fetchall()
        return [Message(role, content, json.loads(meta), mid) for role, content, meta, mid in rows]

    def replace_messages(self, conv_id: str, messages: list[Message]) -> None:
        """Make the stored history exactly `messages` (a remote server's copy wins)."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM messages WHERE conversation_id = ?", (conv_id,))
            for m in messages:
                self.db.execute(
                    "INSERT INTO messages (conversation_id, role, content, meta, created) VALUES (?, ?, ?, ?, ?)",
                    (conv_id, m.role, m.content, json.dumps(m.meta), time.time()))

    # -- layout ------------------------------------------------------------------------------
    def save_layout(self, profile: str, conversation_ids: list[str]) -> None:
        """Remember which conversations are open as panes, in grid order, for `profile`."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM layout WHERE profile = ?", (profile,))
            self.db.executemany(
                "INSERT INTO layout (profile, position, conversation_id) VALUES (?, ?, ?)",
                [(profile, i, cid) for i, cid in enumerate(conversation_ids)])

    def layout(self, profile: str) -> list[str]:
        rows = self.db.execute(
            "SELECT conversation_id FROM layout WHERE profile = ? ORDER BY position", (profile,)).fetchall()
        return [r[0] for r in rows]

    # -- settings ----------------------------------------------------------------------------
    def get_setting(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set_setting(self, key: str, value: str) -> None:
        self.db.execute(
            "INSERT INTO settings (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, value))


def conversation_markdown(conv: Conversation, messages: list[Message]) -> str:
    """A conversation as a Markdown document (the export format)."""
    lines = [f"# {conv.title}", ""]
    settings = f"temperature {conv.temperature:g}, max tokens {conv.max_tokens}"
    if conv.seed is not None:
        settings += f", seed {conv.seed}"
    lines += [f"*{settings}*", ""]
    if conv.system:
        lines += ["## System", "", conv.system, ""]
    for m in messages:
        lines += [f"## {m.role.capitalize()}", "", m.content.rstrip(), ""]
    return "\n".join(lines)
