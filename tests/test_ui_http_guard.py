"""The HTTP guard: the rule on its own, then the real app (`app.serve`) attacked as the issue did — DNS rebinding
(a foreign Host), cross-origin calls and uploads — over raw HTTP."""

from __future__ import annotations

import http.client
import json

import pytest

import app
from tests.ports import unused_port
from ui.http_guard import allowed, fetch_allowed


@pytest.mark.parametrize(
    "host, origin, listen, ok",
    [
        ("127.0.0.1:7861", None, False, True),  # curl, the openai client: no Origin
        ("localhost:7861", "http://localhost:7861", False, True),  # our own page
        ("[::1]:7861", "http://[::1]:7861", False, True),
        ("evil.example:7861", "http://evil.example:7861", False, False),  # DNS rebinding
        ("evil.example:7861", None, False, False),
        ("127.0.0.1:7861", "http://evil.example", False, False),  # a cross-site form or no-cors upload
        ("127.0.0.1:7861", "http://localhost:3000", False, False),  # another local app's page
        ("127.0.0.1:7861", "http://127.0.0.1:7862", False, False),  # another port is another origin
        ("127.0.0.1:7861", "null", False, False),  # sandboxed frames, file:// pages
        (None, None, False, False),
        ("192.168.1.20:7861", None, False, False),  # a LAN address without --listen
        ("192.168.1.20:7861", "http://192.168.1.20:7861", True, True),  # with --listen: the address typed
        ("evil.example:7861", "http://evil.example:7861", True, False),  # names still cannot rebind
        ("localhost.evil.example:7861", None, False, False),  # look-alikes of our names
        ("127.0.0.1.evil.example:7861", None, False, False),
        ("127.0.0.1:7861@evil.example", None, False, False),
        ("127.1:7861", None, False, False),  # shorthand an address parser may read as loopback: not ours to guess
    ],
)
def test_rule(host, origin, listen, ok):
    assert allowed(host, origin, listen) is ok


def test_listen_accepts_this_machine_s_own_name():
    assert allowed("mybox.local:7861", "http://mybox.local:7861", True, {"mybox", "mybox.local"})
    assert not allowed("mybox.local:7861", None, False, {"mybox", "mybox.local"})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    data = tmp_path_factory.mktemp("guard-data")
    server, session, url = app.serve(
        app.build_parser().parse_args(["--no-browser", "--data-dir", str(data), "--port", str(unused_port())])
    )
    assert session.loading is None or session.loading.finished.wait(120)  # the start-up load runs on its own thread
    session.store.chats.append(session.store.chats.create("my secret plans").id, "user", "the secret itself")
    yield int(url.rstrip("/").rsplit(":", 1)[1])
    server.close()
    session.close()
    session.store.close()


def _request(port: int, method: str, path: str, headers: dict, body: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_dns_rebinding_cannot_read_the_chat_list(served):
    port = served
    body = json.dumps({"data": ["secret"]}).encode()
    evil = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}", "Content-Type": "application/json"}
    status, headers, text = _request(port, "POST", "/gradio_api/call/search_chats", evil, body)
    assert status == 403 and b"refused" in text
    assert not any(k.lower() == "access-control-allow-origin" for k in headers)
    # The same call from a program on this machine works: the refusal is the Host, not the endpoint.
    local = {"Host": f"127.0.0.1:{port}", "Content-Type": "application/json"}
    status, _, text = _request(port, "POST", "/gradio_api/call/search_chats", local, body)
    assert status == 200 and b"event_id" in text


def test_a_cross_origin_upload_is_refused_and_a_same_origin_one_is_size_limited(served):
    port = served
    boundary = "x1y2z3"

    def multipart(size: int) -> bytes:
        return (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="a.bin"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n"
            ).encode()
            + b"a" * size
            + f"\r\n--{boundary}--\r\n".encode()
        )

    headers = {"Host": f"127.0.0.1:{port}", "Content-Type": f"multipart/form-data; boundary={boundary}"}
    status, _, _ = _request(
        port, "POST", "/gradio_api/upload", headers | {"Origin": "http://evil.example"}, multipart(10)
    )
    assert status == 403
    status, _, _ = _request(
        port, "POST", "/gradio_api/upload", headers | {"Origin": f"http://127.0.0.1:{port}"}, multipart(6 * 1024**2)
    )
    assert status == 413  # over the 5 MB limit, even from our own page


