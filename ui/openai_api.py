"""The OpenAI-compatible API under /v1: how editors, Open WebUI and scripts use the model this app has loaded.

Scope: `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions` (a prompt continued as it is, no
chat template: editors' code completion, base-model scripts), plain or `stream: true` (openai_stream.py writes both
shapes), translating to `Runtime.submit` and back: max_tokens, temperature (0 = greedy), top_p, top_k and the
penalties (left out: the app's own defaults, RuntimeConfig.sampling — never a chat's values, nor the defaults the
Chat tab saves for new chats), seed, stop, logit_bias, tools and response_format (checked against the model and turned
into a grammar by structured.py), finish_reason, usage, errors in OpenAI's shape (the body is parsed and checked in
openai_request.py; one over ui/body_limit.py's limit never reaches this router). Any bearer token is accepted
here: who may call at all is decided before a request reaches this router (http_guard.py; with --listen or
--api-key, http_auth.py's token). Any `model` in a request is accepted: the loaded model answers, listed under its
short id (`Session.model_id`, "demo" for the built-in one). It does NOT hold model logic, queue requests itself (the
runtime's worker runs one request at a time; others wait in its queue) or store API chats in the user's chat list.

Threads: none of its own. Each request's handle is iterated asynchronously on the event loop (the runtime's worker
wakes it through the loop): a request waiting its turn holds no thread at all, so any number of them cannot freeze
the reply being generated. A client that goes away cancels that request's handle (openai_stream.py: `Streamed`
and `complete` wait for the disconnect while the reply runs), which ends it within a token, or at once if it is
still queued.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ui.loaded_runtime import LoadedRuntime
from ui.openai_request import ApiError, ApiRequest, parse_chat, parse_completion, read_body
from ui.openai_stream import Shape, Streamed, complete, sse
from ui.session import Session
from ui.structured import shape

# What /v1 serves; any other request: a 404 naming them.
ROUTES = ("GET /v1/models", "GET /v1/models/{id}", "POST /v1/chat/completions", "POST /v1/completions")
RETRY_AFTER_S = 5  # what a 503 during a model load asks a client to wait before it asks again


def loaded_runtime(session: Session) -> LoadedRuntime:
    """The loaded model's runtime, or an ApiError 503 saying why there is none."""
    if session.runtime is None:
        if session.still_loading:  # worth asking again soon: clients that honour Retry-After wait, then retry
            raise ApiError(503, session.still_loading, headers={"Retry-After": str(RETRY_AFTER_S)})
        raise ApiError(503, session.load_error or "No model is loaded. Load one in the app's Models tab.")
    return session.runtime


