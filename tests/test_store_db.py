"""Opening the database: WAL and busy timeout, corrupt/unreadable files moved aside, newer schemas refused,
one app instance per data folder."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from store import StoreError, StoreInUseError, StoreTooNewError, open_store
from store.db import BUSY_TIMEOUT_MS
from store.migrations import SCHEMA_VERSION


def test_new_database_is_wal_with_busy_timeout_at_current_schema(tmp_path):
    with open_store(tmp_path) as s:
        db = s.db.db
        assert s.path == tmp_path / "fmoe-local.db"
        assert s.recovered_from is None
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA busy_timeout").fetchone()[0] == BUSY_TIMEOUT_MS
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert {"models", "maps", "conversations", "messages", "settings"} <= set(db.table_names())


def test_the_wal_file_shrinks_back_after_a_big_write(tmp_path, monkeypatch):
    monkeypatch.setattr("store.db.WAL_LIMIT_BYTES", 1 << 20)
    with open_store(tmp_path) as s:
        db = s.db.db
        with s.db.writing():
            db.execute("CREATE TABLE scratch (b BLOB)")
            for _ in range(64):
                db.execute("INSERT INTO scratch VALUES (zeroblob(131072))")  # 8 MB through the WAL
        wal = tmp_path / "fmoe-local.db-wal"
        assert wal.stat().st_size > 8 << 20
        db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        with s.db.writing():  # the next write restarts the WAL, and cuts the file down to the limit
            db.execute("INSERT INTO scratch VALUES (1)")
        assert wal.stat().st_size <= 1 << 20  # before: it stayed at 8 MB until the app closed


def test_data_survives_reopen(tmp_path):
    with open_store(tmp_path) as s:
        cid = s.chats.create("kept").id
    with open_store(tmp_path) as s:
        assert s.chats.get(cid).title == "kept"
        assert s.recovered_from is None


def test_garbage_file_is_moved_aside_and_a_fresh_one_created(tmp_path):
    db_file = tmp_path / "fmoe-local.db"
    db_file.write_bytes(b"this is not a database, it is a shopping list\n" * 200)
    with open_store(tmp_path) as s:
        moved = s.recovered_from
        assert moved is not None and moved.name.startswith("fmoe-local.db.corrupt-")
        assert moved.read_bytes().startswith(b"this is not a database")
        assert s.chats.list() == []
        s.chats.create("works again")
    with open_store(tmp_path) as s:
        assert s.recovered_from is None
        assert [c.title for c in s.chats.list()] == ["works again"]


def test_damaged_pages_are_found_at_open(tmp_path):
    with open_store(tmp_path) as s:
        c = s.chats.create("long")
        for i in range(300):
            s.chats.append(c.id, "user", f"message {i} " + "x" * 500)
        s.db.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = s.db.db.execute("PRAGMA page_size").fetchone()[0]
    db_file = tmp_path / "fmoe-local.db"
    data = bytearray(db_file.read_bytes())
    assert len(data) > 20 * page
    for p in range(2, len(data) // page, 3):  # scribble over b-tree pages, keep the header readable
        data[p * page : p * page + 64] = b"\xff" * 64
    db_file.write_bytes(bytes(data))
    with open_store(tmp_path) as s:
        assert s.recovered_from is not None
        assert s.db.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        # What could be read came back (tests/test_store_salvage.py); here little can, and nothing else appears.
        assert all(c.id == 1 for c in s.chats.list())


def test_newer_schema_is_refused_and_left_untouched(tmp_path):
    db_file = tmp_path / "fmoe-local.db"
    conn = sqlite3.connect(db_file)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    before = db_file.read_bytes()
    with pytest.raises(StoreTooNewError, match="newer fmoe-local"):
        open_store(tmp_path)
    assert db_file.read_bytes() == before
    assert not list(tmp_path.glob("*.corrupt-*"))
    with open_store(tmp_path / "other"):  # the refused open released its instance lock
        pass


def test_second_instance_in_this_process_is_refused(tmp_path):
    with open_store(tmp_path):
        with pytest.raises(StoreInUseError, match="already in use"):
            open_store(tmp_path)
    with open_store(tmp_path):  # released on close
        pass


HOLDER = textwrap.dedent(
    """
    import sys, time
    from store import open_store
    s = open_store(sys.argv[1])
    print("ready", flush=True)
    time.sleep(120)
    """
)


def test_second_app_instance_is_told_plainly_and_a_killed_one_frees_the_folder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(StoreInUseError) as info:
            open_store(tmp_path)
        assert info.value.pid == holder.pid
        assert f"process {holder.pid}" in str(info.value) and "--data-dir" in str(info.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with open_store(tmp_path) as s:  # kill -9 leaves no stale lock
        assert s.recovered_from is None


def test_a_folder_that_cannot_be_created_is_told_as_a_sentence(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the data folder should be")
    with pytest.raises(StoreError, match="--data-dir"):
        open_store(blocker / "data" / "fmoe-local.db")


@pytest.mark.parametrize(
    ("failure", "said"),
    [
        ("database or disk is full", r"It was left as it is\. If the disk is full, free some space"),
        ("attempt to write a readonly database", r"cannot be saved to.*It was left as it is\."),
        ("disk I/O error", r"It was left as it is\. If the disk is full, free some space"),
    ],
)
def test_a_healthy_file_that_cannot_be_upgraded_stays_where_it_is(tmp_path, monkeypatch, failure, said):
    import sqlite3

    import store.db as db_module

    path = tmp_path / "fmoe-local.db"
    with open_store(tmp_path) as store:
        store.chats.append(store.chats.create("keep me").id, "user", "hello")
    before = path.read_bytes()

    def failing_migrate(db):
        raise sqlite3.OperationalError(failure)

    monkeypatch.setattr(db_module, "migrate", failing_migrate)
    with pytest.raises(StoreError, match=said):
        open_store(tmp_path)
    assert path.read_bytes() == before  # today: renamed to fmoe-local.db.corrupt-… and an empty app
    assert not list(tmp_path.glob("*.corrupt-*"))
    monkeypatch.undo()
    with open_store(tmp_path) as store:
        assert [c.title for c in store.chats.list()] == ["keep me"]


def test_store_refuses_a_file_that_is_not_ours_and_leaves_it_untouched(tmp_path):
    import os
    import sqlite3

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    other = tmp_path / "other-app.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.execute("INSERT INTO t VALUES (1)")
    conn.commit()
    conn.close()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (notes, other):
        before = path.read_bytes()
        with pytest.raises(StoreError, match="is not an fmoe-local database, so it was left untouched"):
            open_store(path)
        assert path.read_bytes() == before and not list(tmp_path.glob(f"{path.name}*corrupt*"))
        assert not (tmp_path / f"{path.name}-wal").exists()
    with pytest.raises(StoreError, match="is not a regular file"):
        open_store(fifo)
    assert fifo.exists()


def test_store_takes_a_new_file_or_one_of_ours(tmp_path):
    import sqlite3

    new = tmp_path / "maps.db"
    with open_store(new) as store:
        store.chats.create("x")
    conn = sqlite3.connect(new)
    assert conn.execute("PRAGMA application_id").fetchone()[0] == 0x666D6F65
    conn.execute("PRAGMA application_id = 0")  # as files written before application ids were set
    conn.commit()
    conn.close()
    with open_store(new) as store:  # recognised by its tables
        assert [c.title for c in store.chats.list()] == ["x"]


def test_a_lock_file_that_is_not_ours_is_left_untouched(tmp_path):
    """Before: `--store yarn` truncated the project's yarn.lock and wrote our PID into it (the lock is `<name>.lock`),
    and a symlink there was followed to whatever it named."""
    yarn = tmp_path / "yarn.lock"
    yarn.write_text("# THIS IS AN AUTOGENERATED FILE.\nleft-pad@^1.3.0:\n  version 1.3.0\n")
    target = tmp_path / "bashrc"
    target.write_text("export PATH=~/bin:$PATH\n")
    (tmp_path / "Cargo.lock").symlink_to(target)
    for name, kept in (("yarn", yarn), ("Cargo", target)):
        before = kept.read_bytes()
        with pytest.raises(StoreError, match="is not fmoe-local's lock file, so it was left untouched"):
            open_store(tmp_path / name)
        assert kept.read_bytes() == before and not (tmp_path / name).exists()
    stale = tmp_path / "maps.db.lock"
    stale.write_text("\n12345\n")  # ours, left by a killed app: taken over as before
    with open_store(tmp_path / "maps.db") as store:
        store.chats.create("x")


def test_a_commit_by_another_connection_between_a_read_and_a_write_does_not_fail_the_write(tmp_path):
    """The map writer commits a map right while a reply is appended (which reads the next position, then writes):
    a deferred transaction failed at once with "database is locked"; an immediate one waits its turn."""
    import threading

    store = open_store(tmp_path)
    try:
        conv = store.chats.create("x")
        other = store.db.connect()  # a second connection, as the map writer has
        shared = store.db.db
        real_execute = shared.execute
        writes: list[BaseException | None] = []

        def execute(sql, *args, **kwargs):
            result = real_execute(sql, *args, **kwargs)
            if sql.startswith("SELECT coalesce(max(position)"):

                def commit_elsewhere() -> None:
                    try:
                        other.conn.execute("INSERT INTO settings (key, value_json) VALUES ('probe', '1')")
                        other.conn.commit()
                        writes.append(None)
                    except BaseException as exc:  # noqa: BLE001 - asserted below
                        writes.append(exc)

                t = threading.Thread(target=commit_elsewhere)
                t.start()
                t.join(0.5)  # with the write lock held it waits for our commit; without, it commits now
                execute.thread = t
            return result

        shared.execute = execute
        store.chats.append(conv.id, "user", "hello")  # raised sqlite3.OperationalError before
        shared.execute = real_execute
        execute.thread.join(10)
        assert writes == [None]  # the other connection's write went in right after ours
        assert [m.content for m in store.chats.messages(conv.id)] == ["hello"]
        other.conn.close()
    finally:
        store.close()


def test_an_existing_empty_file_is_refused_unless_named_or_left_as_a_database(tmp_path):
    """Before: `--store notes.txt` on an empty notes.txt turned the user's file into a database."""
    notes = tmp_path / "notes.txt"
    notes.touch()
    with pytest.raises(StoreError, match="notes.txt is not an fmoe-local database, so it was left untouched"):
        open_store(notes)
    assert notes.read_bytes() == b"" and not (tmp_path / "notes.txt-wal").exists()
    assert not (tmp_path / "notes.txt.lock").exists()
    named = tmp_path / "maps.db"  # `touch maps.db`: meant as a database
    named.touch()
    left = tmp_path / "mystore"  # a first open of ours killed before SQLite wrote a page: its lock says so
    left.touch()
    (tmp_path / "mystore.lock").write_text("\n4242\n")
    for path in (named, left):
        with open_store(path) as store:
            store.chats.create("kept")
        with open_store(path) as store:
            assert [c.title for c in store.chats.list()] == ["kept"]


