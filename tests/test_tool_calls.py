"""Tool calls read back from a reply's text (Hermes/Qwen format), whole and as it streams: a well-formed call
becomes a tool call, anything else stays content."""

from __future__ import annotations

import json

import pytest

from tests.tool_templates import HERMES_TEMPLATE
from ui.tool_calls import HERMES, CallStream, format_of

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_the_format_is_read_from_the_template():
    assert format_of(HERMES_TEMPLATE) is HERMES
    assert format_of("{% for m in messages %}{{ m.content }}{% endfor %}") is None and format_of(None) is None


def test_calls_and_the_text_before_them_are_parsed():
    content, calls = HERMES.parse(f"Let me look.\n{CALL}\n{CALL.replace('Oslo', 'Rome')}", TOOLS)
    assert content == "Let me look." and [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"]
    assert {c.name for c in calls} == {"weather"}


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',  # not one of the tools
        '<tool_call>\n{"name": "weather", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "weather", "arguments": {}}',  # never closed (cut by max_tokens)
        f"{CALL} and then some words",
        "no call at all",
    ],
)
def test_malformed_call_text_is_content_not_an_error(text):
    assert HERMES.parse(text, TOOLS) is None
    stream = CallStream(HERMES, TOOLS)
    sent = "".join(stream.add(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, calls = stream.finish()
    assert calls == [] and sent + rest == text


def test_streamed_text_is_sent_until_a_call_begins_and_the_call_at_the_end():
    stream = CallStream(HERMES, TOOLS)
    pieces = ["Sure", " <to", "ol_c", "all>\n", CALL[len("<tool_call>\n") :]]
    sent = [stream.add(p) for p in pieces]
    assert "".join(sent) == "Sure " and sent[1] == " "  # "<to" held: it may begin a call
    rest, calls = stream.finish()
    assert rest == "" and calls[0].name == "weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_text_held_as_a_possible_call_start_is_sent_once_it_cannot_be_one():
    stream = CallStream(HERMES, TOOLS)
    assert stream.add("a <to") == "a " and stream.add("p>") == "<top>"
