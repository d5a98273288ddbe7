"""Who may use the app once it serves the network (--listen, or --api-key): whoever holds its access token.

Scope: one ASGI middleware, just inside http_guard.LocalOnlyGuard (so the Host and Origin rule still answers first,
and every answer here carries the guard's security headers), and the rules for a key the user chooses. A request
passes with the token as `Authorization: Bearer TOKEN` (what OpenAI clients send as their api_key; gradio_client
and scripts can send it on any route) or as the page's cookie. The cookie is set by the first page load: the
address printed at start ends in `?token=TOKEN`, or the login page's form sends it. Anthropic clients (the SDK's
api_key, Claude Code's ANTHROPIC_API_KEY) send it as `x-api-key: TOKEN`, which passes too; a refusal under
/v1/messages is in Anthropic's error shape (ui/anthropic_errors.py). It does NOT decide which hosts
or origins are served (http_guard.py) or make the token (app.py: `new_token`, or the user's --api-key).

Why every request once a token is set, programs on this computer too, rather than every request that does not come
from loopback: whatever forwards to this machine (an ssh tunnel, socat, a reverse proxy, a tunnelling service)
delivers other people's requests from 127.0.0.1, so the peer address says nothing about who is asking; and one
rule is one thing to test. The local browser gets the token in the address the app opens, and a local script
passes it like any OpenAI key. Without --listen and --api-key no token exists and nothing here runs.

Why a cookie that is HttpOnly and SameSite=Strict: the page's scripts never need to read it (nothing a message
slips into the page could read it either), and a request another site starts never carries it. Its name holds the
port, because browsers share cookies between all ports of one host. Tokens are compared in constant time
(hmac.compare_digest), so the time a refusal takes tells nothing about how much of a guess was right.
"""

from __future__ import annotations

import hmac
import html
import json
import secrets
import string
from urllib.parse import parse_qsl

from ui.anthropic_errors import error_body, is_messages
from ui.http_guard import API_PREFIX, answer

MIN_KEY_LENGTH = 12
# RFC 6750's bearer-token characters: valid in a header, a cookie and (percent-encoded) an address, as they are.
KEY_CHARACTERS = frozenset(string.ascii_letters + string.digits + "-._~+/=")
QUERY_FIELD = "token"
MISSING = (
    "This fmoe-local serves the network and asks for its access token. Open the address it printed at start "
    "(it ends in ?token=…), or send the token as 'Authorization: Bearer TOKEN' (an OpenAI client's api_key) or "
    "'x-api-key: TOKEN' (an Anthropic client's)."
)
WRONG = (
    "The token sent is not this fmoe-local's. Use the one it printed at start (a new one at every start, unless "
    "it was started with --api-key)."
)
NO_CREDENTIALS_SOCKET = 1008  # "policy violation", as the guard closes a refused WebSocket


def new_token() -> str:
    """A token nobody can guess (256 bits), printed at start when the user gave no --api-key."""
    return secrets.token_urlsafe(32)


def key_problem(key: str) -> str | None:
    """A sentence saying why `key` cannot be the access token, or None when it can."""
    if len(key) < MIN_KEY_LENGTH:
        return (
            f"--api-key must be at least {MIN_KEY_LENGTH} characters long: it is all that keeps your network out of "
            "your chats. Leave --api-key out and fmoe-local makes one and prints it."
        )
    odd = sorted(set(key) - KEY_CHARACTERS)
    if odd:
        return (
            f"--api-key may hold only letters, digits and - . _ ~ + / = (it is sent in headers and cookies), not "
            f"{' '.join(repr(c) for c in odd[:5])}. Leave --api-key out and fmoe-local makes one and prints it."
        )
    return None


def cookie_name(port: int) -> str:
    return f"fmoe_token_{port}"


def _matches(sent: str | None, token: bytes) -> bool:
    return sent is not None and hmac.compare_digest(sent.encode("utf-8", "surrogateescape"), token)


def _bearer(value: str | None) -> str | None:
    scheme, _, credentials = (value or "").strip().partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else None


def _cookie(value: str | None, name: str) -> str | None:
    for part in (value or "").split(";"):
        key, _, sent = part.strip().partition("=")
        if key == name:
            return sent
    return None


