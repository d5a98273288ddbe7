"""The body of a /v1/chat/completions request, parsed and checked: what the API passes to the runtime, or an
ApiError in OpenAI's shape (a 4xx names the field, `param`, that is wrong).

Scope: messages, sampling (max_tokens, temperature, top_p, seed, n), stop, stream and stream_options. It does NOT
talk to the runtime or the session (ui/openai_api.py does), so every check here runs before a request is queued.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import JSONResponse

from fmoe_local.config import Sampling


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    sampling: Sampling
    stops: list[str]
    stream: bool
    include_usage: bool


def parse_chat(body: dict, default_max: int) -> ChatRequest:
    """`default_max`: the reply length when the request names none (the app's Settings)."""
    sampling, messages, stops = _sampling(body, default_max), _messages(body), _stops(body)
    stream = bool(body.get("stream"))
    include_usage = stream and bool((body.get("stream_options") or {}).get("include_usage"))
    return ChatRequest(messages, sampling, stops, stream, include_usage)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _sampling(body: dict, default_max: int) -> Sampling:
    def number(name: str, default: float, low: float, high: float) -> float:
        value = body.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ApiError(400, f"'{name}' must be a number from {low} to {high}.", name)
        return float(value)

    if body.get("n", 1) not in (1, None):
        raise ApiError(400, "Only n=1 is supported: this app generates one reply at a time.", "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, "'max_tokens' must be a whole number of at least 1.", "max_tokens")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, "'seed' must be a whole number.", "seed")
    temperature = number("temperature", 1.0, 0.0, 2.0)
    return Sampling(
        max_new_tokens=max_tokens,
        temperature=temperature,
        top_p=number("top_p", 1.0, 1e-9, 1.0),
        greedy=temperature == 0.0,
        seed=seed,
    )


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content}.", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, "Each message needs a role: system, user or assistant.", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones are what a text model reads
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise ApiError(400, "Each message's content must be text.", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    # Clients send a system prompt and then a developer or RAG message; many chat templates (Mixtral's) take one
    # system message only and refuse a second. The leading ones become one, in their order.
    lead = next((i for i, m in enumerate(out) if m["role"] != "system"), len(out))
    if lead > 1:
        out[:lead] = [{"role": "system", "content": "\n\n".join(m["content"] for m in out[:lead])}]
    return out


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings.", "stop")
    return stops