def test_the_page_itself_is_served_to_our_own_origin(served):
    status, headers, _ = _request(served, "GET", "/", {"Host": f"127.0.0.1:{served}"})
    assert status == 200
    status, headers, _ = _request(
        served, "GET", "/", {"Host": f"localhost:{served}", "Origin": f"http://localhost:{served}"}
    )
    assert status == 200 and not any(k.lower() == "access-control-allow-origin" for k in headers)


@pytest.mark.parametrize(
    "site, mode, dest, ok",
    [
        (None, None, None, True),  # programs, older browsers
        ("same-origin", "cors", "empty", True),  # our own page's calls
        ("none", "navigate", "document", True),  # the user typed the address
        ("cross-site", "navigate", "document", True),  # a link the user followed
        ("cross-site", "no-cors", "image", False),  # <img src=http://127.0.0.1:7861/…> on another site
        ("cross-site", "no-cors", "script", False),
        ("cross-site", "navigate", "iframe", False),  # framing the app to trick clicks
        ("same-site", "no-cors", "image", False),  # another port on this machine is another site's page
    ],
)
def test_fetch_metadata_rule(site, mode, dest, ok):
    assert fetch_allowed(site, mode, dest) is ok


def test_a_cross_site_page_cannot_include_or_frame_the_app(served):
    """Before: 200 — another site's <script>/<img>/<iframe> reached every URL (no Origin is sent with them)."""
    port = served
    for dest, mode in (("script", "no-cors"), ("image", "no-cors"), ("iframe", "navigate")):
        headers = {"Host": f"127.0.0.1:{port}", "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": mode}
        status, _, text = _request(port, "GET", "/config", headers | {"Sec-Fetch-Dest": dest})
        assert status == 403 and b"refused" in text, dest
    link = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
    status, _, _ = _request(port, "GET", "/", {"Host": f"127.0.0.1:{port}"} | link)
    assert status == 200  # following a link to the app still opens it


def test_every_answer_tells_the_browser_to_load_nothing_from_elsewhere(served):
    """Before: no policy, so whatever a message slipped past the renderer could fetch any URL, and any site could
    frame the app."""
    port = served
    for path in ("/", "/config", "/gradio_api/info"):
        status, headers, _ = _request(port, "GET", path, {"Host": f"127.0.0.1:{port}"})
        headers = {k.lower(): v for k, v in headers.items()}
        policy = dict(p.strip().split(" ", 1) for p in headers["content-security-policy"].split(";"))
        assert policy["img-src"] == "'self' data: blob:" and policy["connect-src"] == "'self'", path
        assert policy["frame-ancestors"] == "'none'" and policy["form-action"] == "'self'"
        assert headers["x-frame-options"] == "DENY"
    _, headers, _ = _request(port, "GET", "/", {"Host": f"evil.example:{port}"})
    assert "content-security-policy" in {k.lower() for k in headers}  # the refusal carries it too


