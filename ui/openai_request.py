"""The body of a /v1/chat/completions or /v1/completions request, parsed and checked: what the API passes to the
runtime, or an ApiError in OpenAI's shape (a 4xx names the field, `param`, that is wrong).

Two layers. `read_body` checks the JSON as a whole before any field is looked at: UTF-8, nesting, every number
and every string, wherever it is (a field the app ignores today may be read tomorrow, and a value that cannot be
represented breaks whoever reads it: a seed of 2**80 overflowed torch, a lone surrogate broke the tokenizer, JSON
nested 100,000 deep overflowed the parser's stack — each a 500). Then `parse_chat` and `parse_completion` check
what each field means through the pydantic models of openai_models.py (its REFUSALS: the sentences) and turn the
body into an ApiRequest: the messages as a chat template reads them (tool calls and results included), Sampling
(with top_k, the penalties and logit_bias), stops, stream options, tools and tool_choice, response_format. It does NOT talk to
the runtime or the session (ui/openai_api.py does: whether the model's template takes tools, whether a schema
compiles), so every check here runs before a request is queued.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from fmoe_local.config import Sampling
from ui.openai_models import (
    ChatBody,
    CompletionBody,
    Message,
    NamedToolChoice,
    ResponseFormat,
    ToolCall,
    refusal,
)

# A request without max_tokens: the reply runs until the model ends it or its context is full (the runtime cuts
# it there, finish_reason "length"), as OpenAI's does.
UNTIL_CONTEXT = 2**31 - 1
# How deep a body's JSON may nest. OpenAI's requests nest 5 levels (body, messages, a message, its content parts, a
# part); a tool's JSON schema, the deepest thing a client sends, rarely 10 more. Deeper is no request of OpenAI's
# API, and a parser (or any code walking the value) recursing through it can run out of stack.
MAX_DEPTH = 64
# Every whole number in a body must fit 64 bits: what a seed or a count can be anywhere a number goes (torch,
# numpy, SQLite), and beyond what any OpenAI field means. Checked while parsing, so a 4,000-digit number costs
# nothing either.
WHOLE_RANGE = (-(2**63), 2**63 - 1)
_SURROGATE = re.compile("[\ud800-\udfff]")  # half a character: left by a lone "\ud800" escape in JSON


@dataclass(frozen=True)
class ApiRequest:
    prompt: list[dict] | str  # chat messages, or (/v1/completions) the text the reply continues, as it is
    sampling: Sampling
    stops: list[str]
    stream: bool
    include_usage: bool
    echo: bool = False  # /v1/completions: the reply's text starts with the prompt
    tools: list[dict] = field(default_factory=list)  # OpenAI-shaped function tools, for the chat template
    tool_choice: str = "none"  # "none", "auto", "required", or the one function's name the reply must call
    parallel_tool_calls: bool = True  # False: a forced reply is one call, not one or more
    response_format: ResponseFormat | None = None
    thinking: str | None = None  # Anthropic's thinking type ("enabled", "adaptive", "disabled"); None: not asked
    # The most tokens the reply's thought may take (Anthropic's budget_tokens, vLLM's thinking_token_budget); None:
    # no limit.
    thought_budget: int | None = None


def read_body(raw: bytes) -> dict:
    """A request's body as a JSON object whose every value the app can represent: text in UTF-8 and valid Unicode
    (no lone surrogate), nested at most MAX_DEPTH deep, whole numbers within WHOLE_RANGE and no NaN or infinity.
    Anything else is an ApiError 400 that names where it is (`param`: the top-level field), before any field is
    read for its meaning."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, f"The request body must be JSON in UTF-8, but its byte {exc.start:,} is not UTF-8. Send it as UTF-8."
        ) from exc
    try:
        body = json.loads(text, parse_int=_whole, parse_float=_real, parse_constant=_Unusable)
    except RecursionError as exc:  # nested far beyond MAX_DEPTH: the parser's own stack ran out first
        raise ApiError(400, _TOO_DEEP) from exc
    except ValueError as exc:
        raise ApiError(400, f"The request body must be JSON ({exc}).") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    _check_values(body)
    return body


_TOO_DEEP = (
    f"The request body is nested more than {MAX_DEPTH} levels deep, which no OpenAI request is. Send the fields "
    "as OpenAI's API documents them."
)


class _Unusable:
    """A number parsed from the body that no field can take (NaN, an infinity, a whole number beyond 64 bits):
    kept as this marker while parsing, refused by `_check_values` with the field's name."""

    def __init__(self, literal: str, whole: bool = False) -> None:
        self.whole = whole
        self.literal = literal if len(literal) <= 24 else f"{literal[:12]}…({len(literal):,} digits)"


def _whole(literal: str) -> int | _Unusable:
    if len(literal) > 20:  # beyond 64 bits whatever the digits: never handed to int() (4,300 digits raise there)
        return _Unusable(literal, whole=True)
    value = int(literal)
    return value if WHOLE_RANGE[0] <= value <= WHOLE_RANGE[1] else _Unusable(literal, whole=True)


def _real(literal: str) -> float | _Unusable:
    value = float(literal)
    return value if math.isfinite(value) else _Unusable(literal)  # 1e999 parses as infinity


