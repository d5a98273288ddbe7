"""Copying what can still be read from a damaged database (already moved aside) into the new one.

Scope: chats, their messages and the settings, row by row, skipping what cannot be read; `Recovery` says how much
came back. It does NOT move files (db.py does) and never writes the damaged file: it is the user's backup.

Why: one bad page anywhere (even in the expert maps, a cache) fails the integrity check, and the whole file is
moved aside; without this, every chat disappeared from the app although the moved file could still hold them all.
The expert maps are not copied: they are a cache that regrows, and a partial copy of their slots and successor
links would be worse than none. Ids are kept, so messages stay with their chats and alternatives with their
replies. An index or the search table being what is damaged loses nothing: rows are read from the tables
themselves, and the new file's indexes and search table are built as they go in.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_TABLES = ("conversations", "messages", "settings")  # in this order: messages need their chats first
_ROWID_MIN = -(2**63)
_ROWID_MAX = 2**63 - 1
RECOVERED_TITLE = "Recovered chat (its title could not be read)"


@dataclass(frozen=True)
class Recovery:
    """What came back from `moved_to`. A total is None when the damaged file could not even be counted."""

    moved_to: Path
    chats: int = 0
    chats_total: int | None = None
    messages: int = 0
    messages_total: int | None = None

    def what_came_back(self) -> str:
        """The end of a sentence that begins "The database was damaged; it was moved to X and "."""
        if self.chats == 0 and self.messages == 0:
            if self.chats_total == 0:
                return "it held no chats, so a new, empty one was started"
            return "no chat could be read from it, so a new, empty one was started"
        if self.chats_total is not None and self.chats >= self.chats_total and self.messages == self.messages_total:
            return f"all {_n(self.chats, 'chat')} were recovered from it"
        total = f" of {self.chats_total}" if self.chats_total is not None else ""
        messages = f"{self.messages} of {self.messages_total}" if self.messages_total is not None else self.messages
        return (
            f"{self.chats}{total} chats ({messages} messages) were recovered from it; what is missing could not be read"
        )


def _n(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def salvage(moved_to: Path, new: sqlite3.Connection) -> Recovery:
    """Copy the readable chats, messages and settings of `moved_to` into `new` (a fresh, migrated database).
    Never raises: whatever fails, the app starts with what was copied so far."""
    companions = [moved_to.with_name(moved_to.name + s) for s in ("-wal", "-shm")]
    existed = [p.exists() for p in companions]
    counts: dict[str, tuple[int, int | None]] = {}
    old = None
    try:
        # Read-only: the moved file stays byte for byte as it was, a WAL moved with it is still read.
        old = sqlite3.connect(f"{moved_to.resolve().as_uri()}?mode=ro", uri=True)
        # A file shorter than its header says (truncated by a full disk or a copy cut short) is read as far as it
        # goes instead of refused whole; mode=ro still forbids every write.
        old.execute("PRAGMA writable_schema = ON")
        for table in _TABLES:
            counts[table] = _copy_table(old, new, table)
        _give_orphans_a_chat(new, counts)
    except Exception:  # noqa: BLE001 - a salvage that fails must not stop the app from starting
        log.exception("salvage from %s stopped early", moved_to)
    finally:
        if old is not None:
            old.close()
        for path, was_there in zip(companions, existed, strict=True):
            if not was_there:  # made just now by the read-only connection: ours, and empty
                path.unlink(missing_ok=True)
    chats, chats_total = counts.get("conversations", (0, None))
    messages, messages_total = counts.get("messages", (0, None))
    return Recovery(moved_to, chats + counts.get("orphans", (0, None))[0], chats_total, messages, messages_total)


def _copy_table(old: sqlite3.Connection, new: sqlite3.Connection, table: str) -> tuple[int, int | None]:
    """(rows copied, rows the damaged table held — None when that cannot be known)."""
    try:
        old_cols = {row[1] for row in old.execute(f"PRAGMA table_info({table})")}
    except sqlite3.DatabaseError:
        return 0, None
    new_info = {row[1]: row for row in new.execute(f"PRAGMA table_info({table})")}
    # Only columns both know: an older file lacks later ones (they take their defaults).
    cols = [c for c in new_info if c in old_cols]
    if not cols:
        return 0, None
    try:
        # Through an index when there is one: a damaged table page need not fail it.
        counted = old.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    except sqlite3.DatabaseError:
        counted = None
    insert = f"INSERT OR IGNORE INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
    copied, read, skipped = 0, 0, []
    new.execute("BEGIN IMMEDIATE")
    try:
        for row in _readable_rows(old, table, cols, skipped):
            read += 1
            values = _sane(row, cols, new_info)
            if values is None:
                continue
            try:
                copied += new.execute(insert, values).rowcount
            except sqlite3.DatabaseError:
                continue  # a row read from a damaged page that breaks a constraint
        new.execute("COMMIT")
    except BaseException:
        if new.in_transaction:
            new.execute("ROLLBACK")
        raise
    if skipped:
        log.warning("salvage: %s: %d rows copied, %d damaged stretches skipped", table, copied, len(skipped))
    if counted is not None:
        return copied, max(counted, read)
    return copied, (None if skipped else read)


def _sane(row: tuple, cols: list[str], info: dict[str, tuple]) -> tuple | None:
    """A JSON column a damaged page garbled would fail every later read of its chat: its default instead (None:
    the column has none, so the row is left out)."""
    values = list(row)
    for i, col in enumerate(cols):
        if not col.endswith("_json") or values[i] is None:
            continue
        try:
            json.loads(values[i])
        except (TypeError, ValueError):
            _, _, _, notnull, default, _ = info[col]
            if notnull and default is None:
                return None
            values[i] = default.strip("'") if default is not None else None
            if col == "alternatives_json" and "chosen" in cols:
                values[cols.index("chosen")] = 0  # the one version left is the message's content
    return tuple(values)


def _readable_rows(old: sqlite3.Connection, table: str, cols: list[str], skipped: list[int]) -> Iterator[tuple]:
    """Every row of `table` in rowid order that can be read, stepping over the rowids of pages that cannot (the
    rowid each failed read started from goes to `skipped`)."""
    columns = f"SELECT rowid, {', '.join(cols)} FROM {table} WHERE rowid >= ? ORDER BY rowid"
    start = _ROWID_MIN
    while True:
        try:
            for rowid, *values in old.execute(columns, (start,)):
                start = rowid + 1
                yield tuple(values)
            return
        except sqlite3.DatabaseError:
            pass
        # Python's cursor reads a row ahead: a scan that fails on a damaged page has not yet handed over the last
        # good row before it. One row at a time (LIMIT 1 never steps further) gets it.
        try:
            row = old.execute(f"{columns} LIMIT 1", (start,)).fetchone()
        except sqlite3.DatabaseError:
            row = False
        if row is None:
            return
        if row is not False:
            start = row[0] + 1
            yield tuple(row[1:])
            continue
        skipped.append(start)
        resume = _next_readable(old, table, start)
        if resume is None:
            return
        start = resume


def _first_from(old: sqlite3.Connection, table: str, rowid: int) -> int | None | bool:
    """The first rowid at or above `rowid`; None when there is none; False when the seek hits a damaged page.
    (At or above, not above: a seek past a page's last rowid can visit that page.)"""
    try:
        row = old.execute(f"SELECT rowid FROM {table} WHERE rowid >= ? ORDER BY rowid LIMIT 1", (rowid,)).fetchone()
    except sqlite3.DatabaseError:
        return False
    return None if row is None else row[0]


def _next_readable(old: sqlite3.Connection, table: str, bad: int) -> int | None:
    """The first readable rowid past the damage met reading from `bad` (always above `bad`): seeks further and
    further ahead until one lands on a readable page, then halves the gap back, so that only the damaged pages'
    rows are lost."""
    bad = max(bad, 0)  # our ids start at 1: seeking up from the smallest rowid would take 63 doublings to get there
    step, good = 1, None
    while bad + step <= _ROWID_MAX:
        found = _first_from(old, table, bad + step)
        if found is None:
            return None
        if found is not False:
            good = bad + step
            break
        step *= 2
    if good is None:
        return None
    low = bad + step // 2  # seeking from here failed (or it is `bad`, where the read failed)
    while good - low > 1:
        mid = (low + good) // 2
        if _first_from(old, table, mid) is False:
            low = mid
        else:
            good = mid
    resume = _first_from(old, table, good)
    return None if resume is False else resume


def _give_orphans_a_chat(new: sqlite3.Connection, counts: dict[str, tuple[int, int | None]]) -> None:
    """Messages whose chat row was on a damaged page: a chat of their own, so that they are shown, not hidden."""
    chats, chats_total = counts.get("conversations", (0, None))
    if chats_total is not None and chats >= chats_total:
        return  # every chat came back: a message without one was already orphaned before the damage
    orphans = new.execute(
        "SELECT conversation_id, min(created), max(created) FROM messages "
        "WHERE conversation_id NOT IN (SELECT id FROM conversations) GROUP BY conversation_id"
    ).fetchall()
    with new:
        for cid, created, updated in orphans:
            new.execute(
                "INSERT INTO conversations (id, title, created, updated) VALUES (?, ?, ?, ?)",
                (cid, RECOVERED_TITLE, created, updated),
            )
    counts["orphans"] = (len(orphans), None)
