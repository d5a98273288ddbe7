"""What the chat shows of a reasoning model's reply: its thinking folded above the answer, never in the answer."""

from __future__ import annotations

from store.chats import Message
from ui.chat_view import THINKING, bubble_messages, display, reply_bubbles, thought_of


def _msg(role: str, content: str, stats: dict | None = None, position: int = 0) -> Message:
    return Message(1, 1, position, role, content, stats, 0.0)


def test_a_stored_thought_is_a_folded_block_above_the_answer_and_not_in_it():
    stats = {"tokens_per_s": 3.0, "ttft_s": 0.5, "hit_rate": 0.5, "finish_reason": "stop"}
    reply = _msg("assistant", "<think>\nThe user greets me.\n</think>\n\nHello *there*.", stats, 1)
    shown = display([_msg("user", "hi"), reply])
    assert len(shown) == 3
    thought, answer = shown[1], shown[2]
    assert thought["metadata"] == {"title": THINKING, "status": "done"}  # Gradio draws "done" closed
    assert thought["content"] == "The user greets me."
    assert answer["content"].startswith("Hello *there*.\n\n<span class='reply-stats'>3.0 tok/s")
    assert "greets" not in answer["content"] and "think>" not in answer["content"]
    assert [m.role for m in bubble_messages([_msg("user", "hi"), reply])] == ["user", "assistant", "assistant"]


def test_replies_without_a_thought_and_user_messages_are_shown_as_they_are():
    shown = display([_msg("user", "<think>not a thought</think> hi"), _msg("assistant", "I <think> so.")])
    assert [m.get("metadata") for m in shown] == [None, None]
    assert shown[0]["content"].startswith("&lt;think>not a thought")  # the user's text, escaped, one bubble
    assert thought_of("I <think> so.") is None


def test_a_reply_cut_inside_its_thought_is_all_thinking():
    assert thought_of("<think>\nStill going") == ("Still going", "", True)
    stored = display([_msg("assistant", "<think>\nStill going", {"finish_reason": "length"})])
    assert stored[0]["content"] == "Still going" and stored[0]["metadata"]["title"] == THINKING
    assert stored[1]["content"].startswith("\n\n<span class='reply-stats'>")  # the stats line, no answer text


def test_while_writing_the_thought_says_so_and_a_half_written_marker_is_not_shown():
    assert reply_bubbles("<thi", writing=True) == [{"role": "assistant", "content": "…"}]
    streaming = reply_bubbles("<think>\nHmm, let me", writing=True)
    assert streaming == [
        {"role": "assistant", "content": "Hmm, let me", "metadata": {**streaming[0]["metadata"]}},
    ]
    assert streaming[0]["metadata"] == {"title": THINKING, "status": "done", "log": "still thinking…"}
    answered = reply_bubbles("<think>\nHmm.\n</think>\n\nYes", writing=True)
    assert [b.get("metadata", {}).get("log") for b in answered] == [None, None]
    assert answered[1]["content"] == "Yes"
