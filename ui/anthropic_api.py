"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, on the app's one port beside
the OpenAI API, so the Anthropic SDK and Claude Code (ANTHROPIC_BASE_URL) use the model this app has loaded.

Scope: the routes, translating to what the OpenAI API runs and back: the body becomes an ApiRequest
(anthropic_request.py), checked like an OpenAI chat request — tools against the model's template and a forced call
or a JSON reply turned into a grammar (structured.py), the prompt against the model (openai_api._check_prompt) —
then run, and written in Anthropic's shapes (anthropic_stream.py); every error in Anthropic's error shape
(anthropic_errors.py) with the OpenAI API's sentences. Who may call is decided before a request gets here, as for
/v1 (http_guard.py; the token, which Anthropic clients send as x-api-key: http_auth.py); a body over the limit
never gets here (body_limit.py). It does NOT hold model logic or store API chats in the user's chat list.

Threads: none of its own, as openai_api.py's requests: each request's handle is iterated on the event loop (a request
waiting its turn holds no thread) and cancelled when its client goes; `_submit` is the one place a request is handed
to the runtime.
"""

from __future__ import annotations

import asyncio
from collections import deque

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from fmoe_local.request_handle import RequestHandle
from ui.anthropic_request import parse_count, parse_messages
from ui.anthropic_stream import Head, complete, error_response, new_id, sse
from ui.loaded_runtime import LoadedRuntime
from ui.openai_api import _check_prompt, loaded_runtime
from ui.openai_request import ApiError, read_body
from ui.openai_stream import Streamed
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
            # The app's own sampling, as /v1/chat/completions: never a chat's values nor the Chat tab's defaults.
            req = parse_messages(body, session.config.sampling)
            shaped = await asyncio.to_thread(shape, runtime, req)
            length = await _check_prompt(runtime, req.prompt, shaped.tools, shaped.variables)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.headers)
        head = Head(new_id(), session.model_id, length or 0)
        parts = shaped.parts(req.stops)
        handle = _submit(runtime, req.prompt, shaped, router.finished)
        if req.stream:
            return Streamed(sse(handle, parts, head), handle)
        return await complete(handle, parts, head, request)

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


def _submit(runtime: LoadedRuntime, prompt: list[dict], shaped: Shaped, finished: deque) -> RequestHandle:
    """Hand the request to the runtime: the one place this API does."""
    handle = runtime.submit(prompt, shaped.sampling, **shaped.submit_options())
    # Recorded when the request ends, even after its client left (the worker runs this; a deque is thread-safe).
    handle.add_done_callback(lambda final: finished.append((final.reason, len(final.token_ids))))
    return handle
