"""Who may talk to the app: requests addressed to this machine by a name we serve, from our own pages or from
programs that are not browsers.

Scope: one ASGI middleware, outermost around the whole server (the chat UI, its internal API, the /v1 API), and
the rule it applies. It does NOT authenticate users (http_auth.py does, once a token is set: --listen, --api-key)
or serve anything itself.

Why: a server on 127.0.0.1 is reachable by every web page the user opens.
- DNS rebinding: a page on evil.example whose name later resolves to 127.0.0.1 talks to us as its own origin;
  its requests carry `Host: evil.example`. Only loopback names and addresses (and, with --listen, IP literals and
  this machine's own name) are served; a name can rebind, an address typed by the user cannot.
- Cross-site requests (a form post, a `no-cors` upload) carry an `Origin` naming the other site: refused. Only
  our own origin (the same host and port the request was sent to) is accepted, so no CORS grant is ever needed
  and none is given. Programs that are not browsers (curl, the openai client, editors) send no Origin.
- A browser sends no Origin with a GET for an `<img>`, `<script>` or frame; it does send `Sec-Fetch-Site`. From
  another site only a top-level page load (a link the user follows) is served: a cross-site page may not probe
  our URLs, include them, or frame the app to trick clicks.
- Opt-in only (`--allow-origin ORIGIN`): a browser-based app the user names (an Electron app's `app://…`, a web
  client on another port) may call the /v1 API, never the UI: preflights are answered here and its answers carry
  `Access-Control-Allow-Origin` for that exact origin; the Host rule still applies, and `*` is never granted.
- Every answer carries a Content-Security-Policy: the page may load images, fonts, styles, scripts and
  connections only from itself, submit forms only to itself and sits in no other site's frame. Whatever a message
  or reply slips past ui/render.py, the browser still fetches nothing from elsewhere.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain"})
REFUSED = (
    "This request was refused: fmoe-local only answers its own pages and programs on this computer. "
    "Open the address the app printed (http://127.0.0.1:PORT) in your browser."
)
API_PREFIX = "/v1/"
CORS_METHODS = "GET, POST, OPTIONS"
# The request headers a granted origin's preflight may ask for: what the OpenAI and Anthropic SDKs send from a browser
# (the token as `authorization` or `x-api-key`, Anthropic's version, beta and browser-access headers, and the
# Stainless-generated SDKs' `x-stainless-*` description of themselves); a preflight asking for more is not granted.
CORS_HEADERS = (
    "authorization, content-type, x-api-key, anthropic-version, anthropic-beta, "
    "anthropic-dangerous-direct-browser-access"
)
CORS_HEADER_PREFIX = "x-stainless-"


def machine_names() -> frozenset[str]:
    """This machine's own names, which LAN users may type when the app serves with --listen."""
    name = socket.gethostname().lower()
    return frozenset({name, f"{name}.local", name.split(".")[0]})


def _split(authority: str) -> tuple[str, int | None]:
    """'Host' header or URL authority → (lower-case host without brackets, port or None)."""
    parts = urlsplit(f"//{authority}")
    try:
        port = parts.port
    except ValueError:
        return "", None
    return (parts.hostname or "").rstrip("."), port


def host_allowed(host: str, listen: bool, names: Iterable[str] = ()) -> bool:
    if host in LOCAL_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return listen and host in names
    return address.is_loopback or listen


