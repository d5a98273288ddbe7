"""A client that goes away cancels its request's handle while the reply waits for its next token (not only when a
later send fails), streamed or not: the model stops within a token of the disconnect."""

from __future__ import annotations

import asyncio

from fmoe_local.request_handle import RequestHandle
from fmoe_local.runtime_types import Finished, TextDelta
from fmoe_local.stats import RequestStats
from ui.openai_stream import Shape, Streamed, complete, sse
from ui.reply_parts import ReplyParts

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/v1/chat/completions"}


def _running() -> RequestHandle:
    """A request that has written one word and produces no other: only a cancel ends it (its worker sees the stop
    flag at its next token and ends it, as the runtime's does)."""

    def worker_sees_the_stop(handle: RequestHandle) -> None:
        handle.finish(Finished("Once", [1], RequestStats(finish_reason="cancelled"), "cancelled"))

    handle = RequestHandle(on_cancel=worker_sees_the_stop)
    handle.claim()
    handle.publish(TextDelta("Once", 1))
    return handle


def test_a_streamed_reply_s_client_gone_mid_reply_cancels_it():
    handle = _running()
    sent: list[dict] = []

    async def main() -> None:
        gone = asyncio.Event()

        async def send(message: dict) -> None:
            sent.append(message)
            if b"Once" in message.get("body", b""):
                gone.set()  # the client read the first word and went away

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        response = Streamed(sse(handle, ReplyParts([]), Shape("chatcmpl-1", 0, "m"), False), handle)
        await asyncio.wait_for(response(SCOPE, receive, send), 10)  # before: waited for a token that never came

    asyncio.run(main())
    assert handle.cancelled and handle.result(timeout=0).reason == "cancelled"
    assert any(b"Once" in m.get("body", b"") for m in sent)


def test_a_plain_reply_s_client_gone_cancels_it():
    from starlette.requests import Request

    handle = _running()

    async def main() -> None:
        async def receive() -> dict:
            return {"type": "http.disconnect"}

        request = Request(SCOPE, receive)
        await asyncio.wait_for(complete(handle, ReplyParts([]), Shape("chatcmpl-1", 0, "m"), request), 10)

    asyncio.run(main())
    assert handle.cancelled and handle.result(timeout=0).reason == "cancelled"
