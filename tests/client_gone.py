"""A client that goes away while its reply waits for a token that never comes: what both APIs' disconnect tests
(tests/test_ui_openai_stream.py, tests/test_ui_anthropic_stream.py) drive their replies against."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fmoe_local.request_handle import RequestHandle
from fmoe_local.runtime_types import Finished, TextDelta
from fmoe_local.stats import RequestStats


def running() -> RequestHandle:
    """A request that has written one word and produces no other: only a cancel ends it (its worker sees the stop
    flag at its next token and ends it, as the runtime's does)."""

    def worker_sees_the_stop(handle: RequestHandle) -> None:
        handle.finish(Finished("Once", [1], RequestStats(finish_reason="cancelled"), "cancelled"))

    handle = RequestHandle(on_cancel=worker_sees_the_stop)
    handle.claim()
    handle.publish(TextDelta("Once", 1))
    return handle


def stream_until_the_client_goes(response: Callable[[], Callable], scope: dict) -> list[dict]:
    """Serve the ASGI `response()` (made inside the event loop) to a client that reads the first word and goes
    away; returns what was sent. Bounded: 10 s (without the disconnect watch it would wait for a token forever)."""
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

        await asyncio.wait_for(response()(scope, receive, send), 10)

    asyncio.run(main())
    return sent


def complete_for_a_gone_client(reply: Callable[[object], Awaitable[object]], scope: dict) -> None:
    """Await a whole (not streamed) `reply(request)` for a request whose client has already gone. Bounded: 10 s."""
    from starlette.requests import Request

    async def main() -> None:
        async def receive() -> dict:
            return {"type": "http.disconnect"}

        await asyncio.wait_for(reply(Request(scope, receive)), 10)

    asyncio.run(main())
