"""Chat display helpers: what the model sees stays the stored text; the stats line is display-only."""

from __future__ import annotations

import gradio as gr
import pytest

from store.chats import Message
from ui.chat_view import display, stats_line


def _msg(role: str, content: str, stats: dict | None = None, position: int = 0) -> Message:
    return Message(1, 1, position, role, content, stats, 0.0)


def test_stats_line_under_replies_only():
    stats = {"tokens_per_s": 12.34, "ttft_s": 0.25, "hit_rate": 0.875, "finish_reason": "cancelled"}
    assert stats_line(stats) == "12.3 tok/s · TTFT 250 ms · expert hit rate 88% · stopped"
    assert stats_line(None) == ""
    assert stats_line(stats | {"finish_reason": "length"}).endswith(
        "length limit reached (raise Max new tokens under Generation for longer replies)"
    )
    shown = display([_msg("system", "be brief"), _msg("user", "hi", stats), _msg("assistant", "hello", stats)])
    assert [m["role"] for m in shown] == ["user", "assistant"]  # the system prompt is not a bubble
    assert shown[0]["content"] == "hi"
    assert shown[1]["content"].startswith("hello\n\n<span class='reply-stats'>12.3 tok/s")


def test_a_failed_reply_shows_its_sentence_inline_and_keeps_the_partial_text(tmp_path):
    from types import SimpleNamespace

    from fmoe_local.config import Sampling
    from fmoe_local.runtime import Finished, TextDelta
    from fmoe_local.stats import RequestStats
    from store import open_store
    from ui.chat_flow import reply

    sentence = "Could not load expert 3 of MoE layer 1: disk error. Download the model again."

    class FailingRuntime:
        def stream(self, messages, sampling):
            yield TextDelta("The sea", 5)
            yield Finished("The sea", [5], RequestStats(finish_reason="error"), "error", error=sentence)

    store = open_store(tmp_path)
    try:
        conv = store.chats.create("sea")
        store.chats.append(conv.id, "user", "Tell me about the sea.")
        session = SimpleNamespace(store=store, runtime=FailingRuntime(), record=lambda stats: None)
        *_, shown = list(reply(session, conv.id, "", Sampling()))
        assert shown[-1] == {"role": "assistant", "content": f"⚠️ {sentence}"}  # a bubble, not an exception
        assert shown[-2]["content"].startswith("The sea")
        assert [m.content for m in store.chats.messages(conv.id)] == ["Tell me about the sea.", "The sea"]
    finally:
        store.close()


@pytest.fixture
def app(tmp_path):
    """The whole UI on a store with one conversation and no model loaded; `fn(api_name)` is an event's handler."""
    from fmoe_local.config import RuntimeConfig
    from store import open_store
    from ui import build
    from ui.session import Session

    store = open_store(tmp_path)
    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    conv = store.chats.create("about the sea")
    store.chats.append(conv.id, "user", "Tell me about the sea.")
    demo = build(session)

    def fn(api_name: str):
        return next(f for f in demo.fns.values() if f.api_name == api_name).fn

    yield session, conv, fn
    store.close()


def _notice_text(update) -> str:
    assert isinstance(update, gr.Markdown) or isinstance(update, dict), update
    value = update.value if isinstance(update, gr.Markdown) else update.get("value", "")
    return value or ""


def test_problems_are_a_sentence_in_the_chat_not_an_error_over_the_components(app):
    session, conv, fn = app
    *kept, said = next(fn("send")("   ", conv.id, "", 0.7, 0.9, 16))  # nothing typed
    assert "Type a message first." in _notice_text(said)
    assert all(k == gr.skip() for k in kept)  # the chat, its list and the input stay as they are
    *kept, said = next(fn("send")("Hello", conv.id, "", 0.7, 0.9, 16))  # no model loaded
    assert "No model is loaded yet" in _notice_text(said)
    assert [m.content for m in session.store.chats.messages(conv.id)] == ["Tell me about the sea."]
    session.store.chats.delete(conv.id)  # gone behind the page's back (another tab)
    _, said = fn("rename_chat")(conv.id, "ships")
    assert "no longer exists" in _notice_text(said)


def test_deleting_a_chat_asks_first_and_keep_it_deletes_nothing(app):
    session, conv, fn = app
    pending, delete, confirm, keep, said = fn("delete_chat")(conv.id)
    assert pending == conv.id and session.store.chats.get(conv.id)  # asked, not deleted
    assert confirm.value == "Yes, delete “about the sea”" and confirm.visible and keep.visible
    assert delete.visible is False
    conv_id, chatbot, _, _, pending, delete, confirm, _, _ = fn("confirm_delete_chat")(conv.id)
    assert (conv_id, chatbot, pending) == (None, [], None) and delete.visible
    assert session.store.chats.list() == []
