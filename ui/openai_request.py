"""The body of a /v1/chat/completions or /v1/completions request, parsed and checked: what the API passes to the
runtime, or an ApiError in OpenAI's shape (a 4xx names the field, `param`, that is wrong).

Two layers. `read_body` checks the JSON as a whole before any field is looked at: UTF-8, nesting, every number
and every string, wherever it is (a field the app ignores today may be read tomorrow, and a value that cannot be
represented breaks whoever reads it: a seed of 2**80 overflowed torch, a lone surrogate broke the tokenizer, JSON
nested 100,000 deep overflowed the parser's stack — each a 500). Then `parse_chat` and `parse_completion` check
what each field means. Scope of the second: messages (chat) or prompt and echo (completions), sampling (max_tokens, temperature, top_p, top_k, the
penalties, seed, n), stop,
stream and stream_options, and the refusal of what the app cannot do (response_format other than text, logprobs,
tool calls, a suffix to fill in, several prompts or token ids). It does NOT talk to the runtime or the session
(ui/openai_api.py does), so every check here runs before a request is queued.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from fastapi.responses import Response

from fmoe_local.config import Sampling

# OpenAI caps `stop` at 4, but local servers (LM Studio, Ollama, vLLM) take more and editors send more (Continue
# sends its whole list): refusing them refuses the editor. Each stop string is searched for after every token, so
# a bound stays, well above what clients send.
MAX_STOPS = 16
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
    """`defaults`: the app's Settings (temperature, top_p, max_new_tokens), for what the request leaves out or
    sends as null, so an API client gets the replies the app's chat gets."""
    _refuse_unsupported(body)
    return _request(body, _messages(body), defaults)


def parse_completion(body: dict, defaults: Sampling) -> ApiRequest:
    """A /v1/completions body: the prompt is continued as it is, without the chat template (what editors' code
    completion and base-model scripts send). Defaults as for `parse_chat`."""
    if body.get("suffix"):
        raise ApiError(
            400, "'suffix' is not supported: this app continues a prompt but does not fill in between.", "suffix"
        )
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "Only best_of=1 is supported: this app generates one reply at a time.", "best_of")
    _refuse_logprobs(body)  # a count here, a flag in a chat: 0 and False alike ask for none
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise ApiError(400, "'echo' must be true or false.", "echo")
    return _request(body, _prompt(body), defaults, echo)


def _request(body: dict, prompt: list[dict] | str, defaults: Sampling, echo: bool = False) -> ApiRequest:
    sampling, stops = _sampling(body, defaults), _stops(body)
    stream, options = body.get("stream") or False, body.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false.", "stream")
    if not isinstance(options, dict) or options.get("include_usage") not in (None, True, False):
        raise ApiError(400, "'stream_options' must be an object such as {\"include_usage\": true}.", "stream_options")
    return ApiRequest(prompt, sampling, stops, stream, stream and bool(options.get("include_usage")), echo)


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # one prompt in a list, as the openai client sends a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise ApiError(400, "Send one prompt per request: this app generates one reply at a time.", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
        raise ApiError(400, "Send the prompt as text: token ids are not supported.", "prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string.", "prompt")
    return prompt


def _refuse_logprobs(body: dict) -> None:
    if body.get("logprobs") not in (None, False):  # 0 == False: a completion's count of none passes too
        raise ApiError(400, "'logprobs' is not supported: this app does not return token probabilities.", "logprobs")


def _refuse_unsupported(body: dict) -> None:
    """What this app cannot do is refused by name (a 400 with `param`), never ignored: a client that is told can
    fall back (ask for JSON in the prompt, Open WebUI's default function calling), while one that is ignored takes
    a reply that never followed its rules for one that did. Tools included: accepted with tool_choice "auto", the
    model would never see them, and an agent (LangChain's bind_tools) would read its text as "no tool needed".
    Only tool_choice "none", which promises a text reply, takes tools (and leaves them out)."""
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError(
            400,
            'Only response_format {"type": "text"} is supported: this app cannot hold a reply to JSON or a schema. '
            "Ask for JSON in the messages instead.",
            "response_format",
        )
    _refuse_logprobs(body)
    if body.get("top_logprobs") not in (None, 0):
        raise ApiError(
            400, "'top_logprobs' is not supported: this app does not return token probabilities.", "top_logprobs"
        )
    for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
        if body.get(choice) not in (None, "none", "auto"):  # "required" or a named function: a call is demanded
            raise ApiError(
                400, f'\'{choice}\' can only be "none" or "auto": this app\'s models do not call tools.', choice
            )
        if body.get(tools) and body.get(choice) != "none":
            raise ApiError(
                400,
                f"Tool calling is not supported: this app's models answer in text only. Send the request without "
                f'\'{tools}\' (in Open WebUI: Function Calling "Default", not "Native").',
                tools,
            )


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


