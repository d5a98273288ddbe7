"""The OpenAI-compatible API under /v1: how editors, Open WebUI and scripts use the model this app has loaded.

Scope: `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions` (a prompt continued as it is, no
chat template: editors' code completion, base-model scripts), plain or `stream: true` (openai_stream.py writes both
shapes), translating to `Runtime.stream` and back: max_tokens, temperature (0 = greedy), top_p, top_k and the
penalties (left out: the app's own defaults, RuntimeConfig.sampling — never a chat's values, nor the defaults the
Chat tab saves for new chats), seed, stop, finish_reason, usage, errors in OpenAI's shape (the body is parsed and checked
in openai_request.py; one over ui/body_limit.py's limit never reaches this router). Any bearer token is accepted
here: who may call at all is decided before a request reaches this router (http_guard.py; with --listen or
--api-key, http_auth.py's token). Any `model` in a request is accepted: the loaded model answers, listed under its
short id (`Session.model_id`, "demo" for the built-in one). It does NOT hold model logic, queue requests itself (the
runtime's worker runs one request at a time; others wait in its queue) or store API chats in the user's chat list.

Threads: each request's runtime stream is consumed on a pump thread of its own (the runtime blocks), which posts
the events into the event loop (`_Events`): a request waiting its turn holds no executor thread, so any number of
them cannot freeze the reply being generated. A client that goes away sets that request's own stop flag, which
ends it within a token or at once if it is still queued.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from fmoe_local.config import Sampling
from ui.openai_request import ApiError, ApiRequest, parse_chat, parse_completion, read_body
from ui.openai_stream import Generation, Shape, complete, sse, watch
from ui.session import Session

LOST = "The request's worker thread ended without an answer. Send the request again."
# What /v1 serves; any other request: a 404 naming them.
ROUTES = ("GET /v1/models", "POST /v1/chat/completions", "POST /v1/completions")
RETRY_AFTER_S = 5  # what a 503 during a model load asks a client to wait before it asks again
_POLL_S = 0.2  # how often a wait for a request's next event checks that its pump thread still runs


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

    async def answer(request: Request, parse, prefix: str):  # noqa: ANN001, ANN202 - parse_chat or parse_completion
        try:
            # Whole and within body_limit.MAX_BODY_BYTES (the server refused a larger one unread); parsed and checked
            # on a thread, since megabytes of JSON would otherwise hold up every other request on the event loop.
            body = await asyncio.to_thread(read_body, await request.body())
            runtime = runtime_or_error()
            req: ApiRequest = parse(body, session.config.sampling)
            await _check_prompt(runtime, req.prompt)
        except ApiError as exc:
            return exc.response()
        stop = threading.Event()
        text = isinstance(req.prompt, str)
        echo = req.prompt if text and req.echo else ""
        shape = Shape(f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time()), model_id(), text, echo)
        events = _events(runtime, req.prompt, req.sampling, stop, router.finished)
        if req.stream:
            chunks = sse(events, Generation(req.stops), shape, req.include_usage, stop)
            return StreamingResponse(watch(chunks, request, stop), media_type="text/event-stream")
        return await complete(events, Generation(req.stops), shape, request, stop)

    @router.post("/chat/completions")
    async def chat_completions(request: Request):  # noqa: ANN202
        return await answer(request, parse_chat, "chatcmpl")

    @router.post("/completions")
    async def completions(request: Request):  # noqa: ANN202
        return await answer(request, parse_completion, "cmpl")

    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def elsewhere(path: str, request: Request) -> JSONResponse:
        """Any other /v1 path, or a served one with another method: an OpenAI-shaped error naming what is served
        (instead of FastAPI's {"detail": "Not Found"}, which clients show as an unexplained failure)."""
        known = any(route.split()[1] == f"/v1/{path}" for route in ROUTES)
        message = f"{request.method} /v1/{path} is not served here: this app serves {', '.join(ROUTES)}."
        return ApiError(405 if known else 404, message).response()

    return router


async def _check_prompt(runtime, prompt: list[dict] | str) -> None:  # noqa: ANN001
    """A prompt the model cannot take (too long, or refused by its chat template) is the request's fault: a 400
    that the client does not retry, told before a stream's 200 is sent, not a 500 or an error event after it. A
    chat template stopped over its budget is the model's: a 500 with the sentence, before a stream starts too."""
    from fmoe_local.chat_template import TemplateOverBudget
    from fmoe_local.engine import ContextTooLong, PromptRefused

    try:
        await asyncio.to_thread(runtime.check, prompt)  # tokenizing takes milliseconds; no turn is awaited
    except TemplateOverBudget as exc:
        raise ApiError(500, str(exc)) from exc
    except PromptRefused as exc:
        code = "context_length_exceeded" if isinstance(exc, ContextTooLong) else None
        raise ApiError(400, str(exc), "prompt" if isinstance(prompt, str) else "messages", code) from exc


def _events(runtime, prompt: list[dict] | str, sampling: Sampling, stop: threading.Event, finished: deque) -> _Events:  # noqa: ANN001
    """Run the request on a pump thread that always reads the runtime's stream to its end (so its finish is
    recorded even after the client left) and posts each event to the async side. None marks the end."""
    events = _Events(asyncio.get_running_loop())

    def pump() -> None:
        final = None
        try:
            for event in runtime.stream(prompt, sampling, stop=stop):
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
