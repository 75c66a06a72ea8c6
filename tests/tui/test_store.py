"""The SQLite store: migrations, conversations, messages, layout, settings, export."""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys

import pytest

from panechat.app import store as store_mod
from panechat.app.cli import main
from panechat.app.store import DB_NAME, MIGRATIONS, Store, StoreError, conversation_markdown, side_file

from .conftest import MAX_TOKENS, type_and_send, wait_for


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


# -- a store that survives damage ------------------------------------------------------------
PAGE = 4096  # SQLite's default page size, which the store keeps


def sqlite_finds_damage(path) -> bool:
    """What SQLite itself says of the file, read-only: the damage the tests make is real."""
    try:
        db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
        try:
            return db.execute("PRAGMA quick_check").fetchall() != [("ok",)]
        finally:
            db.close()
    except sqlite3.DatabaseError:
        return True


def real_store(path, conversations: int = 3, turns: int = 2, size: int = 40) -> bytes:
    """A store with real conversations, closed (so checkpointed into the file); its bytes."""
    st = Store(path)
    write_history(st, conversations, turns, size)
    st.close()
    assert not side_file(path, "-wal").exists()
    return path.read_bytes()


def open_with_lines(path) -> tuple[Store, list[str]]:
    lines: list[str] = []
    return Store(path, report=lines.append), lines


def aside_files(path) -> list:
    """Everything moved aside: databases and their side files."""
    return sorted(path.parent.glob(path.name + ".damaged-*"))


def aside_databases(path) -> list:
    return [p for p in aside_files(path) if not p.name.endswith(store_mod.SIDE_FILES)]


def assert_moved_aside(path, st: Store, lines: list[str], original: dict[str, bytes]) -> None:
    """One line naming both paths; the original (and side files) moved aside byte for byte;
    a new, sound, usable store at `path`."""
    aside = aside_databases(path)
    assert len(aside) == 1, aside
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert str(path) in lines[0] and str(aside[0]) in lines[0] and "damaged" in lines[0]
    assert aside[0].name.startswith(f"{DB_NAME}.damaged-2")
    for suffix, data in original.items():
        assert side_file(aside[0], suffix).read_bytes() == data, f"moved {suffix or 'database'} changed"
    assert st.list_conversations() == [] and st.version == len(MIGRATIONS)
    conv = st.new_conversation("after")
    st.add_message(conv.id, "user", "still here")
    st.close()
    st = Store(path, report=lines.append)
    assert [m.content for m in st.messages(conv.id)] == ["still here"]
    assert st.db.execute("PRAGMA quick_check").fetchall() == [("ok",)]
    st.close()
    assert len(lines) == 1, lines  # the new store is sound: nothing more to say


def test_a_garbage_file_is_moved_aside(tmp_path):
    path = tmp_path / DB_NAME
    path.write_bytes(random.Random(1).randbytes(3 * PAGE + 17))
    original = {"": path.read_bytes()}
    st, lines = open_with_lines(path)
    assert "not an SQLite database" in lines[0]
    assert_moved_aside(path, st, lines, original)