class TokenGate:
    """ASGI middleware: passes a request that carries `token` (bearer, x-api-key or cookie); answers one whose
    address carries it (`?token=`) by setting the cookie and opening the page; refuses the rest with 401 (/v1: in
    OpenAI's error shape, /v1/messages in Anthropic's; a page load: the login page; anything else: a sentence) or,
    for a WebSocket, by closing it."""

    def __init__(self, app, token: str | None, cookie: str) -> None:  # noqa: ANN001 - ASGI app
        self.app = app
        self.token = token.encode("utf-8") if token else None
        self.cookie = cookie

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - the ASGI signature
        if self.token is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        sent = [_bearer(headers.get("authorization")), _cookie(headers.get("cookie"), self.cookie)]
        sent.append(headers.get("x-api-key"))  # how Anthropic clients send their API key
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and not _is_api(path):
            # A page address with the token (printed at start, or the login form's): signed in, even over an old
            # cookie, and the token leaves the address bar.
            query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True))
            if QUERY_FIELD in query:
                if _matches(query[QUERY_FIELD], self.token):
                    await self._sign_in(send, query[QUERY_FIELD])
                    return
                sent.append(query[QUERY_FIELD])
        if any(_matches(s, self.token) for s in sent):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": NO_CREDENTIALS_SOCKET})
            return
        await self._refuse(scope, send, headers, WRONG if any(s is not None for s in sent) else MISSING)

    async def _sign_in(self, send, token: str) -> None:  # noqa: ANN001
        """The cookie, then the page itself without the token in its address. A page that moves on by itself
        rather than a redirect: a SameSite=Strict cookie is not sent along a redirect that a link on another site
        started (a chat, a mail), but it is on a navigation our own page starts."""
        cookie = f"{self.cookie}={token}; Path=/; HttpOnly; SameSite=Strict"
        body = PAGE.format(
            title="Signed in",
            body='<meta http-equiv="refresh" content="0; url=/"><script>location.replace("/")</script>'
            '<p>Signed in. <a href="/">Open fmoe-local</a>.</p>',
        ).encode()
        extra = [(b"set-cookie", cookie.encode("latin-1")), (b"cache-control", b"no-store")]
        await answer(send, 200, body, [(b"content-type", b"text/html; charset=utf-8")] + extra)

    async def _refuse(self, scope, send, headers: dict, said: str) -> None:  # noqa: ANN001
        challenge = [(b"www-authenticate", b'Bearer realm="fmoe-local"'), (b"cache-control", b"no-store")]
        if is_messages(scope.get("path", "")):
            await answer(send, 401, error_body(401, said), [(b"content-type", b"application/json")] + challenge)
            return
        if _is_api(scope.get("path", "")):
            error = {"message": said, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
            body = json.dumps({"error": error}).encode()
            await answer(send, 401, body, [(b"content-type", b"application/json")] + challenge)
            return
        page_load = headers.get("sec-fetch-dest") == "document" or "text/html" in headers.get("accept", "")
        if scope.get("method") == "GET" and page_load:
            body = PAGE.format(title="Sign in", body=LOGIN.format(said=html.escape(said))).encode()
            await answer(send, 401, body, [(b"content-type", b"text/html; charset=utf-8")] + challenge)
            return
        await answer(send, 401, said.encode(), [(b"content-type", b"text/plain; charset=utf-8")] + challenge)


def _is_api(path: str) -> bool:
    return path.startswith(API_PREFIX) or path == API_PREFIX.rstrip("/")


# Our own text only: no request data is ever placed in these pages.
PAGE = (
    '<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
    'content="width=device-width, initial-scale=1"><title>fmoe-local: {title}</title><style>body{{font-family:'
    "system-ui,sans-serif;max-width:36rem;margin:4rem auto;padding:0 1rem;line-height:1.5}}input{{width:100%;"
    "font:inherit;padding:.4rem;margin:.5rem 0}}</style></head><body>{body}</body></html>"
)
LOGIN = (
    "<h1>fmoe-local</h1><p>{said}</p>"
    '<form method="get" action="/"><label>Access token <input name="token" type="password" autocomplete="off" '
    'autofocus required></label><button type="submit">Open</button></form>'
)
