"""The SQLite store: migrations, conversations, messages, layout, settings, export."""

from __future__ import annotations

import sqlite3

from panechat.app import store as store_mod
from panechat.app.store import DB_NAME, MIGRATIONS, Store, conversation_markdown


def test_data_dir_follows_the_env_var(data_dir):
    assert store_mod.data_dir() == data_dir
    st = Store.open()
    assert st.path == data_dir / DB_NAME and st.path.is_file()
    st.close()



def dump(path) -> dict[str, list[tuple]]:
    """Every row of every panechat table, read with plain sqlite3 (not through the Store)."""
    db = sqlite3.connect(path)
    try:
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall()
                for t in ("conversations", "messages", "settings", "layout")}
    finally:
        db.close()


def write_history(st: Store, conversations: int = 3, turns: int = 2, size: int = 40) -> list[str]:
    """Real conversations with messages, a layout and a setting; returns the conversation ids."""
    ids = []
    for c in range(conversations):
        conv = st.new_conversation(f"chat {c}", max_tokens=64 + c, seed=c)
        for t in range(turns):
            st.add_message(conv.id, "user", f"question {c}.{t} " + "q" * size)
            st.add_message(conv.id, "assistant", f"answer {c}.{t} " + "a" * size, {"reason": "stop", "n": t})
        ids.append(conv.id)
    st.save_layout("local", ids[::-1])
    st.set_setting("theme", "panechat-ember")
    return ids


def test_migrations_run_once_and_in_order(tmp_path):
    path = tmp_path / DB_NAME
    st = Store(path)
    assert st.version == len(MIGRATIONS)
    tables = {r[0] for r in st.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"conversations", "messages", "settings", "layout"} <= tables
    ids = write_history(st)
    st.close()
    before = dump(path)
    assert len(before["conversations"]) == 3 and len(before["messages"]) == 12 and before["layout"]
    st = Store(path)  # reopening applies nothing new and keeps the data
    assert st.version == len(MIGRATIONS)
    assert dump(path) == before
    assert [c.id for c in st.list_conversations()] and st.layout("local") == ids[::-1]
    assert [m.content for m in st.messages(ids[0])][:2] == ["question 0.0 " + "q" * 40, "answer 0.0 " + "a" * 40]
    st.close()


def test_an_old_database_is_upgraded(tmp_path):
    path = tmp_path / DB_NAME
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0] + "; PRAGMA user_version = 1;")
    db.execute("INSERT INTO conversations VALUES ('c-old', 'old', '', 0, 64, NULL, 1, 1)")
    db.commit()
    db.close()
    st = Store(path)
    assert st.version == len(MIGRATIONS)
    assert st.get_conversation("c-old").title == "old"
    st.save_layout("local", ["c-old"])
    assert st.layout("local") == ["c-old"]


def test_conversations_messages_layout_roundtrip(tmp_path):
    st = Store(tmp_path / DB_NAME)
    a = st.new_conversation("first", max_tokens=32, temperature=0.7, seed=5)
    b = st.new_conversation()
    st.add_message(a.id, "user", "hi")
    st.add_message(a.id, "assistant", "hello", {"reason": "stop", "usage": {"completion_tokens": 2}})
    st.save_layout("local", [b.id, a.id])
    st.save_layout("ws://h:1", [a.id])
    st.close()

    st = Store(tmp_path / DB_NAME)
    got = st.get_conversation(a.id)
    assert (got.title, got.max_tokens, got.temperature, got.seed) == ("first", 32, 0.7, 5)
    msgs = st.messages(a.id)
    assert [(m.role, m.content) for m in msgs] == [("user", "hi"), ("assistant", "hello")]
    assert msgs[1].meta["usage"]["completion_tokens"] == 2
    assert st.layout("local") == [b.id, a.id]
    assert st.layout("ws://h:1") == [a.id]
    st.replace_messages(a.id, msgs[:1])
    assert [m.content for m in st.messages(a.id)] == ["hi"]
    st.delete_conversation(a.id)  # cascades to messages and layout rows
    assert st.messages(a.id) == [] and st.layout("local") == [b.id]


def test_settings(tmp_path):
    st = Store(tmp_path / DB_NAME)
    assert st.get_setting("theme") is None
    st.set_setting("theme", "panechat-light")
    st.set_setting("theme", "panechat-ember")
    assert st.get_setting("theme") == "panechat-ember"


def test_markdown_export_format(tmp_path):
    st = Store(tmp_path / DB_NAME)
    c = st.new_conversation("Sea poems", system="Be brief.", seed=3)
    st.add_message(c.id, "user", "A haiku?")
    st.add_message(c.id, "assistant", "Waves fold into foam.\n")
    md = conversation_markdown(st.get_conversation(c.id), st.messages(c.id))
    assert md.startswith("# Sea poems\n")
    assert "seed 3" in md
    assert "## System\n\nBe brief.\n" in md
    assert md.index("## User\n\nA haiku?") < md.index("## Assistant\n\nWaves fold into foam.")