def _check_values(body: dict) -> None:
    """Walk the whole value without recursion (a list per level, not a stack frame)."""
    pending: list[tuple[object, tuple, int]] = [(body, (), 1)]
    while pending:
        value, path, depth = pending.pop()
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        elif isinstance(value, str):
            if _SURROGATE.search(value):
                raise ApiError(
                    400,
                    f"{_where(path)} holds text that is not valid Unicode: a lone surrogate (such as \\ud800), half "
                    "of a character. Send whole characters only.",
                    _param(path),
                )
            continue
        elif isinstance(value, _Unusable):
            if value.whole:
                low, high = WHOLE_RANGE
                said = f"is {value.literal}, outside the whole numbers this app can take ({low:,} to {high:,})"
                fix = "Send a number in that range."
            else:
                said, fix = f"is {value.literal}, not a finite number", "Send a finite number."
            raise ApiError(400, f"{_where(path)} {said}. {fix}", _param(path))
        else:
            continue
        if depth > MAX_DEPTH:
            raise ApiError(400, _TOO_DEEP, _param(path))
        for key, item in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                raise ApiError(
                    400,
                    f"A field name in {_where(path) if path else 'the request body'} is not valid Unicode (a lone "
                    "surrogate, half of a character). Send whole characters only.",
                    _param(path),
                )
            if isinstance(item, (dict, list, str, _Unusable)):
                pending.append((item, (*path, key), depth + 1))


def _where(path: tuple) -> str:
    """A value's place in the body as a client writes it (`messages[0].content`), in quotes; long names cut."""
    text = ""
    for key in path:
        if isinstance(key, int):
            text += f"[{key}]"
        else:
            name = key if len(key) <= 40 else f"{key[:40]}…"
            text += f".{name}" if text else name
    return f"'{text}'" if text else "The request body"


def _param(path: tuple) -> str | None:
    return _where(path[:1]).strip("'") if path else None


def parse_chat(body: dict, defaults: Sampling) -> ApiRequest:
    """`defaults`: the app's own sampling (RuntimeConfig.sampling), for what the request leaves out or sends as
    null — never a chat's values nor the defaults the Chat tab saves for new chats. A request without max_tokens
    runs up to the model's context, as OpenAI's does (the chat's Max new tokens is the chat's, not the API's)."""
    chat = _validated(ChatBody, body)
    tools = [t.model_dump(exclude_none=True) for t in chat.tools or []]
    choice = chat.tool_choice or ("auto" if tools else "none")
    if isinstance(choice, NamedToolChoice):
        choice = choice.function.name
    if choice == "none":
        tools = []  # "none" promises a text reply: the model is not shown tools it may not call
    return ApiRequest(
        _messages(chat.messages),
        *_common(chat, defaults),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=chat.parallel_tool_calls is not False,
        response_format=chat.response_format,
        thought_budget=chat.thinking_token_budget,
    )


def parse_completion(body: dict, defaults: Sampling) -> ApiRequest:
    """A /v1/completions body: the prompt is continued as it is, without the chat template (what editors' code
    completion and base-model scripts send). Defaults as for `parse_chat`."""
    completion = _validated(CompletionBody, body)
    return ApiRequest(completion.prompt, *_common(completion, defaults), echo=bool(completion.echo))


def _validated(model: type[BaseModel], body: dict) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = refusal(exc)
        raise ApiError(400, message, param) from exc


def _common(body: ChatBody | CompletionBody, defaults: Sampling) -> tuple:
    """(sampling, stops, stream, include_usage) of either kind of body."""
    temperature = defaults.temperature if body.temperature is None else float(body.temperature)
    top_p = defaults.top_p if body.top_p is None else float(body.top_p)
    top_k = defaults.top_k if body.top_k is None else max(body.top_k, 0)  # -1, vLLM's "no limit", is our 0

    def given(value: float | None, default: float) -> float:
        return default if value is None else float(value)

    max_tokens = getattr(body, body.max_tokens_param)
    bias = tuple((int(token), float(value)) for token, value in (body.logit_bias or {}).items())
    sampling = Sampling(
        max_new_tokens=UNTIL_CONTEXT if max_tokens is None else max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        greedy=temperature == 0.0 or top_p == 0.0,  # top_p 0 keeps only the likeliest token
        seed=body.seed,
        repetition_penalty=given(body.repetition_penalty, defaults.repetition_penalty),
        frequency_penalty=given(body.frequency_penalty, defaults.frequency_penalty),
        presence_penalty=given(body.presence_penalty, defaults.presence_penalty),
        logit_bias=bias,
    )
    stream = bool(body.stream)
    usage = stream and bool(body.stream_options and body.stream_options.include_usage)
    return sampling, body.stop, stream, usage


def _messages(messages: list[Message]) -> list[dict]:
    """The messages as a chat template reads them: developer as system, an assistant's tool calls with their
    arguments as an object (transformers' convention, which templates follow), a tool result with its call's id."""
    out = []
    for m in messages:
        message = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _args(c)}}
                for c in m.tool_calls
            ]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
            if m.name:
                message["name"] = m.name
        out.append(message)
    # Clients send a system prompt and then a developer or RAG message; many chat templates (Mixtral's) take one
    # system message only and refuse a second. The leading ones become one, in their order.
    lead = next((i for i, m in enumerate(out) if m["role"] != "system"), len(out))
    if lead > 1:
        out[:lead] = [{"role": "system", "content": "\n\n".join(m["content"] for m in out[:lead])}]
    return out


def _args(call: ToolCall) -> dict | str:
    try:
        value = json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments  # not JSON: the template writes it as the client sent it
    return value if isinstance(value, dict) else call.function.arguments


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> Response:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        # ASCII escapes: a message that quotes a client's text can never fail to encode (a lone surrogate in it
        # made JSONResponse's UTF-8 encoding raise, and the client a bare 500).
        content = json.dumps(body, ensure_ascii=True)
        return Response(content, status_code=self.status, headers=self.headers, media_type="application/json")
