"""One app instance per database: an exclusive OS lock on `<db>.lock`, with the holder's PID written inside.

Scope: acquiring, describing and releasing that lock. It does NOT open the database.

An OS lock (flock on POSIX, msvcrt on Windows) is released by the kernel when its process dies, kill -9
included, so a crashed app never leaves a stale lock behind; the PID inside only makes the message precise.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path

from store.errors import StoreInUseError

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
        # O_RDWR without O_TRUNC: the current holder's PID must stay readable until we own the lock.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        # Windows locks byte 0, so the PID goes after a newline to stay readable by a second instance.
        os.write(fd, f"\n{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd
        return self

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
