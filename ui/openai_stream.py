"""A reply in OpenAI's shapes: one JSON body, or server-sent events ending with `data: [DONE]`, for a chat
(`chat.completion`, each chunk a `delta`) or a text completion (`text_completion`, each chunk a piece of `text`).

Scope: the text cut at the first stop sequence (`Generation`), the model's thought apart from its content
(`reasoning_content`, as DeepSeek's and vLLM's servers send it) and its tool calls (both read by reply_parts.py),
the finish reason, usage, the error a failed or interrupted request ends with, and stopping the generation once its
client has gone or a stop sequence has made the rest useless. It does NOT parse requests (openai_request.py) or
submit requests (openai_api.py hands it the request's handle, which it iterates on the event loop and cancels).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from fmoe_local.request_handle import RequestHandle
from ui.openai_request import ApiError
from ui.reasoning import REASONING

if TYPE_CHECKING:
    from ui.reply_parts import ReplyParts  # which imports Generation from here

# A reply cut by the model's context is "length" in OpenAI's terms: it ended at a token limit, not on its own.
_FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}
# A request ended by someone other than its client (a model unloaded under it): not a complete reply.
INTERRUPTED = "The reply was interrupted because the model was unloaded or reloaded in the app. Send the request again."


class Generation:
    """One request's text as it streams, cut at the first stop sequence (text that may still become one is held
    back until it cannot)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.text, self.sent, self.stopped = stops, "", 0, False
        self.matched: str | None = None  # the stop sequence the text was cut at (Anthropic's stop_sequence)
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, delta: str) -> str:
        """New text that may be sent now."""
        self.text += delta
        found = [(at, s) for s in self.stops if (at := self.text.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])
            self.text, self.stopped = self.text[:cut], True
            return self.flush()
        safe = len(self.text) - self.hold
        out, self.sent = self.text[self.sent : max(safe, self.sent)], max(safe, self.sent)
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


@dataclass(frozen=True)
class Shape:
    """What the reply looks like: a chat's message, or (`text=True`) a completion's text, which with `echo`
    starts with the prompt."""

    ident: str
    created: int
    model: str
    text: bool = False
    echo: str = ""

    def body(self, choices: list[dict], chunk: bool = False) -> dict:
        kind = "text_completion" if self.text else ("chat.completion.chunk" if chunk else "chat.completion")
        return {"id": self.ident, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def choice(self, content: str, reason: str | None, chunk: bool = False) -> dict:
        if self.text:
            part = {"text": content}
        elif chunk:
            part = {"delta": {"content": content} if content or reason is None else {}}
        else:
            part = {"message": {"role": "assistant", "content": content}}
        return {"index": 0, **part, "finish_reason": reason, "logprobs": None}

    def opening(self) -> list[dict]:
        """The chunks a stream starts with, before any generated text."""
        if self.text:
            return [self.choice(self.echo, None, chunk=True)] if self.echo else []
        return [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}]


def usage(final) -> dict:  # noqa: ANN001 - a Finished
    prompt, completion = final.stats.prompt_tokens, len(final.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # As OpenAI reports it: the prompt tokens a kept KV cache held, not prefilled again (prefix_cache.py).
        "prompt_tokens_details": {"cached_tokens": final.stats.cached_tokens},
    }


def _reason(final, parts: ReplyParts) -> str:  # noqa: ANN001 - a Finished
    return "stop" if parts.stopped else _FINISH.get(final.reason, "stop")


def failure_of(final, parts: ReplyParts) -> str:  # noqa: ANN001 - a Finished
    """The sentence a request that did not complete ends with; "" when it completed."""
    if final.reason == "error":
        return final.error
    return INTERRUPTED if final.reason == "cancelled" and not parts.stopped else ""


def _joined(pieces: list) -> tuple[str, str]:
    """(reasoning, content) of a reply's pieces (reply_parts.py)."""
    reasoning = "".join(text for kind, text in pieces if kind == REASONING)
    return reasoning, "".join(text for kind, text in pieces if kind != REASONING)


