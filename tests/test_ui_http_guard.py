"""The HTTP guard: the rule on its own, then the real app (`app.serve`) attacked as the issue did — DNS rebinding
(a foreign Host), cross-origin calls and uploads — over raw HTTP."""

from __future__ import annotations

import http.client
import json

import pytest

import app
from ui.http_guard import allowed

PORT = 7861


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
        app.build_parser().parse_args(["--no-browser", "--data-dir", str(data), "--port", str(PORT)])
    )
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
