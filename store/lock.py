"""One app instance per database: an exclusive OS lock on `<db>.lock`, with the holder's PID written inside.

Scope: acquiring, describing and releasing that lock. It does NOT open the database.

An OS lock (flock on POSIX, msvcrt on Windows) is released by the kernel when its process dies, kill -9
included, so a crashed app never leaves a stale lock behind; the PID inside only makes the message precise.

The lock file is written only when it is ours: new, empty, or holding nothing but a PID. `--store yarn` names a
lock file `yarn.lock`, and `--store Cargo` `Cargo.lock`: the user's files, which truncating would destroy. A
symlink or anything but a regular file is refused the same way.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import sys
from pathlib import Path

from store.errors import StoreError, StoreInUseError

if sys.platform == "win32":
    import msvcrt
else:
    import fcntl

log = logging.getLogger(__name__)
# What a lock held by someone else looks like; any other failure means the filesystem cannot lock at all.
_HELD = {errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES, getattr(errno, "EDEADLK", -1), getattr(errno, "EDEADLOCK", -1)}


class InstanceLock:
    """Held for as long as the store is open; `release()` (or process exit) frees it."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = Path(db_path)
        self.path = self.db_path.with_name(self.db_path.name + ".lock")
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> InstanceLock:
        """Take the lock or raise StoreInUseError naming the holder's PID."""
        if self._fd is not None:
            return self
        if self.path.is_symlink():
            raise self._not_ours()
        # O_RDWR without O_TRUNC: the current holder's PID must stay readable until we own the lock.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._not_ours()
        try:
            _lock(fd)
        except OSError as exc:
            if exc.errno not in _HELD:
                # e.g. a network share without locks: running unguarded beats refusing to start.
                log.warning("cannot lock %s (%s); a second instance would not be detected", self.path, exc)
                os.close(fd)
                return self
            pid = _read_pid(fd)
            os.close(fd)
            raise StoreInUseError(self.db_path, pid) from None
        if not _holds_only_a_pid(fd):
            _unlock(fd)
            os.close(fd)
            raise self._not_ours()
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        # Windows locks byte 0, so the PID goes after a newline to stay readable by a second instance.
        os.write(fd, f"\n{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def _not_ours(self) -> StoreError:
        return StoreError(
            f"{self.path} exists and is not fmoe-local's lock file, so it was left untouched. "
            "Name the store differently (--store), or choose another folder with --data-dir."
        )

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            _unlock(fd)
        finally:
            os.close(fd)

    def __enter__(self) -> InstanceLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def holds_a_pid(lock_path: Path) -> bool:
    """Is `lock_path` a lock file one of our instances wrote (a regular file holding a PID and nothing else)? Read
    only; a lock file someone holds now still answers yes."""
    if lock_path.is_symlink() or not lock_path.is_file():
        return False
    try:
        with open(lock_path, "rb") as f:
            text = f.read(65)
    except OSError:
        return False
    return len(text) <= 64 and re.fullmatch(rb"\s*\d+\s*", text) is not None


def _holds_only_a_pid(fd: int) -> bool:
    """What we write (a PID between newlines), or nothing: read under our own lock, so from byte 0."""
    if os.fstat(fd).st_size > 64:
        return False
    os.lseek(fd, 0, os.SEEK_SET)
    return re.fullmatch(rb"\s*\d*\s*", os.read(fd, 64)) is not None


def _read_pid(fd: int) -> int | None:
    try:
        # From byte 1: on Windows the holder's lock makes byte 0 unreadable.
        os.lseek(fd, 1, os.SEEK_SET)
        text = os.read(fd, 64).decode("ascii", "replace")
    except OSError:
        return None
    for word in text.split():
        if word.isdigit():
            return int(word)
    return None


if sys.platform == "win32":

    def _lock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)

else:

    def _lock(fd: int) -> None:
        # flock (not lockf): it conflicts between two opens in the same process too, so a second Store in one
        # process is refused the same way a second process is.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