def build_router(session: Session, others: tuple[APIRouter, ...] = ()) -> APIRouter:
    """`others`: more routes served under /v1 (the Anthropic API's, ui/anthropic_api.py), each a router without the
    prefix, matched before the answer to every other /v1 path."""
    router = APIRouter(prefix="/v1")
    router.finished = deque(maxlen=32)  # (finish reason, tokens) of recent API requests: for tests and debugging
    served = ROUTES + tuple(f"{m} /v1{r.path}" for other in others for r in other.routes for m in sorted(r.methods))

    def runtime_or_error():
        return loaded_runtime(session)

    def model_id() -> str:
        return session.model_id

    def served_id() -> str:
        """The model this app serves: the loaded one, or the one loading — listed while it loads, so a client that
        lists the models before it asks finds it and gets a 503 with Retry-After until it has loaded."""
        return model_id() if session.runtime is not None else session.loading_id

    def entry(ident: str) -> dict:
        # OpenAI's model object, and Anthropic's fields beside it (its clients' models.list reads type, id,
        # display_name and created_at): each client ignores the other's.
        model = {"id": ident, "object": "model", "created": 0, "owned_by": "fmoe-local"}
        return model | {"type": "model", "display_name": ident, "created_at": "1970-01-01T00:00:00Z"}

    @router.get("/models")
    def models() -> dict:
        data = [entry(ident)] if (ident := served_id()) else []
        ends = {"first_id": data[0]["id"], "last_id": data[-1]["id"]} if data else {"first_id": None, "last_id": None}
        return {"object": "list", "data": data, "has_more": False} | ends

    @router.get("/models/{ident:path}")
    def model(ident: str) -> JSONResponse:
        """One model by its id (OpenAI's retrieve): the one served, else a 404 naming it."""
        if ident and ident == served_id():
            return JSONResponse(entry(ident))
        served = f"'{served_id()}'" if served_id() else "none (no model is loaded)"
        message = f"The model '{ident}' is not served here; the one this app serves is {served}."
        return ApiError(404, message, "model").response()

    async def answer(request: Request, parse, prefix: str):  # noqa: ANN001, ANN202 - parse_chat or parse_completion
        try:
            # Whole and within body_limit.MAX_BODY_BYTES (the server refused a larger one unread); parsed and checked
            # on a thread, since megabytes of JSON would otherwise hold up every other request on the event loop.
            body = await asyncio.to_thread(read_body, await request.body())
            runtime = runtime_or_error()
            req: ApiRequest = parse(body, session.config.sampling)
            # tools, a forced call, a JSON reply: what the model must take, and the grammar it is held to
            shaped = await asyncio.to_thread(shape, runtime, req)
            await _check_prompt(runtime, req.prompt, shaped.tools, shaped.variables)
        except ApiError as exc:
            return exc.response()
        text = isinstance(req.prompt, str)
        echo = req.prompt if text and req.echo else ""
        reply = Shape(f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time()), model_id(), text, echo)
        handle = runtime.submit(req.prompt, shaped.sampling, **shaped.submit_options())
        # Recorded when the request ends, even after its client left (the worker runs this; a deque is thread-safe).
        handle.add_done_callback(lambda final: router.finished.append((final.reason, len(final.token_ids))))
        if req.stream:
            return Streamed(sse(handle, shaped.parts(req.stops), reply, req.include_usage), handle)
        return await complete(handle, shaped.parts(req.stops), reply, request)

    @router.post("/chat/completions")
    async def chat_completions(request: Request):  # noqa: ANN202
        return await answer(request, parse_chat, "chatcmpl")

    @router.post("/completions")
    async def completions(request: Request):  # noqa: ANN202
        return await answer(request, parse_completion, "cmpl")

    for other in others:
        router.include_router(other)

    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def elsewhere(path: str, request: Request) -> JSONResponse:
        """Any other /v1 path, or a served one with another method: an OpenAI-shaped error naming what is served
        (instead of FastAPI's {"detail": "Not Found"}, which clients show as an unexplained failure)."""
        known = any(route.split()[1] == f"/v1/{path}" for route in served)
        message = f"{request.method} /v1/{path} is not served here: this app serves {', '.join(served)}."
        return ApiError(405 if known else 404, message).response()

    return router


async def _check_prompt(
    runtime: LoadedRuntime, prompt: list[dict] | str, tools: list[dict], variables: dict | None = None
) -> int | None:
    """The prompt's length in tokens (None when the runtime cannot tell: Runtime.check). A prompt the model cannot take (too long, or refused by its chat template) is the request's fault: a 400
    that the client does not retry, told before a stream's 200 is sent, not a 500 or an error event after it. A
    chat template stopped over its budget is the model's: a 500 with the sentence, before a stream starts too."""
    from fmoe_local.chat_template import TemplateOverBudget
    from fmoe_local.engine import ContextTooLong, PromptRefused

    try:
        extra = (tools, variables) if variables else (tools,) if tools else ()  # milliseconds; no turn is awaited
        return await asyncio.to_thread(runtime.check, prompt, *extra)
    except TemplateOverBudget as exc:
        raise ApiError(500, str(exc)) from exc
    except PromptRefused as exc:
        code = "context_length_exceeded" if isinstance(exc, ContextTooLong) else None
        raise ApiError(400, str(exc), "prompt" if isinstance(prompt, str) else "messages", code) from exc
