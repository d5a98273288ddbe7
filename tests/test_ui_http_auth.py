"""--listen's access token (ui/http_auth.py): requests from another computer without the token, with a wrong one and
with the right one, on /v1 and on the page's routes; first through the guard and the gate as the server stacks
them, then on the real app (`app.serve --listen`) with the token it printed."""

from __future__ import annotations

import http.client
import json
import re

import pytest

import app
from tests.asgi_call import call, response
from tests.ports import unused_port
from ui import http_auth
from ui.http_auth import MISSING, WRONG, TokenGate, cookie_name
from ui.http_guard import LocalOnlyGuard

TOKEN = "s3cret-Token_of.this~app"
LAN_CLIENT = ("192.168.1.50", 51234)  # another computer on the network
HOST = "192.168.1.20:7860"  # this computer's address, as that computer typed it
COOKIE = cookie_name(7860)
# Every kind of route the server has: the API, the page, its assets and config, its calls, its queue, its uploads
# and its file route.
UI_ROUTES = [
    ("GET", "/"),
    ("GET", "/config"),
    ("GET", "/assets/index.js"),
    ("POST", "/gradio_api/call/search_chats"),
    ("POST", "/gradio_api/queue/join"),
    ("GET", "/gradio_api/queue/data?session_hash=x"),
    ("POST", "/gradio_api/upload"),
    ("GET", "/gradio_api/file=/etc/passwd"),
]


def _stack(method: str, target: str, headers: dict, client=LAN_CLIENT, token=TOKEN, kind="http"):
    """One request through LocalOnlyGuard(--listen) around TokenGate around an app answering 200 "ok", as
    ui/server.py stacks them: (status, headers with the body under "body", reached the app?)."""
    sent, reached = call(
        lambda app: LocalOnlyGuard(TokenGate(app, token, COOKIE), listen=True, api_origins=("app://obsidian.md",)),
        method, target, {"Host": HOST} | headers, client, kind,
    )  # fmt: skip
    if kind == "websocket":
        return sent[0], reached
    return (*response(sent), reached)