async def disconnected(receive) -> None:  # noqa: ANN001 - the ASGI receive
    """Returns when the client has gone away. The request's body has been read, so each receive waits for the next
    connection event: no poll."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def read_whole(handle: RequestHandle, parts: ReplyParts, request: Request) -> tuple[object, list]:
    """(the final Finished, the reply's pieces) of a reply read to its end, for an answer sent as one body (OpenAI's
    and Anthropic's alike): a client that goes away, or a stop sequence found, cancels it."""

    async def watch() -> None:
        await disconnected(request.receive)
        handle.cancel()

    watcher = asyncio.create_task(watch())
    final, pieces = None, []
    try:
        async for event in handle:
            if hasattr(event, "reason"):
                final = event
            elif not parts.stopped:
                pieces += parts.add(event.text)
                if parts.stopped:
                    handle.cancel()  # the rest would be thrown away: stop generating it
    finally:
        watcher.cancel()
        handle.cancel()  # no-op once ended; a cancelled await (the server stopping) must not leave it running
    return final, pieces


async def complete(handle: RequestHandle, parts: ReplyParts, shape: Shape, request: Request) -> JSONResponse:
    """The whole reply as one body, once it has ended; a client that goes away before that cancels it. The model's
    thought comes as `reasoning_content` when it has one, its tool calls as `tool_calls` (`parts`: the reply's
    reader, structured.Shaped.parts)."""

    final, pieces = await read_whole(handle, parts, request)
    if failure := failure_of(final, parts):
        return ApiError(500, failure).response()
    rest, found = parts.finish()
    reasoning, content = _joined(pieces + rest)
    choice = shape.choice(shape.echo + content, "tool_calls" if found else _reason(final, parts))
    if found:
        choice["message"] |= {"content": content or None, "tool_calls": [c.openai(i) for i, c in enumerate(found)]}
    if reasoning:
        choice["message"]["reasoning_content"] = reasoning
    return JSONResponse(shape.body([choice]) | {"usage": usage(final)})


async def sse(handle: RequestHandle, parts: ReplyParts, shape: Shape, include_usage: bool) -> AsyncIterator[str]:
    """The reply as server-sent events, each piece of text as soon as no stop sequence can still begin in it: the
    model's thought as `delta.reasoning_content`, the rest as `delta.content`. Text from a tool call's start on is
    held and sent at the end as `delta.tool_calls` (one chunk per call, its arguments whole), or as content when it
    is not a well-formed call."""

    def chunk(choices: list[dict], **extra: object) -> str:
        return f"data: {json.dumps(shape.body(choices, chunk=True) | extra)}\n\n"

    def piece(kind: str, text: str) -> str:
        if kind != REASONING:
            return chunk([shape.choice(text, None, chunk=True)])
        delta = {"reasoning_content": text}
        return chunk([{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}])

    for opening in shape.opening():
        yield chunk([opening])
    final = None
    async for event in handle:
        if hasattr(event, "reason"):
            final = event
            continue
        if parts.stopped:
            continue
        pieces = parts.add(event.text)
        if parts.stopped:
            handle.cancel()  # the rest would be thrown away: stop generating it
        for kind, text in pieces:
            yield piece(kind, text)
    if failure := failure_of(final, parts):
        yield f"data: {json.dumps({'error': {'message': failure, 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"
        return
    rest, found = parts.finish()
    for kind, text in rest:
        yield piece(kind, text)
    for i, call in enumerate(found):
        yield chunk([{"index": 0, "delta": {"tool_calls": [call.openai(i)]}, "finish_reason": None, "logprobs": None}])
    yield chunk([shape.choice("", "tool_calls" if found else _reason(final, parts), chunk=True)])
    if include_usage:
        yield chunk([], usage=usage(final))
    yield "data: [DONE]\n\n"


class Streamed(StreamingResponse):
    """The SSE chunks of one request, which is cancelled however the response ends: its client went away (noticed
    while the reply waits for its next token, not only when a send fails), a send failed, or it ended."""

    def __init__(self, chunks: AsyncIterator[str], handle: RequestHandle) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - the ASGI signature
        async def watch() -> None:
            await disconnected(receive)
            self.handle.cancel()  # within a token; the chunks then end and the stream with them

        watcher = asyncio.create_task(watch())
        try:
            await self.stream_response(send)
        except OSError as exc:  # a send to a client that has gone (ASGI 2.4 servers say so this way)
            raise ClientDisconnect from exc
        finally:
            watcher.cancel()
            self.handle.cancel()
            await self.body_iterator.aclose()
