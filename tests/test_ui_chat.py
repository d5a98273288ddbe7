"""Chat display helpers: what the model sees stays the stored text; the stats line is display-only."""

from __future__ import annotations

from store.chats import Message
from ui.chat import display, stats_line


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
    from ui.chat import _generate

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
        *_, (shown, done) = list(_generate(session, conv.id, "", Sampling()))
        assert done
        assert shown[-1] == {"role": "assistant", "content": f"⚠️ {sentence}"}  # a bubble, not an exception
        assert shown[-2]["content"].startswith("The sea")
        assert [m.content for m in store.chats.messages(conv.id)] == ["Tell me about the sea.", "The sea"]
    finally:
        store.close()
