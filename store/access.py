"""Sentences for store files this user cannot write: whose they are and what to do about it.

Scope: wording from `os.stat` only; it changes nothing. A file that is not the user's is never chowned, moved or
deleted by us: the sentence tells the user the command to run.

The usual cause is one start with sudo: the database, its lock file (and the folder, when sudo made it) are then
root's, and the next start as the user can read but not write them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _current_uid() -> int | None:
    # A seam as well as a platform test: tests run as root, and fake another user here.
    return os.geteuid() if hasattr(os, "geteuid") else None


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"user {uid}"


def others_files(paths: list[Path]) -> tuple[list[Path], str | None]:
    """Those of `paths` that exist and belong to another user, and that user's name (None: all are ours, or the
    platform has no owners)."""
    me = _current_uid()
    if me is None:
        return [], None
    found, owner = [], None
    for path in paths:
        try:
            uid = path.stat().st_uid
        except OSError:
            continue
        if uid != me:
            found.append(path)
            owner = owner or _owner_name(uid)
    return found, owner


def _companions(db_path: Path) -> list[Path]:
    # Every file of one store: a sudo run leaves them all root's, and fixing one at a time means one refusal each.
    return [db_path.with_name(db_path.name + suffix) for suffix in ("", "-wal", "-shm", ".lock")]


def _make_yours(files: list[Path], owner: str) -> str:
    names = " ".join(str(f) for f in files)
    return (
        f"{'it belongs' if len(files) == 1 else 'they belong'} to {owner}, not to you (was fmoe-local started once "
        f"with sudo?). Make {'it' if len(files) == 1 else 'them'} yours again: sudo chown $USER {names}"
    )


def unwritable_database(db_path: Path) -> str:
    """The database opens but cannot be written: saying so at open beats losing every reply at Send."""
    files, owner = others_files(_companions(db_path))
    if owner:
        fix = _make_yours(files, owner)
    elif sys.platform == "win32":
        fix = "it is read-only. Untick Read-only in its Properties"
    else:
        # SQLite gives the -wal and -shm it creates the database's mode: a 444 file leaves 444 companions that would
        # keep it read-only after the file alone is made writable.
        files = [f for f in _companions(db_path)[:3] if f.exists()] or [db_path]
        fix = f"it is read-only. Make it writable: chmod u+w {' '.join(str(f) for f in files)}"
    return (
        f"The database {db_path} cannot be saved to, so nothing you chat would be kept: {fix} — then start again, "
        "or start with --data-dir pointing to a folder of your own. It was left as it is."
    )


def unopenable_lock(db_path: Path, lock_path: Path, strerror: str | None) -> str:
    """The lock file exists but cannot be opened for writing (the folder itself may be writable)."""
    files, owner = others_files(_companions(db_path))
    if owner and lock_path in files:
        fix = _make_yours(files, owner)
    else:
        fix = f"make it writable (chmod u+w {lock_path})"
    return (
        f"Cannot open the lock file {lock_path} ({strerror}): {fix} — then start again, or choose another folder "
        "with --data-dir."
    )


def unwritable_folder(folder: Path, strerror: str | None) -> str:
    files, owner = others_files([folder])
    why = f"; it belongs to {owner}, not to you" if owner else ""
    return f"Cannot write in {folder} ({strerror}{why}). Choose a folder you can write to with --data-dir."


def read_only_file_system(db_path: Path) -> str:
    """The disk holding the store takes no writes at all (mounted read-only, a locked SD card, a finished ISO):
    no owner or permission to change, so the sentence names the disk, not the file."""
    return (
        f"The database {db_path} is on a read-only disk, so nothing you chat would be kept. Start with --data-dir "
        "(or --store) pointing to a folder on a writable disk, or make this disk writable (remount it) and start "
        "again. It was left as it is."
    )
