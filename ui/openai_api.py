"""The OpenAI-compatible API under /v1: how editors, Open WebUI and scripts use the model this app has loaded.

Scope: `GET /v1/models` and `POST /v1/chat/completions` (plain, and `stream: true` as server-sent events ending
with `data: [DONE]`, with `stream_options.include_usage`), translating to `Runtime.stream` and back: max_tokens,
temperature (0 = greedy) and top_p (left out: the app's Settings values), seed, stop, finish_reason, usage, errors
in OpenAI's shape (the body is parsed and checked in openai_request.py). Any bearer token is accepted (a local app
has one user; the HTTP guard decides who may call at all), and so is any `model` in a request: the loaded model
answers, listed under its short id (`Session.model_id`, "demo" for the built-in one). It does NOT hold model
logic, queue requests itself (the runtime's worker runs one request at a time; others wait in its queue) or store
API chats in the user's chat list.

Threads: each request's runtime stream is consumed on a pump thread of its own (the runtime blocks), which posts
the events into the event loop (`_Events`): a request waiting its turn holds no executor thread, so any number of
them cannot freeze the reply being generated. A client that goes away sets that request's own stop flag, which
ends it within a token or at once if it is still queued.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from fmoe_local.config import Sampling
from ui.openai_request import ApiError, parse_chat
from ui.session import Session

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}
# A request ended by someone other than its client (a model unloaded under it): not a complete reply.
INTERRUPTED = "The reply was interrupted because the model was unloaded or reloaded in the app. Send the request again."
LOST = "The request's worker thread ended without an answer. Send the request again."
ROUTES = ("GET /v1/models", "POST /v1/chat/completions")  # what /v1 serves; any other request: a 404 naming them
RETRY_AFTER_S = 5  # what a 503 during a model load asks a client to wait before it asks again
_POLL_S = 0.2  # how often a non-streaming request checks that its client is still there (and a wait, its pump)


class _Generation:
    """One request's text as it streams, cut at the first stop sequence (text that may still become one is held
    back until it cannot)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.text, self.sent, self.stopped = stops, "", 0, False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, delta: str) -> str:
        """New text that may be sent now."""
        self.text += delta
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self.flush()
        safe = len(self.text) - self.hold
        out, self.sent = self.text[self.sent : max(safe, self.sent)], max(safe, self.sent)
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


def build_router(session: Session) -> APIRouter:
    router = APIRouter(prefix="/v1")
    router.finished = deque(maxlen=32)  # (finish reason, tokens) of recent API requests: for tests and debugging

    def runtime_or_error():
        if session.runtime is None:
            if session.still_loading:  # worth asking again soon: clients that honour Retry-After wait, then retry
                raise ApiError(503, session.still_loading, headers={"Retry-After": str(RETRY_AFTER_S)})
            raise ApiError(503, session.load_error or "No model is loaded. Load one in the app's Models tab.")
        return session.runtime

    def model_id() -> str:
        return session.model_id

    @router.get("/models")
    def models() -> dict:
        data = []
        if session.runtime is not None:
            data.append({"id": model_id(), "object": "model", "created": 0, "owned_by": "fmoe-local"})
        return {"object": "list", "data": data}

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        try:
            try:
                body = await request.json()
            except ValueError as exc:
                raise ApiError(400, "The request body must be JSON.") from exc
            if not isinstance(body, dict):
                raise ApiError(400, "The request body must be a JSON object.")
            runtime = runtime_or_error()
            settings = session.store.settings.load()
            defaults = Sampling(
                max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p
            )
            chat = parse_chat(body, defaults)
            await _check_prompt(runtime, chat.messages)
        except ApiError as exc:
            return exc.response()
        stop = threading.Event()
        ident, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        events = _events(runtime, chat.messages, chat.sampling, stop, router.finished)
        if chat.stream:
            chunks = _sse(events, _Generation(chat.stops), ident, created, model_id(), chat.include_usage, stop)
            return StreamingResponse(_watch(chunks, request, stop), media_type="text/event-stream")
        return await _complete(events, _Generation(chat.stops), ident, created, model_id(), request, stop)

    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def elsewhere(path: str, request: Request) -> JSONResponse:
        """Any other /v1 path, or a served one with another method: an OpenAI-shaped error naming what is served
        (instead of FastAPI's {"detail": "Not Found"}, which clients show as an unexplained failure)."""
        known = any(route.split()[1] == f"/v1/{path}" for route in ROUTES)
        message = f"{request.method} /v1/{path} is not served here: this app serves {' and '.join(ROUTES)}."
        return ApiError(405 if known else 404, message).response()

    return router


async def _check_prompt(runtime, messages: list[dict]) -> None:  # noqa: ANN001
    """A prompt the model cannot take (too long, or refused by its chat template) is the request's fault: a 400
    that the client does not retry, told before a stream's 200 is sent, not a 500 or an error event after it."""
    from fmoe_local.engine import ContextTooLong, PromptRefused

    try:
        await asyncio.to_thread(runtime.check, messages)  # tokenizing takes milliseconds; no turn is awaited
    except PromptRefused as exc:
        code = "context_length_exceeded" if isinstance(exc, ContextTooLong) else None
        raise ApiError(400, str(exc), "messages", code) from exc


