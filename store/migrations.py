"""Schema versions of the fmoe-local database and the steps between them.

Scope: the ordered list of migrations and `migrate(db)`, which brings a database to the newest version, one
transaction per step, with `PRAGMA user_version` moved inside the same transaction (a crash leaves the old
version intact). It does NOT open files or recover corrupt ones (db.py).

Rules: a shipped step is never edited; a change is a new step appended to MIGRATIONS.
Timestamps are Unix seconds (REAL). Blobs of expert maps are float16, little-endian, C order (maps.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import sqlite_utils

from store.errors import StoreTooNewError


def _v1_initial(db: sqlite_utils.Database) -> None:
    db.executescript(
        """
        CREATE TABLE models (
            fingerprint TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            num_layers INTEGER NOT NULL,
            num_experts INTEGER NOT NULL,
            embed_dim INTEGER NOT NULL,
            created REAL NOT NULL
        );
        CREATE TABLE maps (
            fingerprint TEXT NOT NULL REFERENCES models(fingerprint),
            slot INTEGER NOT NULL,
            probs BLOB NOT NULL,
            semantic BLOB,
            request_id INTEGER NOT NULL,
            created REAL NOT NULL,
            PRIMARY KEY (fingerprint, slot)
        );
        CREATE TABLE conversations (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            created REAL NOT NULL,
            updated REAL NOT NULL,
            model TEXT NOT NULL DEFAULT '',
            settings_json TEXT NOT NULL DEFAULT '{}'
        );
        CREATE INDEX conversations_updated ON conversations(updated);
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id),
            position INTEGER NOT NULL,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            stats_json TEXT,
            created REAL NOT NULL
        );
        CREATE UNIQUE INDEX messages_position ON messages(conversation_id, position);
        CREATE TABLE settings (
            key TEXT PRIMARY KEY,
            value_json TEXT NOT NULL
        );
        """
    )


def fts5_available(db: sqlite_utils.Database) -> bool:
    options = {row[0] for row in db.execute("PRAGMA compile_options").fetchall()}
    return "ENABLE_FTS5" in options


def _v2_message_search(db: sqlite_utils.Database) -> None:
    # Chat search must find substrings ("pyth" in "python"), which word tokenizers do not; the trigram
    # tokenizer does, and it is indexed. SQLite builds without FTS5 keep searching with LIKE (chats.py).
    if not fts5_available(db):
        return
    db["messages"].enable_fts(["content"], create_triggers=True, tokenize="trigram")


def _v3_map_links(db: sqlite_utils.Database) -> None:
    # The slot of the map stored right after this one in its request (fmoe_local/map_links.py); NULL: none known.
    # Rows written before v3 load with no link, as they did.
    db.execute("ALTER TABLE maps ADD COLUMN next_slot INTEGER")


def _v4_reply_alternatives(db: sqlite_utils.Database) -> None:
    # Regenerate keeps the earlier replies (store/chats.py): every version of a reply as JSON [{content, stats}],
    # and which one is chosen. The chosen one is also the row's content and stats_json, so what the model reads,
    # search and export see only it. NULL: the reply has one version, its content.
    db.execute("ALTER TABLE messages ADD COLUMN alternatives_json TEXT")
    db.execute("ALTER TABLE messages ADD COLUMN chosen INTEGER NOT NULL DEFAULT 0")


# The generation settings a v4 file kept once for every chat; v5 gives each chat its own copy of them.
_V5_CHAT_KEYS = (
    "system_prompt", "temperature", "top_p", "max_new_tokens"
)  # fmt: skip


def _v5_chat_generation(db: sqlite_utils.Database) -> None:
    # Each chat's own generation settings (system prompt, sampling) as JSON {name: value} (store/chats.py); NULL: the
    # saved defaults. A chat made before v5 was held with the settings then saved for all chats: it keeps them as its
    # own, so opening it after the update shows what it was answered with. The values are copied as they are
    # stored; reading them checks each (SettingsStore.for_chat), as the settings table's are.
    db.execute("ALTER TABLE conversations ADD COLUMN generation_json TEXT")
    marks = ", ".join("?" * len(_V5_CHAT_KEYS))
    rows = db.execute(f"SELECT key, value_json FROM settings WHERE key IN ({marks})", _V5_CHAT_KEYS).fetchall()
    saved = {}
    for key, value_json in rows:
        try:
            saved[key] = json.loads(value_json)
        except ValueError:
            continue  # unreadable: that setting stays the default's, as SettingsStore.load would have it
    db.execute("UPDATE conversations SET generation_json = ?", [json.dumps(saved)])


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [
    _v1_initial,
    _v2_message_search,
    _v3_map_links,
    _v4_reply_alternatives,
    _v5_chat_generation,
]
SCHEMA_VERSION = len(MIGRATIONS)


def schema_version(db: sqlite_utils.Database) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def too_new(version: int) -> StoreTooNewError:
    return StoreTooNewError(
        f"This data was saved by a newer fmoe-local (schema {version}, this one knows {SCHEMA_VERSION}). "
        "Update fmoe-local, or start it with --data-dir pointing to a different folder."
    )


def check_not_newer(db: sqlite_utils.Database) -> int:
    """The file's schema version; StoreTooNewError when this fmoe-local is older than the file."""
    current = schema_version(db)
    if current > SCHEMA_VERSION:
        raise too_new(current)
    return current


def migrate(db: sqlite_utils.Database) -> list[int]:
    """Apply every missing step; return the versions applied (empty when already current)."""
    current = check_not_newer(db)
    applied = []
    for version in range(current + 1, SCHEMA_VERSION + 1):
        with db.atomic():
            MIGRATIONS[version - 1](db)
            db.execute(f"PRAGMA user_version = {version}")
        applied.append(version)
    return applied
