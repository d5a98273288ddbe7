"""Chats: round trip with per-reply stats, editing, ordering, search (FTS and LIKE), export."""

from __future__ import annotations

import json

import pytest

from fmoe_local.stats import RequestStats
from store import ChatNotFoundError, open_store


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path)
    yield s
    s.close()


def reply_stats() -> RequestStats:
    return RequestStats(
        ttft_s=0.25,
        tpot_s=0.05,
        tokens=12,
        prompt_tokens=7,
        hits=30,
        misses=10,
        layer_hits=[[1, 2], [3, 4]],
        layer_misses=[[0, 1], [1, 0]],
        finish_reason="stop",
    )


def test_conversation_round_trips_with_stats_across_reopen(tmp_path):
    with open_store(tmp_path) as s:
        c = s.chats.create("Rust question", model="tiny-mixtral", settings={"cache_gb": 2.0, "policy": "fmoe"})
        s.chats.append(c.id, "system", "Be brief.")
        s.chats.append(c.id, "user", "What is a borrow?")
        s.chats.append(c.id, "assistant", "A reference that does not own.", stats=reply_stats())
    with open_store(tmp_path) as s:
        conv = s.chats.get(c.id)
        assert (conv.title, conv.model, conv.settings) == (
            "Rust question",
            "tiny-mixtral",
            {"cache_gb": 2.0, "policy": "fmoe"},
        )
        msgs = s.chats.messages(c.id)
    assert [(m.position, m.role, m.content) for m in msgs] == [
        (0, "system", "Be brief."),
        (1, "user", "What is a borrow?"),
        (2, "assistant", "A reference that does not own."),
    ]
    assert msgs[0].stats is None
    stats = msgs[2].stats
    assert stats["tokens"] == 12 and stats["hit_rate"] == pytest.approx(0.75)
    assert stats["layer_hits"] == [[1, 2], [3, 4]] and stats["per_layer_hit_rate"] == pytest.approx([0.75, 0.875])


def test_regenerate_and_edit(store):
    c = store.chats.create()
    store.chats.append(c.id, "user", "first question")
    store.chats.append(c.id, "assistant", "first answer", stats={"tokens": 2})
    updated = store.chats.update_last(c.id, "better answer", stats={"tokens": 3})
    assert (updated.position, updated.content, updated.stats) == (1, "better answer", {"tokens": 3})
    store.chats.edit(c.id, 0, "edited question")  # the user edits the first question: everything after it goes
    assert [(m.position, m.content) for m in store.chats.messages(c.id)] == [(0, "edited question")]
    empty = store.chats.create()
    with pytest.raises(ValueError, match="no message"):
        store.chats.update_last(empty.id, "x")
    with pytest.raises(ValueError, match="role"):
        store.chats.append(c.id, "robot", "x")


def test_list_is_most_recent_first_rename_and_delete(store):
    a = store.chats.create("a")
    b = store.chats.create("b")
    store.chats.append(a.id, "user", "bump a")  # a becomes the most recent
    assert [c.title for c in store.chats.list()] == ["a", "b"]
    store.chats.rename(b.id, "  renamed b  ")
    assert [c.title for c in store.chats.list()] == ["renamed b", "a"]
    store.chats.delete(a.id)
    assert [c.title for c in store.chats.list()] == ["renamed b"]
    assert store.db.db.execute("SELECT count(*) FROM messages WHERE conversation_id = ?", [a.id]).fetchone()[0] == 0
    with pytest.raises(ChatNotFoundError, match="no longer exists"):
        store.chats.get(a.id)
    with pytest.raises(ChatNotFoundError):
        store.chats.append(a.id, "user", "into the void")


@pytest.fixture
def searchable(store):
    py = store.chats.create("Python help")
    store.chats.append(py.id, "user", 'How do I sort a dict by value in Python? I tried "sorted" AND failed')
    cooking = store.chats.create("Dinner")
    store.chats.append(cooking.id, "user", "A recipe with 100% rye_flour and cumin")
    store.chats.append(cooking.id, "assistant", "Toast the cumin first.")
    return store, py, cooking


def test_search_finds_substrings_in_messages_and_titles(searchable):
    store, py, cooking = searchable
    assert store.db.db["messages_fts"].exists()
    hits = store.chats.search("PYTH")  # substring, case-insensitive (trigram FTS)
    assert [h.conversation.id for h in hits] == [py.id]
    assert "Python" in hits[0].snippet
    assert [h.conversation.id for h in store.chats.search("cumin")] == [cooking.id]  # one hit per conversation
    assert [h.conversation.id for h in store.chats.search("dinner")] == [cooking.id]  # title
    assert store.chats.search("zebra") == []
    assert store.chats.search("   ") == []


def test_search_short_and_special_queries_use_like_with_escaping(searchable):
    store, py, cooking = searchable
    assert [h.conversation.id for h in store.chats.search("%")] == [cooking.id]  # a literal %, not a wildcard
    assert [h.conversation.id for h in store.chats.search("e_f")] == [cooking.id]  # literal _
    assert {h.conversation.id for h in store.chats.search("in")} == {py.id, cooking.id}
    assert [h.conversation.id for h in store.chats.search('"sorted" AND')] == [py.id]  # no FTS syntax


def test_search_index_follows_edits_and_deletes(searchable):
    store, py, _ = searchable
    store.chats.update_last(py.id, "How do I reverse a list?")
    assert store.chats.search("sort a dict") == []
    assert [h.conversation.id for h in store.chats.search("reverse")] == [py.id]
    store.chats.delete(py.id)
    assert store.chats.search("reverse") == []


