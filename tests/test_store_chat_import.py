"""Chat import: what the export writes comes back as new chats (messages, versions, stats, generation settings),
never over an existing chat; anything else is refused whole, in a sentence, with nothing stored."""

from __future__ import annotations

import json

import pytest

from store import open_store
from store.chat_import import MAX_DEPTH, MAX_IMPORT_BYTES, ImportRefused, parse_export


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path) as s:
        yield s


def filled(store) -> int:
    conv = store.chats.create("Sea", model="tiny", generation={"temperature": 0.2, "system_prompt": "Be brief."})
    store.chats.append(conv.id, "user", "What is the sea?")
    store.chats.append(conv.id, "assistant", "Water.", {"tokens_per_s": 8.0, "finish_reason": "stop"})
    store.chats.add_alternative(conv.id, 1, "Salt water.", {"tokens_per_s": 9.0, "per_layer_hit_rate": [0.5, 1]})
    store.chats.choose_alternative(conv.id, 1, 0)
    return conv.id


def same_chat(store, a: int, b: int) -> None:
    one, two = store.chats.get(a), store.chats.get(b)
    assert (one.title, one.model, one.generation, one.created) == (two.title, two.model, two.generation, two.created)
    for m, n in zip(store.chats.messages(a), store.chats.messages(b), strict=True):
        assert (m.role, m.content, m.stats, m.alternatives, m.chosen) == (
            n.role,
            n.content,
            n.stats,
            n.alternatives,
            n.chosen,
        )


def test_every_chat_export_comes_back_as_new_chats(store):
    first = filled(store)
    other = store.chats.create("Empty")
    raw = store.chats.export_all_json().encode()
    ids = store.chats.import_chats(parse_export(raw))
    assert len(ids) == 2 and not {first, other.id} & set(ids)  # new ids: nothing replaced
    same_chat(store, first, ids[0])
    assert store.chats.messages(ids[1]) == []
    assert len(store.chats.list()) == 4
    assert [h.conversation.id for h in store.chats.search("Salt")] == []  # the chosen version is what search sees
    assert sorted(h.conversation.id for h in store.chats.search("Water")) == [first, ids[0]]


def test_one_chat_export_comes_back_too(store):
    first = filled(store)
    [again] = store.chats.import_chats(parse_export(store.chats.export_json(first).encode()))
    same_chat(store, first, again)


def test_stats_keep_only_what_the_chat_can_show(store):
    doc = {"format": "fmoe-local-chat", "version": 1, "conversation": {"title": "x"}, "messages": [
        {"role": "assistant", "content": "hi", "stats": {
            "tokens_per_s": "fast", "ttft_s": 0.5, "finish_reason": "stop", "nested": {"a": 1}, "huge": 10**30,
        }},
    ]}  # fmt: skip
    [chat] = parse_export(json.dumps(doc).encode())
    assert chat.messages[0].stats == {"ttft_s": 0.5, "finish_reason": "stop"}
    assert chat.title == "x" and chat.generation is None


def export_with(**message) -> bytes:
    msg = {"role": "user", "content": "hi", **message}
    return json.dumps({"format": "fmoe-local-chats", "version": 1, "conversations": [
        {"conversation": {"title": "t"}, "messages": [msg]}]}).encode()  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (b"\xff\xfe not text", "not JSON text"),
        (b"# A Markdown export", "not JSON text"),
        (b'{"format": "something-else"}', "not a chat export of fmoe-local"),
        (b"[1, 2]", "not a chat export of fmoe-local"),
        (export_with(content=3), "content"),
        (export_with(content="\\ud800"), None),  # a lone surrogate, escaped in the JSON
        (export_with(role="tool"), "role"),
        (export_with(created=float("nan")), "not JSON text"),  # NaN is no JSON value
        (export_with(chosen=2, alternatives=[{"content": "a"}, {"content": "b"}]), "chosen version"),
        (b'{"format": "fmoe-local-chats", "version": 2, "conversations": []}', "version"),
        (b"[" * (MAX_DEPTH + 5) + b"]" * (MAX_DEPTH + 5), "nested deeper"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON text"),  # deeper than the parser's own stack
        (b" " * (MAX_IMPORT_BYTES + 1), "at most 5 MB"),
    ],
)
def test_anything_else_is_refused_in_a_sentence(store, raw, said):
    if said is None:  # json.dumps escaped the backslash: put the lone surrogate's escape itself in the file
        raw, said = raw.replace(b"\\\\ud800", b"\\ud800"), "not valid Unicode"
    with pytest.raises(ImportRefused, match=said) as refused:
        parse_export(raw)
    assert str(refused.value).endswith(".")
    assert store.chats.list() == []
