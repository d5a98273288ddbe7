"""One request through an ASGI middleware stack, without a server: the stack wraps an app that answers 200 "ok" (and
accepts a WebSocket), so a test sees what the middleware answered and whether the request got through."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def call(
    wrap: Callable[[object], object],
    method: str,
    target: str,
    headers: dict,
    client: tuple[str, int] | None = None,
    kind: str = "http",
) -> tuple[list[dict], bool]:
    """`wrap(app)` → the stack to test; returns (every message it sent, whether the app was reached)."""
    reached = []

    async def app(scope, receive, send):  # noqa: ANN001, ANN202
        reached.append(scope["path"])
        if scope["type"] == "websocket":
            await send({"type": "websocket.accept"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[dict] = []

    async def send(message):  # noqa: ANN001, ANN202
        sent.append(message)

    async def receive():  # noqa: ANN202
        return {"type": "http.request", "body": b"", "more_body": False}

    path, _, query = target.partition("?")
    scope = {
        "type": kind,
        "method": method,
        "path": path,
        "query_string": query.encode(),
        "client": client,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(wrap(app)(scope, receive, send))
    return sent, bool(reached)


def response(sent: list[dict]) -> tuple[int, dict[str, str]]:
    """(status, headers with the body under "body") of an HTTP answer `call` recorded."""
    start, body = sent[0], sent[1]["body"].decode()
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]} | {"body": body}
