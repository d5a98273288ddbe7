"""A newer app's database (store/header.py): refused from its header, or its WAL, before SQLite parses a schema it
may not understand; never moved aside as damaged."""

from __future__ import annotations

import sqlite3

import pytest

from store import StoreTooNewError, open_store
from store.migrations import SCHEMA_VERSION


def _newer_with_a_schema_this_sqlite_cannot_parse(conn):
    """What a newer fmoe-local could leave: a higher schema version and a table in syntax this SQLite predates."""
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute(
        "INSERT INTO sqlite_master (type, name, tbl_name, rootpage, sql) "
        "VALUES ('table', 'future', 'future', 0, 'CREATE TABLE future (x) WITH FUTURE OPTIONS')"
    )
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()


def test_a_newer_schema_this_sqlite_cannot_parse_is_refused_not_moved_aside(tmp_path):
    """Before: connect()'s first statement failed as "malformed database schema", which counted as corruption: the
    newer app's file was moved aside and the app started empty."""
    path = tmp_path / "fmoe-local.db"
    with open_store(tmp_path) as store:
        store.chats.create("saved by the newer app")
    conn = sqlite3.connect(path)
    _newer_with_a_schema_this_sqlite_cannot_parse(conn)
    conn.close()
    before = path.read_bytes()
    files = sorted(p.name for p in tmp_path.iterdir())
    for location in (tmp_path, path):  # a data folder, and the file named with --store
        with pytest.raises(StoreTooNewError, match=f"newer fmoe-local \\(schema {SCHEMA_VERSION + 1}"):
            open_store(location)
        assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == files


def test_a_newer_schema_still_only_in_the_wal_is_refused_too(tmp_path):
    """A newer app killed before its checkpoint: its schema and version are in the -wal, page 1 on disk is old."""
    made = tmp_path / "made"
    made.mkdir()
    with open_store(made) as store:
        store.chats.create("x")
    conn = sqlite3.connect(made / "fmoe-local.db")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    _newer_with_a_schema_this_sqlite_cannot_parse(conn)
    kept = tmp_path / "kept"
    kept.mkdir()
    for name in ("fmoe-local.db", "fmoe-local.db-wal"):  # copied while the writer is alive: as a kill leaves them
        (kept / name).write_bytes((made / name).read_bytes())
    conn.close()
    with open(kept / "fmoe-local.db", "rb") as f:
        assert int.from_bytes(f.read(64)[60:64], "big") == SCHEMA_VERSION  # the file itself says the old version
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    with pytest.raises(StoreTooNewError, match="newer fmoe-local"):
        open_store(kept)
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before