def _read_only_disk(monkeypatch):
    """What a read-only mount does to the store's first steps: SQLite cannot make the -shm a read-only connection
    to a WAL file needs, and no file can be opened for writing."""
    import errno
    import os
    import sqlite3

    import store.db as db_module
    import store.lock as lock_module

    real_connect, real_open = sqlite3.connect, os.open

    def connect(database, *args, **kwargs):
        if "mode=ro" in str(database):
            raise sqlite3.OperationalError("unable to open database file")
        return real_connect(database, *args, **kwargs)

    def open_(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(db_module.sqlite3, "connect", connect)
    monkeypatch.setattr(lock_module.os, "open", open_)


def test_a_database_on_a_read_only_disk_is_named_as_such(tmp_path, monkeypatch):
    """Before: `run --store maps.db` on a read-only mount said the file "is not an fmoe-local database" (and from a
    data folder, "make it writable (chmod u+w …)", which cannot help a read-only disk)."""
    path = tmp_path / "maps.db"
    with open_store(path) as store:
        store.chats.create("kept")
    before = path.read_bytes()
    _read_only_disk(monkeypatch)
    for location in (path, tmp_path / "data"):
        if location.name == "data":
            location.mkdir()
            (location / "fmoe-local.db").write_bytes(before)
            (location / "fmoe-local.db.lock").write_text("\n1\n")
        with pytest.raises(StoreError, match=r"is on a read-only disk, so nothing you chat would be kept\. Start with"):
            open_store(location)
    assert path.read_bytes() == before


def test_a_real_read_only_mount_says_the_disk_is_read_only(tmp_path):
    """The same on a real read-only bind mount (Linux, where an unprivileged user namespace is allowed)."""
    import shutil
    from pathlib import Path

    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        pytest.skip("needs Linux's unshare")
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("user namespaces are not allowed here")
    folder = tmp_path / "ro"
    folder.mkdir()
    path = folder / "maps.db"
    with open_store(path) as store:
        store.chats.create("kept")
    before = path.read_bytes()
    probe = (
        "from store import StoreError, open_store\n"
        f"try:\n    open_store({str(path)!r})\nexcept StoreError as exc:\n    print(exc)\n"
    )
    script = f'mount --bind "{folder}" "{folder}" && mount -o remount,bind,ro "{folder}" && exec "$0" -c "$1"'
    repo = Path(__file__).resolve().parents[1]
    said = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, sys.executable, probe],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "mount" in said.stderr and said.returncode != 0:
        pytest.skip(f"cannot mount read-only here: {said.stderr.strip()}")
    assert "is on a read-only disk" in said.stdout, (said.stdout, said.stderr)
    assert path.read_bytes() == before


def test_every_write_a_full_disk_refuses_is_a_sentence_and_changes_nothing(tmp_path):
    """Before: sqlite3.OperationalError "database or disk is full" reached the page raw (chat, settings)."""
    with open_store(tmp_path) as store:
        conv = store.chats.create("kept")
        conn = store.db.db.conn
        conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")
        for write in (
            lambda: store.settings.set(system_prompt="z" * 90_000),  # within the page's limit, beyond the disk
            lambda: store.chats.append(conv.id, "user", "x" * 2_000_000),
            lambda: store.chats.create("y" * 2_000_000),
        ):
            with pytest.raises(StoreError, match=r"^Nothing was saved: the disk holding fmoe-local.db is full\."):
                write()
        assert [c.title for c in store.chats.list()] == ["kept"] and store.chats.messages(conv.id) == []
        assert store.settings.load().system_prompt == ""
        conn.execute("PRAGMA max_page_count = 1073741823")  # space freed: the same writes are kept again
        store.settings.set(system_prompt="be brief")  # before: dropped without a word for the rest of the session
        assert store.settings.load().system_prompt == "be brief"
