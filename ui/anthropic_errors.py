"""Errors in the Anthropic Messages API's shape: `{"type": "error", "error": {"type": ..., "message": ...}}`, the
error's type named from its HTTP status as Anthropic names them, for every answer under MESSAGES_PREFIX that is not
a reply — the API's own 4xx and 5xx (ui/anthropic_api.py), and the token gate's 401 and the body limit's 413, which
answer before the API sees the request.

Light on purpose (no pydantic, no FastAPI): the middlewares import it. The sentences are the OpenAI API's, the
same for the same fault; only the envelope differs.
"""

from __future__ import annotations

import json

MESSAGES_PREFIX = "/v1/messages"
# Anthropic's error types by status (its API reference, "Errors"); any other 4xx is an invalid request, any other
# 5xx an API error.
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # a model still loading: worth asking again (with Retry-After)
    529: "overloaded_error",
}


def is_messages(path: str) -> bool:
    """Whether a request path is the Anthropic API's (/v1/messages and what is under it)."""
    return path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/")


def error_type(status: int) -> str:
    return TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> bytes:
    """The body of an error answer. ASCII escapes: a message that quotes a client's text always encodes."""
    body = {"type": "error", "error": {"type": error_type(status), "message": message}}
    return json.dumps(body, ensure_ascii=True).encode("ascii")
