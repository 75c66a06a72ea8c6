"""One migration mechanism for both SQLite stores (app/sqlite_migrations.py): numbered
migrations by PRAGMA user_version, the pending ones in one transaction, a newer file
refused untouched; the server's conversation store goes through it like the TUI's history."""

from __future__ import annotations

import logging
import sqlite3

import pytest

from panechat.app import store
from panechat.app.server import conversation_db
from panechat.app.server.conversation_db import DB_NAME, ConversationDB, ConversationDBError
from panechat.app.sqlite_migrations import SchemaTooNew, migrate, schema_tables, schema_version

LOG = logging.getLogger("panechat.test.sqlite_migrations")

STEPS = (
    "CREATE TABLE a (x INTEGER); INSERT INTO a VALUES (1);",
    "CREATE TABLE b (s TEXT); INSERT INTO b VALUES ('semi;colon');"
    "CREATE TRIGGER t AFTER INSERT ON a BEGIN INSERT INTO b VALUES ('x;y'); END;",
    "ALTER TABLE a ADD COLUMN y INTEGER NOT NULL DEFAULT 7;",
)


def _db(path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def test_pending_migrations_run_once_and_in_order(tmp_path):
    db = _db(tmp_path / "x.db")
    assert migrate(db, STEPS[:2]) == 2 and schema_version(db) == 2
    assert db.execute("SELECT s FROM b").fetchall() == [("semi;colon",)]  # a ';' inside a string stays
    assert migrate(db, STEPS) == 3  # only the third runs now
    assert db.execute("SELECT x, y FROM a").fetchall() == [(1, 7)]
    db.execute("INSERT INTO a (x) VALUES (2)")  # the trigger's body was one statement
    assert db.execute("SELECT s FROM b ORDER BY rowid").fetchall() == [("semi;colon",), ("x;y",)]
    assert migrate(db, STEPS) == 3 and db.execute("SELECT count(*) FROM a").fetchone() == (2,)
    assert schema_tables(STEPS, 2) == {"a", "b"}


def test_a_failing_migration_leaves_the_file_as_it_was(tmp_path):
    """All pending migrations are one transaction: none is applied when a later one fails."""
    db = _db(tmp_path / "x.db")
    migrate(db, STEPS[:1])
    with pytest.raises(sqlite3.OperationalError):
        migrate(db, (*STEPS, "ALTER TABLE missing ADD COLUMN z;"))
    assert schema_version(db) == 1
    assert {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} == {"a"}
    assert not db.in_transaction


def test_a_newer_file_is_refused_untouched(tmp_path):
    path = tmp_path / "x.db"
    db = _db(path)
    migrate(db, STEPS)
    db.execute("PRAGMA user_version = 9")
    data = path.read_bytes()
    with pytest.raises(SchemaTooNew, match="schema 9, this one knows 3"):
        migrate(db, STEPS)
    assert path.read_bytes() == data


def test_both_stores_use_it():
    """The same module, each store with its own list (whose length is its schema version)."""
    assert store.migrate is conversation_db.migrate
    assert schema_tables(conversation_db.MIGRATIONS, 1) == {"conversations", "messages"}
    assert schema_tables(store.MIGRATIONS, len(store.MIGRATIONS)) >= {"conversations", "messages", "layout"}


def test_a_conversation_store_from_before_keeps_its_conversations(tmp_path):
    """A file the earlier code wrote (its schema script, then user_version 1) opens as it is."""
    db = _db(tmp_path / DB_NAME)
    db.executescript(conversation_db.MIGRATIONS[0])
    db.execute("INSERT INTO conversations VALUES ('old', 1.0, 2.0)")
    db.execute("INSERT INTO messages (conversation_id, role, content) VALUES ('old', 'user', 'hi')")
    db.execute("PRAGMA user_version = 1")
    db.close()
    cdb = ConversationDB(tmp_path, LOG)
    assert [(c.id, c.messages) for c in cdb.load()] == [("old", [{"role": "user", "content": "hi"}])]
    assert schema_version(cdb.db) == len(conversation_db.MIGRATIONS)  # migrated on from 1
    cdb.close()


def test_a_newer_conversation_store_is_left_alone(tmp_path):
    ConversationDB(tmp_path, LOG).close()
    path = tmp_path / DB_NAME
    db = _db(path)
    known = len(conversation_db.MIGRATIONS)
    db.execute(f"PRAGMA user_version = {known + 1}")
    db.close()
    data = path.read_bytes()
    with pytest.raises(ConversationDBError) as err:
        ConversationDB(tmp_path, LOG)
    msg = str(err.value)
    assert f"from a newer panechat (schema {known + 1}, this one knows {known})" in msg and "\n" not in msg
    assert path.read_bytes() == data


def test_a_history_store_from_before_branches_keeps_its_messages_and_gains_branches(tmp_path):
    """A schema-4 history (before migrations 5 and 6) opens with its messages; branch points
    and the other sampling settings then round-trip, and go with their conversation."""
    db = _db(tmp_path / store.DB_NAME)
    for script in store.MIGRATIONS[:4]:
        db.executescript(script)
    db.execute("INSERT INTO conversations (id, title, created, updated) VALUES ('old', 't', 1.0, 2.0)")
    for i, role in enumerate(("user", "assistant", "user")):
        db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES ('old', ?, ?, 1.0)",
                   (role, f"m{i}"))
    db.execute("PRAGMA user_version = 4")
    db.close()
    st = store.Store.open(tmp_path)
    assert st.version == len(store.MIGRATIONS) >= 5
    assert [m.content for m in st.messages("old")] == ["m0", "m1", "m2"]
    state = {"alts": [{"messages": [{"role": "assistant", "content": "a", "meta": {}}], "branches": {}},
                      {"messages": [], "branches": {}}], "current": 1}
    st.save_branches("old", {1: state})
    conv = st.get_conversation("old")
    assert conv.sampling == {}  # migration 6: the other sampling fields, none set
    conv.sampling = {"top_k": 40, "stop": ["###"]}
    st.save_conversation(conv)
    st.close()
    st = store.Store.open(tmp_path)
    assert st.branches("old") == {1: state}
    assert st.get_conversation("old").sampling == {"top_k": 40, "stop": ["###"]}
    st.delete_conversation("old")  # its branch points go with it
    assert st.branches("old") == {}
    st.close()