def test_the_v1_api_is_behind_the_same_guard(served):
    """A page's `fetch(…/v1/chat/completions, {mode: 'no-cors', body})` is a simple request (no preflight): it would
    run the model for the page and, by rebinding, read the answer."""
    port = served
    body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]}).encode()
    plain = {"Content-Type": "text/plain"}
    for headers in (
        {"Host": f"127.0.0.1:{port}", "Origin": "https://evil.example"},
        {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"},
    ):
        status, _, text = _request(port, "POST", "/v1/chat/completions", headers | plain, body)
        assert status == 403 and b"refused" in text
    status, _, _ = _request(port, "GET", "/v1/models", {"Host": f"127.0.0.1:{port}"})
    assert status == 200  # a program on this machine still reaches it


def test_the_file_route_serves_neither_the_chats_nor_any_other_file(served, tmp_path_factory):
    """With --listen the LAN reaches the app: Gradio's file route must not hand out the database or the disk."""
    port = served
    local = {"Host": f"127.0.0.1:{port}"}
    database = next(tmp_path_factory.getbasetemp().glob("guard-data*/**/*.db"))
    for path in (database, "/etc/passwd", "app.py"):
        status, _, text = _request(port, "GET", f"/gradio_api/file={path}", local)
        assert status == 403 and b"not allowed" in text, path


def _through_guard(method: str, path: str, headers: dict, api_origins=("app://obsidian.md",)):
    """One request through LocalOnlyGuard around an app that answers 200 "ok": (status, headers, reached app?)."""
    from tests.asgi_call import call, response
    from ui.http_guard import LocalOnlyGuard

    sent, reached = call(lambda app: LocalOnlyGuard(app, api_origins=api_origins), method, path, headers)
    return (*response(sent), reached)


def test_an_origin_the_user_allowed_may_call_the_api_and_nothing_else():
    mine = {"Host": "127.0.0.1:7860", "Origin": "app://obsidian.md"}
    preflight = mine | {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    status, headers, reached = _through_guard("OPTIONS", "/v1/chat/completions", preflight)
    assert (status, reached) == (204, False) and headers["access-control-allow-origin"] == "app://obsidian.md"
    status, headers, reached = _through_guard("POST", "/v1/chat/completions", mine | {"Sec-Fetch-Site": "cross-site"})
    assert (status, reached) == (200, True) and headers["access-control-allow-origin"] == "app://obsidian.md"
    assert "content-security-policy" in headers
    # Never the UI; never another origin; never a rebinding Host; never a header clients do not need.
    for method, path, headers in (
        ("GET", "/gradio_api/info", mine),
        ("POST", "/v1/chat/completions", mine | {"Origin": "https://evil.example"}),
        ("POST", "/v1/chat/completions", mine | {"Host": "evil.example:7860"}),
        ("OPTIONS", "/v1/models", preflight | {"Access-Control-Request-Headers": "x-evil"}),
    ):
        status, headers, reached = _through_guard(method, path, headers)
        assert (status, reached) == (403, False) and "access-control-allow-origin" not in headers, (path, headers)
    # The headers the Anthropic and OpenAI SDKs send from a browser are granted, by name.
    sdk = "x-api-key,anthropic-version,anthropic-dangerous-direct-browser-access,content-type,x-stainless-os"
    status, headers, reached = _through_guard(
        "OPTIONS", "/v1/messages", preflight | {"Access-Control-Request-Headers": sdk}
    )
    assert (status, reached) == (204, False) and headers["access-control-allow-origin"] == "app://obsidian.md"
    assert set(sdk.split(",")) <= {h.strip() for h in headers["access-control-allow-headers"].split(",")}
    status, _, reached = _through_guard(
        "OPTIONS", "/v1/messages", preflight | {"Access-Control-Request-Headers": "x-api-key,cookie"}
    )
    assert (status, reached) == (403, False)
    # Without --allow-origin it is refused, and the refusal says how to allow it.
    status, headers, reached = _through_guard("POST", "/v1/chat/completions", mine, api_origins=())
    assert (status, reached) == (403, False)
    assert "start fmoe-local with --allow-origin app://obsidian.md" in headers["body"]


def test_an_allowed_origin_gets_through_the_whole_served_stack(tmp_path):
    """The inner CORS layer (which grants nothing) must not undo the guard's grant: a real server, a real request."""
    args = [
        "--no-browser",
        "--data-dir",
        str(tmp_path),
        "--port",
        str(unused_port()),
        "--allow-origin",
        "app://obsidian.md",
    ]
    server, session, url = app.serve(app.build_parser().parse_args(args))
    try:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        mine = {"Host": f"127.0.0.1:{port}", "Origin": "app://obsidian.md"}
        asks = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        status, headers, _ = _request(port, "OPTIONS", "/v1/chat/completions", mine | asks)
        assert status == 204 and headers.get("access-control-allow-origin") == "app://obsidian.md", headers
        status, headers, body = _request(port, "GET", "/v1/models", mine)
        assert status == 200 and headers.get("access-control-allow-origin") == "app://obsidian.md", headers
        status, _, _ = _request(port, "GET", "/", mine | {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"})
        assert status == 403  # the page and its internal API stay its own
    finally:
        server.close()
        session.close()
        session.store.close()


def test_allow_origin_takes_an_origin_and_refuses_everything_wider():
    args = app.build_parser().parse_args(
        ["--allow-origin", "http://localhost:3000/", "--allow-origin", "app://obsidian.md"]
    )
    assert args.allow_origin == ["http://localhost:3000", "app://obsidian.md"]
    for wide in ("*", "null", "localhost:3000", "http://localhost:3000/chat"):
        with pytest.raises(SystemExit):
            app.build_parser().parse_args(["--allow-origin", wide])