# What the page may load and from where; 'unsafe-inline'/'unsafe-eval' because Gradio's page needs them.
CSP = (
    "default-src 'self'; img-src 'self' data: blob:; media-src 'self' data: blob:; font-src 'self' data:; "
    "style-src 'self' 'unsafe-inline'; script-src 'self' 'unsafe-inline' 'unsafe-eval'; worker-src 'self' blob:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'self'; object-src 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


def fetch_allowed(site: str | None, mode: str | None, dest: str | None) -> bool:
    """Fetch metadata: from another site (or another port, 'same-site'), only a top-level page load."""
    if site in (None, "same-origin", "none"):
        return True
    return mode == "navigate" and dest == "document"


def allowed(host_header: str | None, origin: str | None, listen: bool, names: Iterable[str] = ()) -> bool:
    """The whole rule: a Host we serve, and no Origin or exactly our own."""
    if not host_header:
        return False
    host, port = _split(host_header)
    if not host_allowed(host, listen, names):
        return False
    if origin is None:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https"):
        return False  # "null" (sandboxed frames, file:// pages) and anything stranger
    o_host, o_port = _split(parts.netloc)
    return (o_host, o_port) == (host, port)


def api_origin_granted(origin: str | None, path: str, granted: frozenset[str]) -> bool:
    """An origin the user named with --allow-origin, calling the /v1 API (never the UI)."""
    return origin is not None and origin in granted and path.startswith(API_PREFIX)


def cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


class LocalOnlyGuard:
    """ASGI middleware: answers 403 with a sentence (HTTP) or closes (WebSocket) whatever `allowed` refuses;
    answers the preflights of the origins granted the API (`api_origins`) itself."""

    def __init__(  # noqa: ANN001 - ASGI app
        self, app, listen: bool = False, names: Iterable[str] = (), api_origins: Iterable[str] = ()
    ) -> None:
        self.app = app
        self.listen = listen
        self.names = frozenset(names)
        self.api_origins = frozenset(api_origins)

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - the ASGI signature
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        origin = headers.get("origin")
        if scope["type"] == "http" and api_origin_granted(origin, scope.get("path", ""), self.api_origins):
            host, _ = _split(headers.get("host") or "")
            if host_allowed(host, self.listen, self.names):
                await self._granted(scope, receive, send, origin, headers)
                return
        fetch = (headers.get("sec-fetch-site"), headers.get("sec-fetch-mode"), headers.get("sec-fetch-dest"))
        if allowed(headers.get("host"), origin, self.listen, self.names) and fetch_allowed(*fetch):
            await self.app(scope, receive, send if scope["type"] == "websocket" else _with_headers(send))
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        said = REFUSED
        if origin and scope.get("path", "").startswith(API_PREFIX):
            said += f" To let the app at {origin} use the API, start fmoe-local with --allow-origin {origin}"
        await answer(send, 403, said.encode(), [(b"content-type", b"text/plain; charset=utf-8")])

    async def _granted(self, scope, receive, send, origin: str, headers: dict) -> None:  # noqa: ANN001
        if scope.get("method") == "OPTIONS":  # the preflight: answered here (the inner CORS layer grants nothing)
            asked = {h.strip().lower() for h in headers.get("access-control-request-headers", "").split(",")} - {""}
            granted = set(CORS_HEADERS.split(", "))
            ok = all(h in granted or h.startswith(CORS_HEADER_PREFIX) for h in asked)
            ok = ok and headers.get("access-control-request-method", "GET") in ("GET", "POST")
            allow = ", ".join(sorted(granted | asked))  # the x-stainless-* asked for by name: a prefix cannot be listed
            extra = [
                (b"access-control-allow-methods", CORS_METHODS.encode()),
                (b"access-control-allow-headers", allow.encode("latin-1")),
                (b"access-control-max-age", b"600"),
            ]
            await answer(send, 204 if ok else 403, b"", cors_headers(origin) + extra if ok else [])
            return
        await self.app(scope, receive, _with_headers(send, cors_headers(origin)))


async def answer(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:  # noqa: ANN001
    length = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + length + SECURITY_HEADERS})
    await send({"type": "http.response.body", "body": body})


def _with_headers(send, extra: list[tuple[bytes, bytes]] = ()):  # noqa: ANN001, ANN202 - ASGI callables
    async def send_with_headers(message) -> None:  # noqa: ANN001
        if message["type"] == "http.response.start":
            ours = {name for name, _ in SECURITY_HEADERS} | {name for name, _ in extra}
            kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in ours]
            message = {**message, "headers": kept + list(extra) + SECURITY_HEADERS}
        await send(message)

    return send_with_headers