def _events(runtime, messages: list[dict], sampling: Sampling, stop: threading.Event, finished: deque) -> _Events:  # noqa: ANN001
    """Run the request on a pump thread that always reads the runtime's stream to its end (so its finish is
    recorded even after the client left) and posts each event to the async side. None marks the end."""
    events = _Events(asyncio.get_running_loop())

    def pump() -> None:
        final = None
        try:
            for event in runtime.stream(messages, sampling, stop=stop):
                final = event
                events.post(event)
        except Exception as exc:  # noqa: BLE001 - the client gets the sentence instead of a bare 500 or a cut stream
            from fmoe_local.runtime_types import Finished

            final = Finished.failed(str(exc))
            events.post(final)
        finally:
            if final is not None and hasattr(final, "reason"):
                finished.append((final.reason, len(final.token_ids)))
            events.post(None)

    events.thread = threading.Thread(target=pump, name="fmoe-api-request", daemon=True)
    events.thread.start()
    return events


class _Events:
    """One request's events, from its pump thread to the async side through the event loop (call_soon_threadsafe
    into an asyncio.Queue): a request waiting for its turn holds no thread of the loop's executor, so however many
    wait, the one generating keeps streaming (with asyncio.to_thread, each waiting request held one of the
    executor's few threads and the running reply froze once they were all taken)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.queue, self.thread, self.ended = loop, asyncio.Queue(), None, False

    def post(self, item: object) -> None:
        """Called on the pump thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed (the server stopped): nobody reads these any more
            pass

    async def next(self):  # noqa: ANN201 - a TextDelta, a Finished, or None at the end
        """The next event. Bounded: every runtime wait is (Runtime._wait), the pump always posts None at its end,
        and a pump thread that ended without it anyway is noticed within _POLL_S and ends the request with an
        error rather than a wait for ever."""
        while True:
            if not self.queue.empty():
                return self.queue.get_nowait()
            try:
                return await asyncio.wait_for(self.queue.get(), _POLL_S)
            except asyncio.TimeoutError:
                if self.thread.is_alive():
                    continue
                await asyncio.sleep(0)  # its last posts were on the loop before it ended: let them land
                if not self.queue.empty():
                    continue
                if self.ended:
                    return None
                from fmoe_local.runtime_types import Finished

                self.ended = True
                return Finished.failed(LOST)


def _usage(final) -> dict:  # noqa: ANN001 - a Finished
    prompt, completion = final.stats.prompt_tokens, len(final.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _complete(events, gen, ident, created, model, request, stop) -> JSONResponse:  # noqa: ANN001
    async def watch() -> None:
        while not stop.is_set():
            if await request.is_disconnected():
                stop.set()
                return
            await asyncio.sleep(_POLL_S)

    watcher = asyncio.create_task(watch())
    try:
        final = None
        while (event := await events.next()) is not None:
            if hasattr(event, "reason"):
                final = event
            elif not gen.stopped:
                gen.add(event.text)
                if gen.stopped:
                    stop.set()  # the rest would be thrown away: stop generating it
    finally:
        watcher.cancel()
    if final.reason == "error":
        return ApiError(500, final.error).response()
    if final.reason == "cancelled" and not gen.stopped:
        return ApiError(500, INTERRUPTED).response()
    reason = "stop" if gen.stopped else _FINISH.get(final.reason, "stop")
    message = {"role": "assistant", "content": gen.text}
    choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
    body = {"id": ident, "object": "chat.completion", "created": created, "model": model, "choices": [choice]}
    return JSONResponse(body | {"usage": _usage(final)})


async def _sse(events, gen, ident, created, model, usage, stop) -> AsyncIterator[str]:  # noqa: ANN001
    def chunk(delta: dict, reason: str | None = None, **extra: object) -> str:
        choices = [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]
        body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        return f"data: {json.dumps(body | extra)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    final = None
    while (event := await events.next()) is not None:
        if hasattr(event, "reason"):
            final = event
            continue
        if gen.stopped:
            continue
        text = gen.add(event.text)
        if gen.stopped:
            stop.set()
        if text:
            yield chunk({"content": text})
    if final.reason == "error" or (final.reason == "cancelled" and not gen.stopped):
        message = final.error if final.reason == "error" else INTERRUPTED
        yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"
        return
    rest = gen.flush()
    if rest:
        yield chunk({"content": rest})
    yield chunk({}, "stop" if gen.stopped else _FINISH.get(final.reason, "stop"))
    if usage:
        body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model, "choices": []}
        yield f"data: {json.dumps(body | {'usage': _usage(final)})}\n\n"
    yield "data: [DONE]\n\n"


async def _watch(chunks: AsyncIterator[str], request: Request, stop: threading.Event) -> AsyncIterator[str]:
    """Pass the chunks on; a client gone away (a cancelled send, or a disconnect noticed) stops its generation."""
    try:
        async for c in chunks:
            if await request.is_disconnected():
                return
            yield c
    finally:
        stop.set()  # no-op after a normal end; otherwise the runtime stops this request within a token
