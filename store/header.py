"""A SQLite file's schema version and application id, read from its bytes without SQLite.

Scope: parsing the 100-byte database header and the WAL's frames of page 1. It does NOT open connections.

Why without SQLite: a connection's first statement parses the whole schema, and a schema object a newer
fmoe-local made that this SQLite cannot parse fails as "malformed database schema", which is how corruption looks
too. Read here first, a newer file is refused before anything could take it for damaged and move it aside.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

SQLITE_MAGIC = b"SQLite format 3\x00"
_HEADER_BYTES = 100
_WAL_MAGICS = {0x377F0682, 0x377F0683}
_WAL_HEADER_BYTES = 32
_WAL_FRAME_HEADER_BYTES = 24


@dataclass(frozen=True)
class Header:
    user_version: int
    application_id: int


def read_header(path: Path) -> Header | None:
    """The header of the database at `path`, with the newest user_version its WAL holds; None when `path` is
    not a SQLite file (missing, empty, too short, another format, not a regular file)."""
    if not path.is_file():
        return None  # opening a FIFO to read would wait for a writer forever
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER_BYTES)
    except OSError:
        return None
    if len(head) < _HEADER_BYTES or not head.startswith(SQLITE_MAGIC):
        return None
    user_version, application_id = _versions(head)
    # A newer app killed before its checkpoint leaves its migration's page 1 only in the WAL.
    wal_versions = _wal_page1_versions(path.with_name(path.name + "-wal"))
    return Header(max([user_version, *wal_versions]), application_id)


def _versions(page1: bytes) -> tuple[int, int]:
    user_version = struct.unpack(">i", page1[60:64])[0]  # signed, as PRAGMA user_version reads it
    application_id = struct.unpack(">I", page1[68:72])[0]
    return user_version, application_id


def _wal_page1_versions(wal: Path) -> list[int]:
    """user_version of every copy of page 1 in the WAL's current generation (frames whose salts match its header;
    older frames are left over from before a checkpoint). Committed or not: erring towards "newer" only refuses."""
    if not wal.is_file():
        return []
    try:
        f = open(wal, "rb")
    except OSError:
        return []
    with f:
        head = f.read(_WAL_HEADER_BYTES)
        if len(head) < _WAL_HEADER_BYTES:
            return []
        magic, _, page_size, _, salt1, salt2 = struct.unpack(">6I", head[:24])
        if magic not in _WAL_MAGICS or page_size < 512 or page_size & (page_size - 1):
            return []
        found, offset = [], _WAL_HEADER_BYTES
        while True:
            f.seek(offset)
            frame = f.read(_WAL_FRAME_HEADER_BYTES)
            if len(frame) < _WAL_FRAME_HEADER_BYTES:
                return found
            page_no, _, frame_salt1, frame_salt2 = struct.unpack(">4I", frame[:16])
            if (frame_salt1, frame_salt2) != (salt1, salt2):
                return found  # the rest of the file is an older generation
            if page_no == 1:
                page = f.read(_HEADER_BYTES)
                if len(page) == _HEADER_BYTES:
                    found.append(_versions(page)[0])
            offset += _WAL_FRAME_HEADER_BYTES + page_size
