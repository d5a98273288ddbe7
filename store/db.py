"""Opening the fmoe-local database safely: one instance, WAL, busy timeout, migrations, corrupt-file recovery.

Scope: `open_database(path) -> StoreDb`, the connection settings every connection shares, and moving a corrupt
or unreadable file aside (salvage.py then copies what it can from it). It does NOT know the tables' meaning
(chats.py, settings.py, maps.py do).

Threads: `StoreDb.db` is one connection shared by the app's threads, each use under `StoreDb.lock`; a thread that
writes on its own (the map writer) opens its own connection with `connect()`. WAL lets readers and that writer
run side by side; synchronous=NORMAL in WAL mode survives a killed process (only a power cut can lose the last
commits).
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import sqlite_utils

from store import access
from store.errors import StoreError
from store.header import SQLITE_MAGIC, read_header
from store.lock import InstanceLock, holds_a_pid
from store.migrations import SCHEMA_VERSION, check_not_newer, migrate, too_new
from store.salvage import Recovery, salvage

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 5000
MMAP_BYTES = 1 << 30
WAL_LIMIT_BYTES = 64 << 20  # what a checkpoint truncates the WAL file to, at most
# PRAGMA application_id of our files ("fmoe"): how a file we did not name ourselves is recognised as ours.
APPLICATION_ID = 0x666D6F65
_OUR_TABLES = {"models", "maps", "conversations", "messages", "settings"}
_DATABASE_SUFFIXES = {".db", ".sqlite", ".sqlite3", ".db3"}  # an empty file named so is one to be made


class _Corrupt(sqlite3.DatabaseError):
    """The integrity check failed."""


def connect(path: Path) -> sqlite_utils.Database:
    """A configured connection to `path` (usable from any thread, one thread at a time)."""
    conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
    try:
        db = sqlite_utils.Database(conn, execute_plugins=False)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA synchronous = NORMAL")
        # Blobs of expert maps are read through the OS page cache without read() copies: 32K maps of a
        # Qwen1.5-MoE shape fetch ~3x faster (store.bench). Address space only, not memory.
        conn.execute(f"PRAGMA mmap_size = {MMAP_BYTES}")
        # A big write (a store of maps replaced, a salvage) grows the WAL; without a limit the file keeps that size
        # until the app closes. Per connection, not stored in the file.
        conn.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT_BYTES}")
    except BaseException:
        conn.close()
        raise
    return db


@dataclass
class StoreDb:
    path: Path
    db: sqlite_utils.Database
    instance_lock: InstanceLock
    # Set when the file found at `path` was damaged: where it went and what came back; the app tells the user.
    recovery: Recovery | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def recovered_from(self) -> Path | None:
        return self.recovery.moved_to if self.recovery else None

    def connect(self) -> sqlite_utils.Database:
        return connect(self.path)

    @contextmanager
    def writing(self) -> Iterator[sqlite_utils.Database]:
        """One write transaction on the shared connection, begun IMMEDIATE: it takes the write lock first (waiting
        up to the busy timeout for the map writer's commit), so what it reads cannot be made stale by another
        connection's commit — a deferred BEGIN that reads, then writes, fails at once with "database is locked"
        (SQLITE_BUSY_SNAPSHOT, no waiting) when the map writer committed in between."""
        with self.lock:
            conn = self.db.conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self.db
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                # A write the disk refused (full, read-only, failing) or that waited too long is the user's to act
                # on: a sentence (every caller shows StoreError as it is), never "OperationalError: …".
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise StoreError(write_refused(self.path, exc)) from exc

    def close(self) -> None:
        with self.lock:
            try:
                self.db.conn.close()
            finally:
                self.instance_lock.release()


def open_database(path: str | Path, check: bool = True, named_by_user: bool = False) -> StoreDb:
    """Open (or create) the database at `path`, holding the one-instance lock.

    Raises StoreInUseError when another app holds it, StoreTooNewError for a newer schema, StoreError when the
    folder, the lock file or the database cannot be written (the last proven at open, not found at the first
    Send). Only a corrupt file (the integrity check fails, or it is not a database) is moved to
    `<name>.corrupt-<timestamp>`, a fresh one created and the chats, messages and settings that can still be read
    copied into it; `recovery` then says where it went and how much came back. Any other failure — a full disk, a
    read-only file, an I/O error — leaves the file where it is and says what to do.
    `named_by_user` (a file path from --store, not our own name in a data folder): the file must not exist yet or
    be ours (our application id, or our tables); anything else is refused untouched. `check` runs
    `PRAGMA quick_check` (reads every page: ~0.1 s per 100 MB), which finds damage that a plain open would only
    hit later, mid-chat.
    """
    path = Path(path).expanduser()
    _refuse_if_newer(path, named_by_user)
    if named_by_user:
        _refuse_if_not_ours(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(
            f"Cannot create the data folder {path.parent} ({exc.strerror}). Choose another with --data-dir."
        ) from exc
    instance_lock = InstanceLock(path)
    try:
        instance_lock.acquire()
    except OSError as exc:
        if exc.errno == errno.EROFS:  # neither chmod nor chown helps: the disk itself takes no writes
            raise StoreError(access.read_only_file_system(path)) from exc
        if instance_lock.path.exists():  # the folder may be writable: only the lock file is not
            raise StoreError(access.unopenable_lock(path, instance_lock.path, exc.strerror)) from exc
        raise StoreError(access.unwritable_folder(path.parent, exc.strerror)) from exc
    try:
        recovery = None
        try:
            db = _open_checked(path, check)
        except sqlite3.DatabaseError as exc:
            if _is_contention(exc):
                raise StoreError(
                    f"The database {path} stayed busy for {BUSY_TIMEOUT_MS // 1000} s. Try again."
                ) from exc
            if _is_read_only(exc):
                raise StoreError(access.unwritable_database(path)) from exc
            if not _is_corruption(exc):
                raise StoreError(
                    f"Could not open the database {path} ({exc}). It was left as it is. If the disk is full, free "
                    "some space; if the file or its folder is read-only, make it writable; then start again."
                ) from exc
            log.warning("database %s unusable (%s); moving it aside", path, exc)
            recovered_from = move_aside(path)
            try:
                db = _open_checked(path, check=False)
            except sqlite3.DatabaseError as again:
                raise StoreError(
                    f"The database {path} was unusable and moved to {recovered_from.name}, but a new one cannot be "
                    f"created there ({again}). Start with --data-dir pointing to a folder you can write to."
                ) from again
            recovery = salvage(recovered_from, db.conn)
        return StoreDb(path=path, db=db, instance_lock=instance_lock, recovery=recovery)
    except BaseException:
        instance_lock.release()
        raise


def _open_checked(path: Path, check: bool) -> sqlite_utils.Database:
    db = connect(path)
    try:
        check_not_newer(db)  # before anything writes: a newer app's file stays byte-for-byte as it was
        if check:
            result = db.execute("PRAGMA quick_check").fetchall()
            if result != [("ok",)]:
                raise _Corrupt(f"quick_check: {result[:3]}")
        # Persistent in the file, so connections opened later (the map writer) are in WAL mode too.
        db.execute("PRAGMA journal_mode = WAL")
        migrate(db)
        if db.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
            db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        _prove_writable(db)
    except BaseException:
        db.conn.close()
        raise
    return db


def _prove_writable(db: sqlite_utils.Database) -> None:
    """Raise SQLITE_READONLY now rather than at the first Send: a current file needs no write to open, so a file
    the user cannot write (left root's by one sudo run, chmod 444) would open and then lose every reply.
    BEGIN IMMEDIATE alone proves nothing (SQLite turns it into a read transaction on a read-only file); a write of
    the value already there does, and the rollback leaves the file as it was."""
    conn = db.conn
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(f"PRAGMA user_version = {conn.execute('PRAGMA user_version').fetchone()[0]}")
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")


def write_refused(path: Path, exc: sqlite3.OperationalError) -> str:
    """What a user reads when a write to the database failed: why, what to do, and that nothing was changed."""
    name = getattr(exc, "sqlite_errorname", "")
    said = str(exc).lower()
    if name.startswith("SQLITE_FULL") or "full" in said:
        return (
            f"Nothing was saved: the disk holding {path.name} is full. Free some space on it (empty the bin, remove "
            "downloads or models you no longer use), then try again."
        )
    if _is_read_only(exc):
        return f"Nothing was saved. {access.unwritable_database(path)}"
    if _is_contention(exc):
        return f"Nothing was saved: the database {path} stayed busy for {BUSY_TIMEOUT_MS // 1000} s. Try again."
    if name.startswith("SQLITE_IOERR") or "i/o error" in said:
        return (
            f"Nothing was saved: the disk holding {path} reported a read or write error ({exc}). Check that it is "
            "still connected and healthy, then try again."
        )
    return f"Nothing was saved: the database {path} refused the change ({exc}). Try again; if it repeats, restart."


def _is_read_only(exc: sqlite3.DatabaseError) -> bool:
    name = getattr(exc, "sqlite_errorname", "")
    return name.startswith("SQLITE_READONLY") if name else "readonly" in str(exc).lower()


def _is_corruption(exc: sqlite3.DatabaseError) -> bool:
    """Only these may move a file aside: everything else (full, read-only, I/O) is not the file's fault."""
    if isinstance(exc, _Corrupt):
        return True
    name = getattr(exc, "sqlite_errorname", "")  # Python 3.11+
    if name:
        return name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB"))
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text


def _refuse_if_newer(path: Path, named_by_user: bool) -> None:
    """A newer app's file is refused from its header, before any connection (store/header.py says why), the lock
    file and the folder included: nothing at all is written. A file the user named is judged by its header only
    when it carries our application id; any other is for `_refuse_if_not_ours` to refuse."""
    header = read_header(path)
    if header is None or header.user_version <= SCHEMA_VERSION:
        return
    if header.application_id == APPLICATION_ID or not named_by_user:
        raise too_new(header.user_version)


def _refuse_if_not_ours(path: Path) -> None:
    """A path the user named must be new, or a database of ours; read-only look, nothing is written."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_file():
        raise StoreError(f"{path} is not a regular file, so fmoe-local will not keep its data there. Name a new file.")
    refusal = StoreError(
        f"{path} is not an fmoe-local database, so it was left untouched. Name a new file, or a folder."
    )
    with open(path, "rb") as f:
        head = f.read(16)
    if not head:
        # Empty: ours when a first open of ours was cut short (SQLite makes the file before writing to it; our lock
        # file beside it says so) or when it is named as a database; any other (notes.txt) is the user's.
        if path.suffix.lower() in _DATABASE_SUFFIXES or holds_a_pid(InstanceLock(path).path):
            return
        raise refusal
    if head != SQLITE_MAGIC:
        raise refusal
    header = read_header(path)
    if header is not None and header.application_id == APPLICATION_ID:
        return  # ours by its header: no connection needed (one may fail for reasons of the disk, not the file)
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        if _is_corruption(exc):
            raise refusal from exc
        # e.g. a WAL file's -shm that cannot be made on a read-only disk: the file may well be ours
        raise StoreError(
            f"Could not read {path} to check that it is an fmoe-local database ({exc}); it was left untouched. "
            "If its disk or folder is read-only, name a file on a writable one."
        ) from exc
    if app_id != APPLICATION_ID and not (app_id == 0 and _OUR_TABLES <= tables):
        raise refusal


def _is_contention(exc: sqlite3.DatabaseError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def move_aside(path: Path) -> Path:
    """Rename `path` (and its -wal/-shm companions) to `<name>.corrupt-<UTC timestamp>`; return the new path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    try:
        path.rename(target)
        # A WAL left beside a fresh file would be replayed into it; it belongs to the moved one.
        for suffix in ("-wal", "-shm"):
            companion = path.with_name(path.name + suffix)
            if companion.exists():
                companion.rename(target.with_name(target.name + suffix))
    except OSError as exc:
        raise StoreError(
            f"The database {path} is damaged and could not be moved aside ({exc.strerror}). "
            f"Move or delete it yourself, or start with --data-dir pointing to a different folder."
        ) from exc
    return target
