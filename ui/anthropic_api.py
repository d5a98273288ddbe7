"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, on the app's one port beside
the OpenAI API, so the Anthropic SDK and Claude Code (ANTHROPIC_BASE_URL) use the model this app has loaded.

Scope: the routes, translating to what the OpenAI API runs and back: the body becomes an ApiRequest
(anthropic_request.py), checked like an OpenAI chat request — tools against the model's template and a forced call
or a JSON reply turned into a grammar (structured.py), the prompt against the model (openai_api._check_prompt) —
then run, and written in Anthropic's shapes (anthropic_stream.py); every error in Anthropic's error shape
(anthropic_errors.py) with the OpenAI API's sentences. Who may call is decided before a request gets here, as for
/v1 (http_guard.py; the token, which Anthropic clients send as x-api-key: http_auth.py); a body over the limit
never gets here (body_limit.py). It does NOT hold model logic or store API chats in the user's chat list.

Threads: as openai_api.py's requests (each runs on a pump thread of its own, which posts its events into the event
loop); `_submit` is the one place a request is handed to the runtime.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fmoe_local.config import Sampling
from ui.anthropic_request import parse_count, parse_messages
from ui.anthropic_stream import Head, complete, error_response, new_id, sse, watch
from ui.openai_api import _check_prompt, _events, loaded_runtime
from ui.openai_request import ApiError, read_body
from ui.session import Session
from ui.structured import Shaped, shape

ROUTES = ("POST /v1/messages", "POST /v1/messages/count_tokens")


def build_router(session: Session) -> APIRouter:
    """The routes without their /v1 prefix: openai_api.build_router serves them under its own, before its answer
    to every other /v1 path."""
    router = APIRouter()
    router.finished = deque(maxlen=32)  # (finish reason, tokens) of recent requests: for tests and debugging

    @router.post("/messages")
    async def messages(request: Request) -> Response:
        try:
            body = await asyncio.to_thread(read_body, await request.body())
            runtime = loaded_runtime(session)
            settings = session.store.settings.load()
            defaults = Sampling(temperature=settings.temperature, top_p=settings.top_p)
            req = parse_messages(body, defaults)
            shaped = await asyncio.to_thread(shape, runtime, req)
            length = await _check_prompt(runtime, req.prompt, shaped.tools)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.headers)
        head = Head(new_id(), session.model_id, length or 0)
        parts = shaped.parts(req.stops)
        running = _submit(runtime, req.prompt, shaped, router.finished)
        if req.stream:
            return StreamingResponse(watch(sse(running, parts, head), request, running), media_type="text/event-stream")
        return await complete(running, parts, head, request)

    @router.post("/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """The prompt's length in tokens as the model reads it (its chat template, the tools shown), without
        running it: {"input_tokens": N}."""
        try:
            body = await asyncio.to_thread(read_body, await request.body())
            runtime = loaded_runtime(session)
            prompt, tools = parse_count(body)
            length = await _check_prompt(runtime, prompt, tools)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.headers)
        if length is None:
            return error_response(500, "The prompt could not be counted: its tokenizer failed. Send it again.")
        return JSONResponse({"input_tokens": length})

    return router


class _Running:
    """A request running on the runtime, as its caller sees it: `async for` its events (TextDelta…, then one
    Finished), `cancel()` to end it (within a token, or at once while it waits for its turn)."""

    def __init__(self, events, stop: threading.Event) -> None:  # noqa: ANN001 - openai_api._Events
        self.events, self.stop = events, stop

    def cancel(self) -> None:
        self.stop.set()

    async def __aiter__(self) -> AsyncIterator:
        while (event := await self.events.next()) is not None:
            yield event


def _submit(runtime, prompt: list[dict], shaped: Shaped, finished: deque) -> _Running:  # noqa: ANN001 - a Runtime
    """Hand the request to the runtime: the one place this API does (openai_api's pump thread, today)."""
    stop = threading.Event()
    return _Running(_events(runtime, prompt, shaped.sampling, stop, finished, shaped.tools), stop)
