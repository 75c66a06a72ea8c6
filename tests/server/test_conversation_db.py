"""The websocket conversations persist in SQLite (app/server/conversation_db.py): every
change is written through, a new store on the same folder has them back (within the same
limits), and a damaged file is moved aside with one log line, never fatal."""

from __future__ import annotations

import logging

from panechat.app.server.conversation_db import DB_NAME, ConversationDB
from panechat.app.server.conversations import ConversationStore

LOG = logging.getLogger("panechat.test.conversation_db")


def _store(folder, **kw):
    return ConversationStore(db=ConversationDB(folder, LOG), **kw)


def test_conversations_survive_a_new_store(tmp_path):
    a = _store(tmp_path)
    conv, _ = a.open(None)
    conv.set_system("Be brief.")
    conv.append("user", "Hi ✓")
    conv.append("assistant", "Hello!")
    other, _ = a.open("mine")
    other.seed([{"role": "user", "content": "kept"}, {"role": "assistant", "content": "by the client"}])
    conv.set_system("Be very brief.")  # a rewrite after appends
    a.db.close()
    b = _store(tmp_path)
    assert len(b) == 2 and b.nbytes == a.nbytes
    assert b.get(conv.id).messages == conv.messages
    assert b.get("mine").messages == other.messages
    assert b.get(conv.id).messages[0] == {"role": "system", "content": "Be very brief."}
    fresh, created = b.open(None)  # server ids continue after the stored ones
    assert created and fresh.id not in (conv.id, "mine")


def test_what_the_limits_drop_is_deleted_on_disk_too(tmp_path):
    a = _store(tmp_path, max_items=2)
    for cid in ("x", "y", "z"):
        a.open(cid)[0].append("user", cid)
    assert sorted(c["conversation"] for c in a.list()) == ["y", "z"]
    a.db.close()
    b = _store(tmp_path, max_items=10)
    assert sorted(c["conversation"] for c in b.list()) == ["y", "z"]
    b.db.close()
    c = _store(tmp_path, max_items=1)  # a smaller limit at start: the least recent goes
    assert [x["conversation"] for x in c.list()] == ["z"]
    c.db.close()
    assert [x["conversation"] for x in _store(tmp_path).list()] == ["z"]


def test_a_damaged_file_is_moved_aside_with_one_line(tmp_path, caplog):
    a = _store(tmp_path)
    a.open("kept")[0].append("user", "hello")
    a.db.close()
    path = tmp_path / DB_NAME
    data = bytearray(path.read_bytes())
    data[100:4096] = b"\xff" * (4096 - 100)  # the schema page
    path.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger=LOG.name)
    b = _store(tmp_path)
    assert len(b) == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "damaged" in lines[0] and "moved it to" in lines[0]
    assert list(tmp_path.glob(DB_NAME + ".damaged-*"))
    b.open("new")[0].append("user", "again")
    b.db.close()
    assert _store(tmp_path).get("new").messages == [{"role": "user", "content": "again"}]


def test_a_cut_off_reply_keeps_its_mark_across_a_restart(tmp_path):
    """Issue 24 item 5: a reply its terminal left mid-way is stored marked, and comes back so."""
    a = _store(tmp_path)
    conv, _ = a.open("c-cut")
    conv.append("user", "tell me a story")
    conv.append("assistant", "Once upon a", cut_off=True)
    a.db.close()
    back = _store(tmp_path).get("c-cut").messages
    assert back == [{"role": "user", "content": "tell me a story"},
                    {"role": "assistant", "content": "Once upon a", "cut_off": True}]
