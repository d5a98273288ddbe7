"""fmoe-local's persistent store (SQLite via sqlite-utils): expert maps per model, chats, settings.

Scope: `open_store(location) -> Store`, the one object the app and the CLI hold. It does NOT import gradio or
torch; fmoe_local never imports this package (the app hands `Store.map_persistence(...)` to `Runtime.load`).

    store = open_store(args.store or args.data_dir)   # None = per-OS user data folder
    if store.recovery: tell the user the old file was damaged, where it went, and what came back from it
    persistence = store.map_persistence(model_dir, shape)  # MapPersistence for the runtime
    ...
    store.close()                                      # drains the map writers, releases the instance lock
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from store.chats import ChatNotFoundError, ChatStore, Conversation, Message, SearchHit
from store.db import StoreDb, open_database
from store.errors import StoreError, StoreInUseError, StoreTooNewError
from store.maps import MapShape, SqliteMapPersistence, clear_model, list_models, model_fingerprint
from store.paths import MODELS_DIRNAME, default_data_dir, resolve_db_path
from store.salvage import Recovery
from store.settings import AppSettings, SettingsStore

__all__ = [
    "AppSettings",
    "ChatNotFoundError",
    "Conversation",
    "Message",
    "Recovery",
    "SearchHit",
    "SqliteMapPersistence",
    "Store",
    "StoreError",
    "StoreInUseError",
    "StoreTooNewError",
    "default_data_dir",
    "model_fingerprint",
    "open_store",
]


@dataclass
class Store:
    db: StoreDb
    chats: ChatStore
    settings: SettingsStore
    _persistences: list[SqliteMapPersistence] = field(default_factory=list)
    _closed: bool = False

    @property
    def path(self) -> Path:
        return self.db.path

    @property
    def data_dir(self) -> Path:
        return self.db.path.parent

    @property
    def models_dir(self) -> Path:
        return self.data_dir / MODELS_DIRNAME

    @property
    def recovered_from(self) -> Path | None:
        """Where a damaged database was moved at open (None when the file was fine)."""
        return self.db.recovered_from

    @property
    def recovery(self) -> Recovery | None:
        """Where a damaged database went and how many of its chats came back (None when the file was fine)."""
        return self.db.recovery

    def map_persistence(self, model_dir: str | Path, shape: MapShape, name: str = "") -> SqliteMapPersistence:
        """The MapPersistence of the model in `model_dir` (fingerprinted), for `Runtime.load(map_persistence=)`."""
        persistence = SqliteMapPersistence(
            self.db, model_fingerprint(model_dir), shape, name=name or Path(model_dir).name
        )
        # Closed ones (a model unloaded) are dropped so a long session does not keep them all.
        self._persistences = [p for p in self._persistences if not p.closed] + [persistence]
        return persistence

    def models_with_maps(self) -> list[dict]:
        return list_models(self.db)

    def clear_maps(self, fingerprint: str) -> int:
        """Delete the stored maps of a model that is not loaded (use the persistence's clear() when it is)."""
        return clear_model(self.db, fingerprint)

    def close(self) -> None:
        """Drain and stop the map writers, close the database, release the instance lock. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            for persistence in self._persistences:
                persistence.close()
        finally:
            self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(location: str | Path | None = None, check: bool = True) -> Store:
    """Open the store at a data folder or a database file (None = the per-OS user data folder).

    Raises StoreError — StoreInUseError when another instance holds it, StoreTooNewError for a newer file; the
    message is a sentence for the user. A damaged file is moved aside, what can be read from it is copied into
    the new one, and `Store.recovery` says where it went and how much came back.
    """
    path = resolve_db_path(location)
    # A file the user named (not our own file name inside a data folder) must be new or ours.
    named_by_user = location is not None and Path(str(location)).expanduser() == path
    store_db = open_database(path, check=check, named_by_user=named_by_user)
    return Store(db=store_db, chats=ChatStore(store_db), settings=SettingsStore(store_db))