def test_a_half_truncated_store_is_moved_aside(tmp_path):
    path = tmp_path / DB_NAME
    data = real_store(path, conversations=20, turns=5, size=400)
    assert len(data) >= 20 * PAGE
    path.write_bytes(data[: len(data) // 2])
    assert sqlite_finds_damage(path)
    st, lines = open_with_lines(path)
    assert_moved_aside(path, st, lines, {"": data[: len(data) // 2]})


def test_damaged_middle_pages_are_found_and_never_written(tmp_path):
    path = tmp_path / DB_NAME
    data = bytearray(real_store(path, conversations=10, turns=50, size=300))  # 1000 messages
    pages = len(data) // PAGE
    assert pages > 50
    mid = pages // 2 * PAGE
    data[mid: mid + 3 * PAGE] = random.Random(2).randbytes(3 * PAGE)
    path.write_bytes(data)
    assert sqlite_finds_damage(path)
    st, lines = open_with_lines(path)
    assert_moved_aside(path, st, lines, {"": bytes(data)})  # the old store opened it and wrote a conversation


def test_an_empty_file_is_a_new_store_without_a_word(tmp_path):
    """0 bytes is what sqlite3.connect leaves before its first write: no data, nothing to say."""
    path = tmp_path / DB_NAME
    path.write_bytes(b"")
    st, lines = open_with_lines(path)
    assert lines == [] and aside_files(path) == []
    assert st.version == len(MIGRATIONS) and st.list_conversations() == []
    conv = st.new_conversation("first")
    st.close()
    st = Store(path)
    assert st.get_conversation(conv.id).title == "first"
    st.close()


def test_an_empty_file_with_messages_in_its_wal_is_moved_aside(tmp_path):
    """SQLite deletes a WAL found next to an empty database: those messages go aside instead."""
    source = tmp_path / "source.db"
    st = Store(source)
    write_history(st)
    wal = side_file(source, "-wal").read_bytes()  # still open: the messages are only in the WAL
    st.close()
    assert len(wal) > PAGE
    path = tmp_path / DB_NAME
    path.write_bytes(b"")
    side_file(path, "-wal").write_bytes(wal)
    st, lines = open_with_lines(path)
    assert "-wal holds" in lines[0]
    assert_moved_aside(path, st, lines, {"": b"", "-wal": wal})
    assert not side_file(path, "-wal").exists() or side_file(path, "-wal").read_bytes() != wal


def test_the_side_files_of_a_damaged_store_move_with_it(tmp_path):
    """A store killed with its WAL in place, then damaged: the WAL goes aside with it, and is
    not replayed into the new store."""
    path = tmp_path / DB_NAME
    real_store(path, conversations=10, turns=20, size=300)
    st = Store(path)
    st.new_conversation("only in the wal")
    wal, shm = side_file(path, "-wal").read_bytes(), side_file(path, "-shm").read_bytes()
    data = bytearray(path.read_bytes())
    mid = len(data) // PAGE // 2 * PAGE
    data[mid: mid + 2 * PAGE] = bytes(2 * PAGE)
    path.write_bytes(data)  # as a crash would leave it: the connection is never closed
    assert sqlite_finds_damage(path)
    st2, lines = open_with_lines(path)
    assert_moved_aside(path, st2, lines, {"": bytes(data), "-wal": wal})
    assert side_file(aside_files(path)[0], "-shm").exists() and len(shm) > 0


def test_another_applications_database_is_left_alone(tmp_path):
    path = tmp_path / DB_NAME
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    db.execute("INSERT INTO notes (body) VALUES ('not yours')")
    db.commit()
    db.close()
    data = path.read_bytes()
    with pytest.raises(StoreError) as err:
        Store(path)
    msg = str(err.value)
    assert "not a panechat history store" in msg and str(path) in msg and "notes" in msg and "\n" not in msg
    assert path.read_bytes() == data and aside_files(path) == []
    assert not side_file(path, "-wal").exists()  # not even switched to WAL mode


def test_a_newer_panechats_store_is_left_alone(tmp_path):
    path = tmp_path / DB_NAME
    real_store(path)
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    db.commit()
    db.close()
    data = path.read_bytes()
    with pytest.raises(StoreError, match="from a newer panechat"):
        Store(path)
    assert path.read_bytes() == data and aside_files(path) == []


@pytest.mark.parametrize("mode", ["wal-writer", "exclusive"])
def test_a_locked_store_is_left_alone_and_the_app_says_so(mode, data_dir, monkeypatch, capsys):
    """Another process's lock is not damage: the file stays as it is, one line, exit 2."""
    monkeypatch.setattr(store_mod, "BUSY_TIMEOUT_S", 0.2)
    path = data_dir / DB_NAME
    real_store(path)
    holder = sqlite3.connect(path, isolation_level=None)
    if mode == "exclusive":  # a rollback-journal lock: even reading waits
        holder.execute("PRAGMA journal_mode = DELETE")
        holder.execute("BEGIN EXCLUSIVE")
    else:  # another writer in the middle of a long transaction
        holder.execute("BEGIN IMMEDIATE")
        holder.execute("INSERT INTO settings VALUES ('held', '1')")
    data = path.read_bytes()
    try:
        with pytest.raises(StoreError, match="is locked by another process"):
            Store(path)
        capsys.readouterr()
        assert main(["--connect", "ws://127.0.0.1:1"]) == 2  # the real launch path, before any screen
        err = capsys.readouterr().err.strip()
        assert err.startswith("panechat: error: the history store") and str(path) in err and "\n" not in err
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert path.read_bytes() == data and aside_files(path) == []
    st = Store(path)  # the lock gone, the same store with its data
    assert len(st.list_conversations()) == 3
    st.close()


READ_ONLY_CHILD = """
import sys
from pathlib import Path
from panechat.app.store import Store, StoreError

try:
    Store(Path(sys.argv[1]))
except StoreError as e:
    print(e)
"""


def test_a_read_only_store_is_left_alone(tmp_path):
    path = tmp_path / DB_NAME
    real_store(path)
    data = path.read_bytes()
    path.chmod(0o444)
    cmd = [sys.executable, "-c", READ_ONLY_CHILD, str(path)]
    if os.geteuid() == 0:  # root writes to read-only files unless it gives up that capability
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    path.chmod(0o644)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f"the history store {path} cannot be written "
                                  "(attempt to write a readonly database); it was left as it is")
    assert path.read_bytes() == data and aside_files(path) == []


def corrupt_under(st: Store) -> None:
    """Damage the open store's file the way a failing disk would: checkpoint, overwrite every
    page after the first, then let another connection commit so `st` drops its page cache."""
    st.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = st.path.stat().st_size
    with open(st.path, "r+b") as f:
        f.seek(PAGE)
        f.write(random.Random(3).randbytes(size - PAGE))
    other = sqlite3.connect(st.path, isolation_level=None)
    other.execute("PRAGMA user_version = " + str(len(MIGRATIONS)))
    other.close()


def store_bytes(path) -> dict[str, bytes]:
    return {s: side_file(path, s).read_bytes() for s in ("", "-wal") if side_file(path, s).exists()}


def test_damage_found_later_stops_writing_without_raising(tmp_path):
    path = tmp_path / DB_NAME
    st, lines = open_with_lines(path)
    ids = write_history(st, conversations=10, turns=20, size=300)
    corrupt_under(st)
    msg = st.add_message(ids[0], "user", "into a damaged file?")  # the old store raised here
    assert msg.id is None and msg.content == "into a damaged file?"
    assert len(lines) == 1 and str(path) in lines[0] and "damaged" in lines[0] and "\n" not in lines[0]
    assert st.write_error is not None
    frozen = store_bytes(path)
    conv = st.new_conversation("later")  # nothing below raises, says more, or writes
    assert conv.title == "later"
    st.add_message(conv.id, "user", "x")
    st.save_conversation(conv)
    st.replace_messages(ids[1], [])
    st.save_layout("local", [conv.id])
    st.set_setting("theme", "panechat-light")
    st.delete_conversation(ids[2])
    st.messages(ids[3]), st.layout("local"), st.list_conversations(), st.get_setting("theme")
    assert len(lines) == 1 and store_bytes(path) == frozen
    st.close()
    st2, lines2 = open_with_lines(path)  # the next start moves it aside
    assert_moved_aside(path, st2, lines2, frozen)


def test_a_failed_write_is_rolled_back_whole(tmp_path):
    """A transaction that fails half way leaves nothing behind (replace_messages: delete + inserts)."""
    st, lines = open_with_lines(tmp_path / DB_NAME)
    conv = st.new_conversation("t")
    for i in range(3):
        st.add_message(conv.id, "user", f"m{i}")
    st.db.execute("CREATE TRIGGER no_bad BEFORE INSERT ON messages WHEN NEW.content = 'bad' "
                  "BEGIN SELECT RAISE(ABORT, 'refused'); END")
    st.replace_messages(conv.id, [store_mod.Message("user", "ok"), store_mod.Message("user", "bad")])
    assert [m.content for m in st.messages(conv.id)] == ["m0", "m1", "m2"]
    assert len(lines) == 1 and "refused" in lines[0] and not st.db.in_transaction
    st.close()


CHILD = """
import sys
from pathlib import Path
from panechat.app.store import Store

st = Store(Path(sys.argv[1]))
conv = st.new_conversation("crash") if len(sys.argv) < 3 else st.get_conversation(sys.argv[2])
print(conv.id, flush=True)
i = len(st.messages(conv.id))
while True:
    st.add_message(conv.id, "user", f"message {i} " + "x" * (i % 7 * 1000))  # 0 to 6 KB: many pages
    print(i, flush=True)
    i += 1
"""


def test_a_writer_killed_mid_loop_keeps_every_committed_message(tmp_path):
    path = tmp_path / DB_NAME
    committed: list[int] = []
    conv_id = None
    for kill_after in (150, 40, 90):  # three kills, each reopening what the last one left
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), *([conv_id] if conv_id else [])],
                                 stdout=subprocess.PIPE, text=True)
        conv_id = child.stdout.readline().strip()
        start = len(committed)
        for line in child.stdout:
            committed.append(int(line))
            if len(committed) - start >= kill_after:
                break
        child.send_signal(signal.SIGKILL)
        child.wait()
        committed += [int(line) for line in child.stdout]  # printed before the kill, still in the pipe
        child.stdout.close()
        assert side_file(path, "-wal").exists()  # killed with its WAL in place, never closed
        assert not sqlite_finds_damage(path)
        st, lines = open_with_lines(path)
        assert lines == [] and aside_files(path) == []
        stored = [m.content.split(" ")[:2] for m in st.messages(conv_id)]
        # every message a child saw committed is there, in order; at most one more (committed,
        # killed before it could say so)
        assert stored[: len(committed)] == [["message", str(i)] for i in committed]
        assert len(committed) <= len(stored) <= len(committed) + 1
        committed = [int(s[1]) for s in stored]
        st.close()
    assert committed == list(range(len(committed)))


async def test_the_app_starts_on_a_damaged_store_and_says_so(tui_engine, data_dir, capsys):
    """The launch path end to end: a damaged file in the data dir, the app built as `panechat`
    builds it; it starts, shows the one line, and keeps working when damage appears later."""
    from panechat.app.clients.local import LocalBackend
    from panechat.app.tui.launch import build_app

    path = data_dir / DB_NAME
    data = bytearray(real_store(path, conversations=10, turns=20, size=300))
    mid = len(data) // PAGE // 2 * PAGE
    data[mid: mid + 3 * PAGE] = random.Random(4).randbytes(3 * PAGE)
    path.write_bytes(data)
    st = Store.open()  # as launch() opens it: the line goes to stderr before the screen opens
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"panechat: the history store {path} was damaged")
    st.set_setting("default_max_tokens", str(MAX_TOKENS))
    app = build_app(LocalBackend(tui_engine), st)
    toasts = lambda: [str(t.render()) for t in app.screen.query("Toast")]  # noqa: E731
    async with app.run_test(size=(160, 45), notifications=True) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        await wait_for(pilot, lambda: len(toasts()) == 1, timeout=10, what="the store's notice")
        assert toasts() == st.notices and str(aside_files(path)[0]) in toasts()[0]
        pane = app.main.panes[0]
        await type_and_send(pilot, pane, "Hi")
        # the first reply after the engine starts may compile the numba kernels: a long timeout
        await wait_for(pilot, lambda: pane.last_finish is not None and not pane.busy, timeout=180,
                       what="the first reply")
        assert [m.role for m in st.messages(pane.conversation.id)] == ["user", "assistant"]

        corrupt_under(st)  # the disk fails under the running app
        pane.last_finish = None
        await type_and_send(pilot, pane, "Again")
        await wait_for(pilot, lambda: pane.last_finish is not None and not pane.busy, what="the second reply")
        assert pane.last_finish.reason in ("stop", "length") and len(pane.history) == 4
        await wait_for(pilot, lambda: len(toasts()) == 2, timeout=10, what="the second notice")
        assert "is damaged" in toasts()[1] and "nothing more is written" in toasts()[1]
    st.close()
    moved = aside_databases(path)
    assert len(moved) == 1 and moved[0].read_bytes() == bytes(data)


def test_search_matches_titles_and_message_text_literally(tmp_path):
    st = store_mod.Store.open(tmp_path)
    a = st.new_conversation("Budget 100% done")
    b = st.new_conversation("snake_case names")
    st.add_message(b.id, "user", "What about Ünïcode and CamelCase?")
    st.new_conversation("1000 tries, snakeXcase")
    assert [c.id for c in st.search_conversations("100%")] == [a.id]  # % and _ are no wildcards
    assert [c.id for c in st.search_conversations("snake_case")] == [b.id]
    assert [c.id for c in st.search_conversations("camelcase")] == [b.id]  # message text, any ASCII case
    assert len(st.search_conversations("  ")) == 3
    st.close()


def test_markdown_export_names_the_other_sampling_settings(tmp_path):
    conv = store_mod.Conversation("c-1", "T", sampling={"top_k": 40, "stop": ["###"]})
    md = store_mod.conversation_markdown(conv, [])
    assert '*temperature 0, max tokens 512, top k 40, stop ["###"]*' in md
