"""The store's exceptions. Every one carries a sentence the app can show as is; catch `StoreError` for all.

Scope: exception types only.
"""

from __future__ import annotations

from pathlib import Path


class StoreError(RuntimeError):
    """The database cannot be used; the message says what the user can do."""


class StoreInUseError(StoreError):
    """Another running fmoe-local holds this database."""

    def __init__(self, db_path: Path, pid: int | None) -> None:
        who = f"another fmoe-local (process {pid})" if pid else "another fmoe-local"
        super().__init__(
            f"The data in {db_path.parent} is already in use by {who}. Close that window or process first, "
            f"or start this one with --data-dir pointing to a different folder."
        )
        self.db_path = db_path
        self.pid = pid


class StoreTooNewError(StoreError):
    """The file was written by a newer fmoe-local; it is left untouched."""
