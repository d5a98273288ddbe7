"""A budget on every request body: a body larger than any prompt could need is refused (413) before it is read.

Scope: one ASGI middleware around the whole server (inside the HTTP guard, so a refused caller's body is never
read at all) and the limit it enforces. It does NOT parse bodies (ui/openai_request.py reads /v1's) or limit what
Gradio's upload route keeps (server.MAX_UPLOAD, smaller).

Why before reading: FastAPI and Gradio read a whole body into memory, then parse it, then the runtime tokenizes
the text in it. A 25 MB body took 22.7 s to refuse as too long for the model, grew the app by 3 GB and stalled
every other request meanwhile. Here a declared Content-Length over the limit is answered at once, without
reading a byte (uvicorn discards the rest, so the client still reads the answer); a body sent without one
(chunked) is counted as it arrives and refused as soon as it passes the limit; only a body within the limit is
handed on, whole. Waiting for a body is an await, so a slow sender holds up no other request.
"""

from __future__ import annotations

from starlette.responses import PlainTextResponse, Response

from ui.anthropic_errors import error_body, is_messages
from ui.http_guard import API_PREFIX
from ui.openai_request import ApiError

# The longest context of a model this app runs is 1,048,576 tokens (Qwen3-MoE checkpoints extended with YaRN;
# DeepSeek-V3 reads 163,840, GPT-OSS 131,072, Mixtral 32,768). A token of text is a few bytes, and at most about
# 16 in a JSON body: escaped non-ASCII text takes 6 bytes per character (`\u00e9`), an emoji 12, and a token is
# one or a few characters. So no request for any context the app can serve needs more than 16 MiB; a body over
# that is refused however it arrives.
MAX_BODY_BYTES = 16 * 1024 * 1024
TOO_LARGE = (
    "This request's body is larger than {limit} MB, more than the longest context of any model this app runs "
    "could read. Send a shorter conversation."
)


class BodyLimit:
    """ASGI middleware: answers 413 with a sentence (in OpenAI's error shape under /v1/, Anthropic's under
    /v1/messages) when a request's body is over `limit` bytes; otherwise hands the app the body it read, then the
    connection's later events as they come (a client that goes away is still seen)."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES) -> None:  # noqa: ANN001 - an ASGI app
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - the ASGI signature
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)  # nothing read: the body's bytes are never in memory
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before its body was whole
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                chunks.clear()
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, handed = b"".join(chunks), False
        del chunks

        async def replay() -> dict:
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        message = TOO_LARGE.format(limit=self.limit // (1024 * 1024))
        path = scope.get("path", "")
        if is_messages(path):
            answer = Response(error_body(413, message), status_code=413, media_type="application/json")
        elif path.startswith(API_PREFIX):
            answer = ApiError(413, message, code="request_too_large").response()
        else:
            answer = PlainTextResponse(message, status_code=413)
        await answer(scope, receive, send)
