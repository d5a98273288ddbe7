"""A damaged database is moved aside, and what can still be read from it comes back: chats, messages (with their
alternatives) and settings; the moved file stays as it was. Before, one bad page anywhere, even in the expert
maps (a cache), made every chat disappear."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from fmoe_local.config import RuntimeConfig
from store import open_store
from store.salvage import RECOVERED_TITLE
from tests.test_store_maps import SHAPE, fake_model, random_map

CHATS = 6


def _fill(tmp_path):
    """A data folder with chats (one reply regenerated, so it has versions), a setting and a few hundred maps."""
    data = tmp_path / "data"
    data.mkdir()
    with open_store(data) as store:
        for i in range(CHATS):
            c = store.chats.create(f"chat {i}", model="demo", settings={"temperature": 0.1 * i})
            for j in range(8):
                role = "user" if j % 2 == 0 else "assistant"
                store.chats.append(c.id, role, f"chat {i} message {j} pelican " + "x" * 300, stats={"tokens": j})
            store.chats.add_alternative(c.id, 7, f"chat {i} another answer")
        store.settings.set(prefetch_distance=2)
        persistence = store.map_persistence(fake_model(tmp_path / "model"), SHAPE)
        rng = np.random.default_rng(0)
        for slot in range(400):
            persistence.put(slot, random_map(rng, slot))
        persistence.flush()
        store.db.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return data


def _chats(store):
    return [(c, store.chats.messages(c.id)) for c in reversed(store.chats.list())]


def _pages_of(path, name):
    conn = sqlite3.connect(path)
    try:
        pages = [r[0] for r in conn.execute("SELECT pageno FROM dbstat WHERE name = ? ORDER BY pageno", [name])]
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    except sqlite3.OperationalError:
        pytest.skip("this SQLite has no dbstat table to find a table's pages")
    finally:
        conn.close()
    return pages, page_size


def _scribble(path, pages, page_size):
    data = bytearray(path.read_bytes())
    for page in pages:
        at = (page - 1) * page_size + (100 if page == 1 else 0)
        data[at : at + 64] = b"\xff" * 64  # the b-tree page header: the page can no longer be read
    path.write_bytes(bytes(data))
    return bytes(data)


@pytest.mark.parametrize(
    "damaged",
    ["maps", "messages_position", "messages_fts_data", "conversations_updated"],
    ids=["expert-maps-table", "messages-index", "search-table", "conversations-index"],
)
def test_damage_outside_the_chats_loses_no_chat(tmp_path, damaged):
    data = _fill(tmp_path)
    db_file = data / "fmoe-local.db"
    with open_store(data) as store:
        before, settings = _chats(store), store.settings.load()
    pages, page_size = _pages_of(db_file, damaged)
    moved_bytes = _scribble(db_file, pages[len(pages) // 2 : len(pages) // 2 + 1], page_size)
    with open_store(data) as store:
        recovery = store.recovery
        assert recovery is not None and recovery.moved_to == store.recovered_from
        assert _chats(store) == before  # ids, titles, positions, versions, stats: all as they were
        assert store.settings.load() == settings
        assert recovery.what_came_back() == f"all {CHATS} chats were recovered from it"
        assert {h.conversation.id for h in store.chats.search("pelican")} == {c.id for c, _ in before}
        new = store.chats.create("after the damage")
        assert store.chats.append(new.id, "user", "hi").position == 0 and new.id > max(c.id for c, _ in before)
        # The expert maps are a cache: not copied, they regrow.
        assert store.db.db.execute("SELECT count(*) FROM maps").fetchone()[0] == 0
    assert recovery.moved_to.read_bytes() == moved_bytes  # the user's backup, byte for byte
    assert sorted(p.name for p in data.iterdir() if p.name.startswith(recovery.moved_to.name)) == [
        recovery.moved_to.name
    ]  # no -wal or -shm left beside it by the read-only salvage


def test_a_damaged_messages_page_loses_only_that_page(tmp_path):
    data = _fill(tmp_path)
    db_file = data / "fmoe-local.db"
    with open_store(data) as store:
        before = _chats(store)
    pages, page_size = _pages_of(db_file, "messages")
    conn = sqlite3.connect(db_file)
    leaf, rows_on_it = conn.execute(
        "SELECT pageno, ncell FROM dbstat WHERE name = 'messages' AND pagetype = 'leaf' ORDER BY pageno LIMIT 1 OFFSET 1"
    ).fetchone()
    conn.close()
    _scribble(db_file, [leaf], page_size)
    with open_store(data) as store:
        after = _chats(store)
        recovery = store.recovery
    total = sum(len(messages) for _, messages in before)
    kept = [m for _, messages in after for m in messages]
    assert [c for c, _ in after] == [c for c, _ in before]
    assert len(kept) == total - rows_on_it  # that page's rows lost, no more
    assert all(m in before[m.conversation_id - 1][1] for m in kept)
    assert recovery.what_came_back() == (
        f"{CHATS} of {CHATS} chats ({len(kept)} of {total} messages) were recovered from it; what is missing could "
        "not be read"
    )


def test_messages_whose_chat_row_is_lost_come_back_in_a_chat_of_their_own(tmp_path):
    data = _fill(tmp_path)
    db_file = data / "fmoe-local.db"
    with open_store(data) as store:
        before = _chats(store)
    pages, page_size = _pages_of(db_file, "conversations")
    _scribble(db_file, pages, page_size)
    with open_store(data) as store:
        after = _chats(store)
        recovery = store.recovery
    assert [c.id for c, _ in after] == [c.id for c, _ in before] and {c.title for c, _ in after} == {RECOVERED_TITLE}
    assert [messages for _, messages in after] == [messages for _, messages in before]
    assert recovery.chats == CHATS and recovery.messages == recovery.messages_total == CHATS * 8


def test_a_file_with_nothing_readable_starts_empty_and_says_so(tmp_path):
    from ui import header
    from ui.render import code_literal
    from ui.session import Session

    data = _fill(tmp_path)
    db_file = data / "fmoe-local.db"
    pages, page_size = _pages_of(db_file, "sqlite_schema")
    _scribble(db_file, pages, page_size)  # the schema itself: no table can even be found
    with open_store(data) as store:
        assert store.chats.list() == []
        recovery = store.recovery
        assert (recovery.chats, recovery.chats_total) == (0, None)
        shown = header(Session(store=store, config=RuntimeConfig(device="cpu")))
    assert (
        f"⚠️ **Your database was damaged.** It was moved to {code_literal(recovery.moved_to)}, kept as it was, and no "
        "chat could be read from it, so a new, empty one was started." in shown
    )


def test_a_file_cut_short_gives_back_what_it_still_holds(tmp_path):
    """A copy cut short or a disk that filled up: the file is shorter than its header says, which SQLite refuses
    whole; the chats at its start still come back."""
    data = _fill(tmp_path)
    db_file = data / "fmoe-local.db"
    with open_store(data) as store:
        before = _chats(store)
    pages, page_size = _pages_of(db_file, "maps")  # written last, so at the end of the file
    with open(db_file, "r+b") as f:
        f.truncate((pages[-3] - 1) * page_size)
    with open_store(data) as store:
        assert _chats(store) == before
        assert store.recovery.what_came_back() == f"all {CHATS} chats were recovered from it"


def test_a_garbled_json_column_does_not_break_the_chat_it_belongs_to(tmp_path):
    """Text read from a damaged page can be garbled; a stats or versions column that is not JSON any more would
    make every later read of its chat fail, so it comes back as its default (no stats, a single version)."""
    data = _fill(tmp_path)
    db_file = data / "fmoe-local.db"
    conn = sqlite3.connect(db_file)
    conn.execute("UPDATE messages SET stats_json = '{\"tok', alternatives_json = '[{\"con' WHERE id = 8")
    conn.execute("UPDATE conversations SET settings_json = '{\"temp' WHERE id = 1")
    conn.commit()
    conn.close()
    pages, page_size = _pages_of(db_file, "maps")
    _scribble(db_file, pages[1:2], page_size)
    with open_store(data) as store:
        assert store.chats.get(1).settings == {}
        last = store.chats.messages(1)[-1]
        assert (last.id, last.stats, last.alternatives, last.chosen) == (8, None, (), 0)
        assert store.recovery.what_came_back() == f"all {CHATS} chats were recovered from it"
