"""A reply written in the Anthropic Messages API's shapes (ui/anthropic_stream.py), from scripted runtime events: the
event sequence of a stream, content blocks, stop reasons and usage, and the error a failed reply ends with."""

from __future__ import annotations

import asyncio
import json

from fmoe_local.runtime_types import Finished, TextDelta
from fmoe_local.stats import RequestStats
from tests.client_gone import complete_for_a_gone_client, running, stream_until_the_client_goes
from ui.anthropic_stream import Head, complete, sse
from ui.openai_stream import Streamed
from ui.reply_parts import ReplyParts
from ui.tool_calls import HERMES, CallStream

HEAD = Head("msg_1", "tiny", 9)
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


class Scripted:
    """A running reply that yields `pieces` as TextDelta events, then a Finished with `reason`."""

    def __init__(self, pieces: list[str], reason: str = "stop", error: str = "", cached: int = 0) -> None:
        self.pieces, self.reason, self.error, self.cached = pieces, reason, error, cached
        self.cancelled = self.ended = False

    def cancel(self) -> None:
        self.cancelled |= not self.ended  # as RequestHandle.cancel: nothing once the reply has ended

    async def __aiter__(self):
        for i, text in enumerate(self.pieces):
            yield TextDelta(text, i)
        self.ended = True
        stats = RequestStats(prompt_tokens=9, cached_tokens=self.cached)
        yield Finished("".join(self.pieces), list(range(len(self.pieces))), stats, self.reason, self.error)


