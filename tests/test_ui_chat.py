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
    shown = display([_msg("system", "be brief"), _msg("user", "hi", stats), _msg("assistant", "hello", stats)])
    assert [m["role"] for m in shown] == ["user", "assistant"]  # the system prompt is not a bubble
    assert shown[0]["content"] == "hi"
    assert shown[1]["content"].startswith("hello\n\n<span class='reply-stats'>12.3 tok/s")