def _sampling(body: dict, defaults: Sampling) -> Sampling:
    def number(name: str, default: float, low: float, high: float) -> float:
        value = body.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ApiError(400, f"'{name}' must be a number from {low} to {high}.", name)
        return float(value)

    if body.get("n", 1) not in (1, None):
        raise ApiError(400, "Only n=1 is supported: this app generates one reply at a time.", "n")
    # max_completion_tokens is OpenAI's newer name; null means "not given" (clients send their unset fields as
    # null), so it must not hide a max_tokens beside it.
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(param)
    if max_tokens is None:
        max_tokens = defaults.max_new_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, f"'{param}' must be a whole number of at least 1.", param)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, "'seed' must be a whole number.", "seed")
    temperature = number("temperature", defaults.temperature, 0.0, 2.0)
    top_p = number("top_p", defaults.top_p, 0.0, 1.0)  # OpenAI's range; 0 keeps only the likeliest token: greedy
    # Not OpenAI's, but what vLLM, llama.cpp and LM Studio take and their clients send: top_k (-1 or 0: no limit)
    # and repetition_penalty (1: off).
    top_k = body.get("top_k", defaults.top_k)
    if top_k is None:
        top_k = defaults.top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise ApiError(
            400, "'top_k' must be a whole number: -1 or 0 for no limit, else how many tokens to keep.", "top_k"
        )
    repetition = number("repetition_penalty", defaults.repetition_penalty, 0.0, 2.0)
    if repetition == 0.0:
        raise ApiError(400, "'repetition_penalty' must be more than 0 (1 is off).", "repetition_penalty")
    return Sampling(
        max_new_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        repetition_penalty=repetition,
        frequency_penalty=number("frequency_penalty", defaults.frequency_penalty, -2.0, 2.0),
        presence_penalty=number("presence_penalty", defaults.presence_penalty, -2.0, 2.0),
        greedy=temperature == 0.0 or top_p == 0.0,
        seed=seed,
    )


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content}.", "messages")
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") in ("tool", "function"):
            raise ApiError(400, "Tool results cannot be sent: this app's models do not call tools.", "messages")
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, "Each message needs a role: system, user or assistant.", "messages")
        content = m.get("content")
        if isinstance(content, list):
            content = _text_of(content)
        if not isinstance(content, str):
            raise ApiError(400, "Each message's content must be text.", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    # Clients send a system prompt and then a developer or RAG message; many chat templates (Mixtral's) take one
    # system message only and refuse a second. The leading ones become one, in their order.
    lead = next((i for i, m in enumerate(out) if m["role"] != "system"), len(out))
    if lead > 1:
        out[:lead] = [{"role": "system", "content": "\n\n".join(m["content"] for m in out[:lead])}]
    return out


def _text_of(parts: list) -> str:
    """A message's content parts as one text, joined by "\n" as vLLM's and TensorRT-LLM's OpenAI servers join them
    (OpenAI does not document it). A part the model cannot read (image_url, input_audio, file…) is refused: answered
    without it, the reply would be about something the model never saw."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "refusal"):  # a refusal: an earlier assistant turn's text, in OpenAI's history
            what = f"a '{kind}' part" if isinstance(kind, str) else "a content part without a type"
            raise ApiError(
                400, f"This model reads text only, and a message has {what}. Send text parts only.", "messages"
            )
        text = part.get(kind)
        if not isinstance(text, str):
            raise ApiError(400, f"A '{kind}' content part needs '{kind}', a string.", "messages")
        texts.append(text)
    return "\n".join(texts)


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings.", "stop")
    return stops