def test_export_json(store):  # the Markdown export is the UI's (tests/test_ui_export.py)
    c = store.chats.create("Export me", model="tiny-qwen")
    store.chats.append(c.id, "user", "Hello *there*")
    store.chats.append(c.id, "assistant", "Hi! ünïcode ✓", stats=reply_stats())
    doc = json.loads(store.chats.export_json(c.id))
    assert doc["format"] == "fmoe-local-chat" and doc["conversation"]["title"] == "Export me"
    assert [m["content"] for m in doc["messages"]] == ["Hello *there*", "Hi! ünïcode ✓"]
    assert doc["messages"][1]["stats"]["tokens"] == 12
    assert doc["conversation"]["created_iso"].endswith("Z")


def test_a_reply_whose_question_was_edited_away_is_not_stored_alone(tmp_path):
    from store import open_store

    with open_store(tmp_path) as store:
        conv = store.chats.create("q")
        asked = store.chats.append(conv.id, "user", "first question")
        store.chats.append(conv.id, "user", "second question")
        store.chats.edit(conv.id, asked.position, "edited question")  # Edit the first, while the reply generated
        assert store.chats.append(conv.id, "assistant", "the reply", after=asked.position + 1) is None
        assert [m.content for m in store.chats.messages(conv.id)] == ["edited question"]
        again = store.chats.messages(conv.id)[-1]
        assert store.chats.append(conv.id, "assistant", "its reply", after=again.position) is not None
        assert [m.content for m in store.chats.messages(conv.id)] == ["edited question", "its reply"]


def test_an_edit_that_fails_half_way_keeps_the_conversation_as_it_was(tmp_path, monkeypatch):
    from store import chats as chats_module
    from store import open_store

    with open_store(tmp_path) as store:
        conv = store.chats.create("q")
        store.chats.append(conv.id, "user", "first question")
        store.chats.append(conv.id, "assistant", "first answer")

        def full_disk(stats):
            raise OSError("database or disk is full")

        monkeypatch.setattr(chats_module, "_stats_json", full_disk)  # the new message cannot be written
        with pytest.raises(OSError):
            store.chats.edit(conv.id, 0, "edited question")
        # before: the question and its answer were deleted in a transaction of their own, and nothing replaced them
        assert [m.content for m in store.chats.messages(conv.id)] == ["first question", "first answer"]


def test_regenerated_replies_are_kept_as_alternatives_and_the_chosen_one_survives_a_reopen(tmp_path):
    with open_store(tmp_path) as s:
        c = s.chats.create("sea")
        s.chats.append(c.id, "user", "Tell me about the sea.")
        first = s.chats.append(c.id, "assistant", "Waves.", stats={"tokens": 1})
        second = s.chats.add_alternative(c.id, first.position, "Salt water.", stats=reply_stats())
        assert [a.content for a in second.alternatives] == ["Waves.", "Salt water."]
        assert (second.chosen, second.content, second.stats["tokens"]) == (1, "Salt water.", 12)
        back = s.chats.choose_alternative(c.id, first.position, 0)
        assert (back.content, back.stats) == ("Waves.", {"tokens": 1})  # what the model reads next
        with pytest.raises(ValueError, match="pick one of those"):
            s.chats.choose_alternative(c.id, first.position, 2)
        more = s.chats.extend_last(c.id, first.position, " Big ones.", stats={"tokens": 2})
        assert more.content == "Waves. Big ones." and more.alternatives[0].content == "Waves. Big ones."
        s.chats.append(c.id, "user", "And ships?")  # the conversation moved on: a late regenerate is not kept
        assert s.chats.add_alternative(c.id, first.position, "late", None) is None
        assert s.chats.extend_last(c.id, first.position, "late", None) is None
    with open_store(tmp_path) as s:
        reply = s.chats.messages(c.id)[1]
        assert (reply.chosen, [a.content for a in reply.alternatives]) == (0, ["Waves. Big ones.", "Salt water."])
        assert [h.conversation.id for h in s.chats.search("Big ones")] == [c.id]  # search sees the chosen text


def test_continuing_a_reply_appends_to_the_same_message(store):
    c = store.chats.create("story")
    store.chats.append(c.id, "user", "Tell me a story.")
    cut = store.chats.append(c.id, "assistant", "Once upon", stats={"finish_reason": "length"})
    done = store.chats.extend_last(c.id, cut.position, " a time.", stats={"finish_reason": "stop"})
    assert (done.id, done.content, done.stats) == (cut.id, "Once upon a time.", {"finish_reason": "stop"})
    assert len(store.chats.messages(c.id)) == 2


def test_export_all_is_every_conversation_with_its_messages_and_their_versions(tmp_path):
    from store import open_store

    with open_store(tmp_path) as s:
        a, b = s.chats.create("sea"), s.chats.create("hills")
        s.chats.create("nothing yet")
        s.chats.append(a.id, "user", "Tell me about the sea.")
        first = s.chats.append(a.id, "assistant", "Waves.", stats={"tokens": 1})
        s.chats.add_alternative(a.id, first.position, "Salt water.", stats={"tokens": 2})
        s.chats.append(b.id, "user", "And hills? ünïcode ✓")
        doc = json.loads(s.chats.export_all_json())
    assert doc["format"] == "fmoe-local-chats" and doc["version"] == 1
    by_title = {c["conversation"]["title"]: c["messages"] for c in doc["conversations"]}
    assert set(by_title) == {"sea", "hills", "nothing yet"} and by_title["nothing yet"] == []
    sea = by_title["sea"]
    assert [m["content"] for m in sea] == ["Tell me about the sea.", "Salt water."]
    assert [a["content"] for a in sea[1]["alternatives"]] == ["Waves.", "Salt water."]
    assert by_title["hills"][0]["content"] == "And hills? ünïcode ✓"