@pytest.mark.parametrize("client", [LAN_CLIENT, ("127.0.0.1", 40000)], ids=["lan", "loopback"])
def test_the_api_asks_for_the_token_in_openai_s_shape(client):
    """Before: anyone on the network used /v1 with any key (or none). Loopback too: a tunnel or proxy on this
    machine delivers other people's requests from 127.0.0.1."""
    for headers, said in (({}, MISSING), ({"Authorization": "Bearer not-the-token"}, WRONG)):
        status, got, reached = _stack("GET", "/v1/models", headers, client)
        assert (status, reached) == (401, False), headers
        error = json.loads(got["body"])["error"]
        assert error == {"message": said, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        assert got["www-authenticate"].startswith("Bearer") and "content-security-policy" in got
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        status, _, reached = _stack(method, path, {"Authorization": f"Bearer {TOKEN}"}, client)
        assert (status, reached) == (200, True)


def test_anthropic_clients_send_the_token_as_x_api_key_and_are_refused_in_anthropic_s_shape():
    """Claude Code and the Anthropic SDKs send their key as `x-api-key`: before, the gate saw no token there."""
    for headers, said in (({}, MISSING), ({"x-api-key": "not-the-token"}, WRONG)):
        status, got, reached = _stack("POST", "/v1/messages", headers)
        assert (status, reached) == (401, False), headers
        assert json.loads(got["body"]) == {"type": "error", "error": {"type": "authentication_error", "message": said}}
    for method, path in (("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("GET", "/v1/models")):
        status, _, reached = _stack(method, path, {"x-api-key": TOKEN})
        assert (status, reached) == (200, True), path


@pytest.mark.parametrize("method, path", UI_ROUTES)
def test_every_route_of_the_page_asks_for_the_token(method, path):
    """Before: anyone on the network read every chat, exported them all and loaded any folder through these."""
    for headers in ({}, {"Cookie": f"{COOKIE}=wrong-token-here"}, {"Authorization": "Bearer wrong-token-here"}):
        status, got, reached = _stack(method, path, headers)
        assert (status, reached) == (401, False), (path, headers)
        assert TOKEN not in got["body"]
    for headers in ({"Cookie": f"other=1; {COOKIE}={TOKEN}"}, {"Authorization": f"Bearer {TOKEN}"}):
        status, _, reached = _stack(method, path, headers)
        assert (status, reached) == (200, True), (path, headers)
    # The cookie of the app on another port of this host is not this one's.
    status, _, reached = _stack(method, path, {"Cookie": f"{cookie_name(7861)}={TOKEN}"})
    assert (status, reached) == (401, False)


def test_the_printed_address_signs_the_browser_in_with_a_strict_http_only_cookie():
    page = {"Accept": "text/html", "Sec-Fetch-Dest": "document", "Sec-Fetch-Mode": "navigate"}
    status, got, reached = _stack("GET", "/", page)
    assert (status, reached) == (401, False)
    assert got["content-type"].startswith("text/html") and '<form method="get" action="/">' in got["body"]
    assert 'name="token"' in got["body"] and "access token" in got["body"]
    status, got, reached = _stack("GET", "/?token=wrong-token-here", page)
    assert (status, reached) == (401, False) and "not this fmoe-local" in got["body"]
    status, got, reached = _stack("GET", f"/?token={TOKEN}", page)
    assert (status, reached) == (200, False)
    attributes = [a.strip() for a in got["set-cookie"].split(";")]
    assert attributes[0] == f"{COOKIE}={TOKEN}" and {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(attributes)
    assert 'url=/"' in got["body"] and TOKEN not in got["body"]  # on to the page, the token out of the address
    # The token in an address never signs in an API call: programs send it as their key.
    status, got, reached = _stack("GET", f"/v1/models?token={TOKEN}", {})
    assert (status, reached) == (401, False) and "set-cookie" not in got


def test_a_websocket_without_the_token_is_closed():
    message, reached = _stack("GET", "/gradio_api/ws", {}, kind="websocket")
    assert message == {"type": "websocket.close", "code": 1008} and not reached
    message, reached = _stack("GET", "/gradio_api/ws", {"Cookie": f"{COOKIE}={TOKEN}"}, kind="websocket")
    assert message["type"] == "websocket.accept" and reached


def test_an_allowed_origin_s_preflight_needs_no_token_but_its_calls_do():
    """Browsers send no credentials with a preflight, so it is answered before the gate; the call itself is not."""
    mine = {"Origin": "app://obsidian.md"}
    asks = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    status, got, reached = _stack("OPTIONS", "/v1/chat/completions", mine | asks)
    assert (status, reached) == (204, False)
    status, got, reached = _stack("POST", "/v1/chat/completions", mine)
    assert (status, reached) == (401, False) and got["access-control-allow-origin"] == "app://obsidian.md"
    status, _, reached = _stack("POST", "/v1/chat/completions", mine | {"Authorization": f"Bearer {TOKEN}"})
    assert (status, reached) == (200, True)


def test_the_host_rule_still_answers_first():
    status, _, reached = _stack("GET", "/v1/models", {"Host": "evil.example:7860", "Authorization": f"Bearer {TOKEN}"})
    assert (status, reached) == (403, False)


def test_without_a_token_nothing_is_asked():
    for method, path in UI_ROUTES + [("GET", "/v1/models")]:
        status, _, reached = _stack(method, path, {}, ("127.0.0.1", 40000), token=None)
        assert (status, reached) == (200, True), path


def test_tokens_are_compared_in_constant_time(monkeypatch):
    compared = []
    real = http_auth.hmac.compare_digest
    monkeypatch.setattr(http_auth.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    assert _stack("GET", "/v1/models", {"Authorization": "Bearer guess"})[0] == 401
    assert (b"guess", TOKEN.encode()) in compared


def test_listen_makes_a_new_token_and_api_key_names_one():
    parse = app.build_parser().parse_args
    assert app.access_token(parse([])) is None  # local use: no token asked, as before
    made = {app.access_token(parse(["--listen"])) for _ in range(3)}
    assert len(made) == 3 and all(len(t) >= 40 for t in made)
    assert app.access_token(parse(["--listen", "--api-key", TOKEN])) == TOKEN
    assert app.access_token(parse(["--api-key", TOKEN])) == TOKEN  # asked for locally too, as the user chose


@pytest.mark.parametrize("key, said", [("short", "at least 12 characters"), ("has a space in it", "' '")])
def test_api_key_refuses_a_key_that_cannot_be_one_in_a_sentence(key, said, capsys):
    with pytest.raises(SystemExit):
        app.build_parser().parse_args(["--listen", "--api-key", key])
    assert said in capsys.readouterr().err


def _request(port: int, method: str, path: str, headers: dict, body: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Host": f"192.168.1.20:{port}"} | headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def test_listen_serves_only_whoever_has_the_printed_token(tmp_path, capsys):
    """The real app with --listen: the token printed at start opens the page and the API; nothing else does."""
    args = ["--no-browser", "--listen", "--data-dir", str(tmp_path), "--port", str(unused_port())]
    server, session, url = app.serve(app.build_parser().parse_args(args))
    try:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        body = json.dumps({"data": ["secret"]}).encode()
        call = {"Content-Type": "application/json"}
        for headers in ({}, {"Authorization": "Bearer wrong-token-here"}):
            status, got, text = _request(port, "GET", "/v1/models", headers)
            assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
            assert _request(port, "GET", "/", headers | {"Accept": "text/html"})[0] == 401
            assert _request(port, "POST", "/gradio_api/call/search_chats", headers | call, body)[0] == 401
        printed = capsys.readouterr().out
        token = re.search(r"access token (\S+) — open http://\S+:(\d+)/\?token=(\S+) ", printed)
        assert token and token[2] == str(port) and token[3] == token[1], printed
        token = token[1]
        status, _, text = _request(port, "GET", "/v1/models", {"Authorization": f"Bearer {token}"})
        assert status == 200 and json.loads(text)["object"] == "list"
        status, got, _ = _request(port, "GET", f"/?token={token}", {"Accept": "text/html"})
        assert status == 200 and "SameSite=Strict" in got["set-cookie"]
        cookie = {"Cookie": got["set-cookie"].split(";")[0]}
        status, _, text = _request(port, "GET", "/", cookie | {"Accept": "text/html"})
        assert status == 200 and b"<html" in text.lower()
        status, _, text = _request(port, "POST", "/gradio_api/call/search_chats", cookie | call, body)
        assert status == 200 and b"event_id" in text
        # The Anthropic API behind the same gate: its key as x-api-key reaches it. A body that is not JSON gets the
        # same answer whether the demo model is still loading or not: a 400 in Anthropic's shape, from the route.
        status, _, text = _request(port, "POST", "/v1/messages", call, b"{")
        assert status == 401 and json.loads(text)["error"]["type"] == "authentication_error"
        status, _, text = _request(port, "POST", "/v1/messages", call | {"x-api-key": token}, b"{")
        assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error", text
        assert session.api_key_required
    finally:
        server.close()
        session.close()
        session.store.close()
