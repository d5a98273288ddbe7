"""A reply in the Anthropic Messages API's shapes: one `message` body, or server-sent events — message_start, a
ping, per content block content_block_start / content_block_delta… / content_block_stop, then message_delta (the
stop reason and usage) and message_stop; a reply that fails ends with an `error` event instead.

Scope: content blocks from the reply's parts (reply_parts.py: thinking, text, and tool_use blocks, each call's
input sent whole as one input_json_delta once the reply has ended), the stop reason (end_turn, max_tokens,
stop_sequence with the sequence, tool_use, model_context_window_exceeded), usage, errors in Anthropic's shape
(anthropic_errors.py), and stopping the generation once its client has gone or a stop sequence has made the rest
useless. It does NOT parse requests (anthropic_request.py) or submit them (anthropic_api.py hands it the request's
handle, which it iterates on the event loop and cancels; a stream is sent by openai_stream.Streamed, which cancels
the handle when its client goes).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fmoe_local.request_handle import RequestHandle
from ui.anthropic_errors import error_body, error_type
from ui.openai_stream import failure_of, read_whole
from ui.reply_parts import REASONING, ReplyParts, merged
from ui.tool_calls import ToolCall

# The runtime's finish reasons in Anthropic's terms; a stop sequence or a tool call decides before these.
_STOP = {"stop": "end_turn", "length": "max_tokens", "context": "model_context_window_exceeded"}


@dataclass(frozen=True)
class Head:
    """What every shape of one reply starts with."""

    ident: str
    model: str
    input_tokens: int  # the prompt's length as checked before it was queued (message_start must say it first)

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {
            "id": self.ident,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _block(kind: str, text: str = "") -> dict:
    if kind == REASONING:
        return {"type": "thinking", "thinking": text, "signature": ""}  # nothing to sign: the text is the model's
    return {"type": "text", "text": text}


def _tool_use(call: ToolCall, whole: bool = True) -> dict:
    ident = f"toolu_{uuid.uuid4().hex[:24]}"
    return {"type": "tool_use", "id": ident, "name": call.name, "input": json.loads(call.arguments) if whole else {}}


def _stop(final, parts: ReplyParts, calls: list[ToolCall]) -> tuple[str, str | None]:  # noqa: ANN001
    if calls:
        return "tool_use", None
    if parts.stopped:
        return "stop_sequence", parts.matched
    return _STOP.get(final.reason, "end_turn"), None


def _usage(final) -> dict:  # noqa: ANN001 - a Finished
    """As Anthropic counts: input_tokens are the prompt tokens prefilled for this request, cache_read_input_tokens
    those a kept KV cache held (prefix_cache.py), so the two add up to the prompt."""
    cached = final.stats.cached_tokens
    return {
        "input_tokens": final.stats.prompt_tokens - cached,
        "cache_read_input_tokens": cached,
        "output_tokens": len(final.token_ids),
    }


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message), status_code=status, headers=headers, media_type="application/json")


async def complete(handle: RequestHandle, parts: ReplyParts, head: Head, request: Request) -> Response:
    """The whole reply as one `message` body, once it has ended; a client that goes away before that cancels it."""

    final, pieces = await read_whole(handle, parts, request)
    if failure := failure_of(final, parts):
        return error_response(500, failure)
    rest, calls = parts.finish()
    content = [_block(kind, text) for kind, text in merged(pieces + rest)]
    content += [_tool_use(call) for call in calls]
    return JSONResponse(head.message(content, *_stop(final, parts, calls), _usage(final)))


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name} | data)}\n\n"


class _Blocks:
    """The content blocks of a streamed reply: a piece of another kind than the open block's closes it and opens
    one of its own."""

    def __init__(self) -> None:
        self.index, self.kind = -1, None

    def piece(self, kind: str, text: str) -> list[str]:
        out = self.close() if kind != self.kind else []
        if kind != self.kind:
            self.index, self.kind = self.index + 1, kind
            out.append(_event("content_block_start", {"index": self.index, "content_block": _block(kind)}))
        delta = (
            {"type": "thinking_delta", "thinking": text} if kind == REASONING else {"type": "text_delta", "text": text}
        )
        out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def tool(self, call: ToolCall) -> list[str]:
        out = self.close()
        self.index += 1
        out.append(_event("content_block_start", {"index": self.index, "content_block": _tool_use(call, whole=False)}))
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        out.append(_event("content_block_stop", {"index": self.index}))
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]


async def sse(handle: RequestHandle, parts: ReplyParts, head: Head) -> AsyncIterator[str]:
    """The reply as server-sent events, each piece as soon as no stop sequence (or tool call) can still begin in
    it; tool calls at the end, one tool_use block each."""
    usage = {"input_tokens": head.input_tokens, "output_tokens": 0}
    yield _event("message_start", {"message": head.message([], None, None, usage)})
    yield _event("ping", {})
    blocks, final = _Blocks(), None
    async for event in handle:
        if hasattr(event, "reason"):
            final = event
            continue
        if parts.stopped:
            continue
        for kind, text in parts.add(event.text):
            for out in blocks.piece(kind, text):
                yield out
        if parts.stopped:
            handle.cancel()  # the rest would be thrown away: stop generating it
    if failure := failure_of(final, parts):
        yield _event("error", {"error": {"type": error_type(500), "message": failure}})
        return
    rest, calls = parts.finish()
    for kind, text in rest:
        for out in blocks.piece(kind, text):
            yield out
    for out in blocks.close():
        yield out
    for call in calls:
        for out in blocks.tool(call):
            yield out
    reason, sequence = _stop(final, parts, calls)
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": _usage(final)})
    yield _event("message_stop", {})
