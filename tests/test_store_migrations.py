"""Schema migrations: a hand-made v1 file (as the first release wrote it) opens as the current schema with its
data intact and searchable; a failing step leaves the file at its old version."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest
import sqlite_utils

from fmoe_local.policies.base import ModelShape
from store import open_store
from store.maps import SqliteMapPersistence
from store.migrations import SCHEMA_VERSION, migrate, schema_version

# The v1 schema written out by hand, independent of store/migrations.py, so a changed step 1 is caught.
V1_SQL = """
CREATE TABLE models (fingerprint TEXT PRIMARY KEY, name TEXT NOT NULL, num_layers INTEGER NOT NULL,
    num_experts INTEGER NOT NULL, embed_dim INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE maps (fingerprint TEXT NOT NULL REFERENCES models(fingerprint), slot INTEGER NOT NULL,
    probs BLOB NOT NULL, semantic BLOB, request_id INTEGER NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (fingerprint, slot));
CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL,
    updated REAL NOT NULL, model TEXT NOT NULL DEFAULT '', settings_json TEXT NOT NULL DEFAULT '{}');
CREATE INDEX conversations_updated ON conversations(updated);
CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL REFERENCES conversations(id),
    position INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL, stats_json TEXT, created REAL NOT NULL);
CREATE UNIQUE INDEX messages_position ON messages(conversation_id, position);
CREATE TABLE settings (key TEXT PRIMARY KEY, value_json TEXT NOT NULL);
INSERT INTO conversations VALUES (1, 'Old chat', 1700000000, 1700000100, 'mixtral', '{"cache_gb": 3.0}');
INSERT INTO messages VALUES (1, 1, 0, 'user', 'Tell me about photosynthesis', NULL, 1700000000);
INSERT INTO messages VALUES (2, 1, 1, 'assistant', 'Plants turn light into sugar.', '{"tokens": 6}', 1700000100);
INSERT INTO settings VALUES ('policy', '"lfu"');
INSERT INTO settings VALUES ('temperature', '0.3');
INSERT INTO settings VALUES ('system_prompt', '"Answer briefly."');
INSERT INTO settings VALUES ('max_new_tokens', '"many"');
INSERT INTO models VALUES ('f' , 'tiny', 2, 4, 0, 1700000000);
PRAGMA user_version = 1;
"""


def make_v1(path) -> np.ndarray:
    conn = sqlite3.connect(path)
    conn.executescript(V1_SQL)
    probs = np.full((2, 4), 0.25, np.float16)
    conn.execute("INSERT INTO maps VALUES ('f', 0, ?, NULL, 9, 1700000000)", [probs.tobytes()])
    conn.commit()
    conn.close()
    return probs


def test_v1_file_is_migrated_with_its_data_and_becomes_searchable(tmp_path):
    db_file = tmp_path / "fmoe-local.db"
    probs = make_v1(db_file)
    with open_store(tmp_path) as s:
        assert s.recovered_from is None
        assert schema_version(s.db.db) == SCHEMA_VERSION == 5
        conv = s.chats.get(1)
        assert (conv.title, conv.model, conv.settings) == ("Old chat", "mixtral", {"cache_gb": 3.0})
        assert [m.content for m in s.chats.messages(1)] == [
            "Tell me about photosynthesis",
            "Plants turn light into sugar.",
        ]
        assert s.chats.messages(1)[1].stats == {"tokens": 6}
        # v4 keeps regenerated replies as alternatives: an old reply has only itself, and takes a second one.
        assert (s.chats.messages(1)[1].alternatives, s.chats.messages(1)[1].chosen) == ((), 0)
        again = s.chats.add_alternative(1, 1, "Sugar from light.", None)
        assert [a.content for a in again.alternatives] == ["Plants turn light into sugar.", "Sugar from light."]
        # v2's full-text index covers rows written before it existed, and rows written after.
        assert [h.conversation.id for h in s.chats.search("synthesis")] == [1]
        s.chats.append(1, "user", "And chlorophyll?")
        assert [h.conversation.id for h in s.chats.search("chlorophyll")] == [1]
        assert s.settings.load().policy == "lfu"
        shape = ModelShape(num_layers=2, num_experts=4, top_k=1, embed_dim=0)
        persistence = SqliteMapPersistence(s.db, "f", shape)
        [(slot, m, link)] = persistence.load()
        assert slot == 0 and m.request_id == 9 and m.semantic is None
        assert link == -1  # v3 added successor links: a map written before them has none
        np.testing.assert_array_equal(m.probs, probs.astype(np.float32))
        persistence.put(1, m)
        persistence.put_link(0, 1)  # and an old row takes one
        assert [(slot, link) for slot, _, link in persistence.load()] == [(0, 1), (1, -1)]
    with open_store(tmp_path) as s:  # already current: nothing to do, nothing broken
        assert migrate(s.db.db) == []


def test_v5_gives_every_old_chat_the_settings_it_was_held_with(tmp_path):
    make_v1(tmp_path / "fmoe-local.db")
    with open_store(tmp_path) as s:
        conv = s.chats.get(1)
        # copied as stored: the check happens when the chat is read for a reply
        assert conv.generation == {"temperature": 0.3, "system_prompt": "Answer briefly.", "max_new_tokens": "many"}
        own = s.settings.for_chat(conv.generation)
        assert (own.temperature, own.system_prompt, own.max_new_tokens) == (0.3, "Answer briefly.", 512)
        # later changes of the defaults no longer reach the old chat; they reach a chat made without its own
        s.settings.set(temperature=1.1, system_prompt="")
        assert s.settings.for_chat(s.chats.get(1).generation).temperature == 0.3
        assert s.settings.for_chat(s.chats.create("new").generation).temperature == 1.1


def test_a_failing_step_leaves_the_previous_version_intact(tmp_path):
    db_file = tmp_path / "v1.db"
    make_v1(db_file)
    conn = sqlite3.connect(db_file)
    # Step 2 creates the index, fills it, then triggers messages_ai/_ad/_au: a taken name fails the last one.
    conn.executescript("CREATE TABLE other (x); CREATE TRIGGER messages_au AFTER INSERT ON other BEGIN SELECT 1; END;")
    conn.close()
    db = sqlite_utils.Database(db_file)
    with pytest.raises(sqlite3.OperationalError):
        migrate(db)
    assert schema_version(db) == 1
    assert not db["messages_fts"].exists()
    assert not [t for t in db.triggers if t.table == "messages"]
    db.conn.close()