class Connected:
    """A request whose client stays: its next connection event never comes."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()


def _streamed(running: Scripted, parts: ReplyParts) -> list[tuple[str, dict]]:
    async def run() -> list[str]:
        return [e async for e in sse(running, parts, HEAD)]

    out = []
    for event in asyncio.run(run()):
        name, data = event.removesuffix("\n\n").split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert name == f"event: {body['type']}"
        out.append((body["type"], body))
    return out


def _whole(running: Scripted, parts: ReplyParts) -> tuple[int, dict]:
    response = asyncio.run(complete(running, parts, HEAD, Connected()))
    return response.status_code, json.loads(response.body)


def test_a_streamed_reply_is_anthropic_s_event_sequence():
    events = _streamed(Scripted(["Hel", "lo", "!"], "length"), ReplyParts([]))
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start",
        "content_block_delta", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    start = events[0][1]["message"]
    assert (
        start["content"] == []
        and start["stop_reason"] is None
        and start["usage"] == {"input_tokens": 9, "output_tokens": 0}
    )
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(body["delta"]["text"] for name, body in events if name == "content_block_delta") == "Hello!"
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 9, "cache_read_input_tokens": 0, "output_tokens": 3}


def test_a_stop_sequence_cuts_the_reply_and_is_named():
    running = Scripted(["one ", "two", " STOP", " three"])
    status, body = _whole(running, ReplyParts(["STOP", "never"]))
    assert status == 200 and running.cancelled  # the rest would be thrown away: not generated
    assert body["content"] == [{"type": "text", "text": "one two "}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "STOP")
    events = _streamed(Scripted(["one ", "two", " STOP", " three"]), ReplyParts(["STOP"]))
    assert "".join(b["delta"]["text"] for n, b in events if n == "content_block_delta") == "one two "
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}


def test_tool_calls_are_tool_use_blocks_after_the_text():
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    pieces = ["Let me check.", "\n", call[:12], call[12:]]
    status, body = _whole(Scripted(pieces), ReplyParts([], calls=CallStream(HERMES, [WEATHER])))
    assert status == 200 and body["stop_reason"] == "tool_use"
    text, use = body["content"]
    assert text == {"type": "text", "text": "Let me check.\n"}  # as the OpenAI API sends it
    assert use["type"] == "tool_use" and use["name"] == "weather" and use["input"] == {"city": "Oslo"}
    assert use["id"].startswith("toolu_")
    events = _streamed(Scripted(pieces), ReplyParts([], calls=CallStream(HERMES, [WEATHER])))
    starts = [b["content_block"] for n, b in events if n == "content_block_start"]
    assert [s["type"] for s in starts] == ["text", "tool_use"] and starts[1]["input"] == {}
    deltas = [b["delta"] for n, b in events if n == "content_block_delta" and b["index"] == 1]
    assert [d["type"] for d in deltas] == ["input_json_delta"] and json.loads(deltas[0]["partial_json"]) == {
        "city": "Oslo"
    }
    assert [b["index"] for n, b in events if n == "content_block_stop"] == [0, 1]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_malformed_call_text_is_text():
    pieces = ["<tool_call>\n{not json}\n</tool_call>"]
    status, body = _whole(Scripted(pieces), ReplyParts([], calls=CallStream(HERMES, [WEATHER])))
    assert status == 200 and body["stop_reason"] == "end_turn"
    assert body["content"] == [{"type": "text", "text": pieces[0]}]


def test_a_failed_reply_ends_with_an_error_in_anthropic_s_shape():
    status, body = _whole(Scripted(["par"], "error", "The model failed. Send it again."), ReplyParts([]))
    assert status == 500
    assert body == {"type": "error", "error": {"type": "api_error", "message": "The model failed. Send it again."}}
    events = _streamed(Scripted(["par"], "error", "The model failed. Send it again."), ReplyParts([]))
    assert events[-1] == ("error", body)  # no message_stop: the reply did not complete
    assert "message_stop" not in [name for name, _ in events]


def test_a_thought_is_a_thinking_block_before_the_text():
    from ui.reasoning import THINK, ThinkSplit

    pieces = ["<think>\nHm", "m.\n</th", "ink>\n\nHi!"]
    status, body = _whole(Scripted(pieces), ReplyParts([], ThinkSplit(THINK)))
    assert status == 200
    assert body["content"] == [
        {"type": "thinking", "thinking": "Hmm.", "signature": ""},
        {"type": "text", "text": "Hi!"},
    ]
    events = _streamed(Scripted(pieces), ReplyParts([], ThinkSplit(THINK)))
    starts = [b["content_block"]["type"] for n, b in events if n == "content_block_start"]
    deltas = [(b["index"], b["delta"]) for n, b in events if n == "content_block_delta"]
    assert starts == ["thinking", "text"] and [b["index"] for n, b in events if n == "content_block_stop"] == [0, 1]
    assert "".join(d["thinking"] for i, d in deltas if i == 0 and d["type"] == "thinking_delta") == "Hmm."
    assert "".join(d["text"] for i, d in deltas if i == 1 and d["type"] == "text_delta") == "Hi!"


def test_usage_counts_the_prompt_tokens_a_kept_cache_held_apart():
    """As Anthropic counts: input_tokens are those prefilled, cache_read_input_tokens those the kept KV cache held."""
    status, body = _whole(Scripted(["Hi"], cached=7), ReplyParts([]))
    assert status == 200 and body["usage"] == {"input_tokens": 2, "cache_read_input_tokens": 7, "output_tokens": 1}
    events = _streamed(Scripted(["Hi"], cached=7), ReplyParts([]))
    assert events[-2][1]["usage"] == {"input_tokens": 2, "cache_read_input_tokens": 7, "output_tokens": 1}


SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/v1/messages"}


def test_a_streamed_reply_s_client_gone_mid_reply_cancels_it():
    handle = running()
    sent = stream_until_the_client_goes(lambda: Streamed(sse(handle, ReplyParts([]), HEAD), handle), SCOPE)
    assert handle.cancelled and handle.result(timeout=0).reason == "cancelled"
    assert any(b"Once" in m.get("body", b"") for m in sent)


def test_a_plain_reply_s_client_gone_cancels_it():
    handle = running()
    complete_for_a_gone_client(lambda req: complete(handle, ReplyParts([]), HEAD, req), SCOPE)
    assert handle.cancelled and handle.result(timeout=0).reason == "cancelled"
