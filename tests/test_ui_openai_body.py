"""Request bodies no request needs, against the real app (`app.serve` on a tiny model): a body larger than any
context is refused (413) before it is read, and a body whose JSON holds what nothing can represent (nesting
100,000 deep, a seed of 2**80, a lone surrogate, NaN) is a 400 in OpenAI's error shape, wherever the value is."""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import threading

import httpx
import pytest

from tests.api_server import serving
from ui.body_limit import MAX_BODY_BYTES, BodyLimit
from ui.openai_request import ApiError, read_body

PROMPT = [{"role": "user", "content": "Tell me about the sea and the ships."}]
OVER = MAX_BODY_BYTES + 1


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    with serving(tiny_model_dir("mixtral"), tmp_path_factory.mktemp("api-body-data")) as served:
        yield served


def _chunks(total: int, first: bytes = b'{"model": "x", "max_tokens": 2, "pad": "'):
    """A valid chat body of about `total` bytes, sent without a Content-Length (chunked), 1 MiB at a time."""
    yield first
    left = total - len(first)
    while left > 0:
        piece = min(left, 1 << 20)
        yield b"a" * piece
        left -= piece
    yield b'", "messages": ' + json.dumps(PROMPT).encode() + b"}"


def test_a_declared_length_over_the_limit_is_refused_before_a_byte_is_read(served):
    server, _, _ = served
    before = len(server.api.finished)
    host, port = server.url.split("//")[1].rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as conn:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {OVER}\r\n\r\n"
        )
        conn.sendall(head.encode())  # and no body: was a wait for the 16 MB that never come (this test timed out)
        answer = conn.makefile("rb")
        status = answer.readline()
        headers = {}
        while (line := answer.readline().strip()) != b"":
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        body = answer.read(int(headers[b"content-length"]))
    assert b" 413 " in status, status
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "larger than 16 MB" in error["message"]
    assert len(server.api.finished) == before


@pytest.mark.parametrize("path", ["v1/chat/completions", "gradio_api/queue/join"])
def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives(served, path):
    server, _, _ = served
    before = len(server.api.finished)
    r = httpx.post(
        f"{server.url}{path}", content=_chunks(OVER), headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 413, (r.status_code, r.text[:200])  # was: 200 (a valid body, parsed whole), or Gradio's
    if path.startswith("v1/"):
        assert r.json()["error"]["code"] == "request_too_large"
    else:
        assert r.headers["content-type"].startswith("text/plain") and "larger than 16 MB" in r.text
    assert len(server.api.finished) == before  # the handler never ran


def test_a_body_within_the_limit_is_served_and_others_go_on_while_one_arrives(served):
    server, _, _ = served
    gate, sent = threading.Event(), threading.Event()

    def slow():  # half a body, then a pause: the server awaits the rest without holding anyone up
        pieces = _chunks(4 << 20)
        yield next(pieces)
        sent.set()
        gate.wait(30)
        yield from pieces

    result = {}
    sender = threading.Thread(
        target=lambda: result.update(r=httpx.post(f"{server.url}v1/chat/completions", content=slow(), timeout=60))
    )
    sender.start()
    assert sent.wait(30)
    assert httpx.get(f"{server.url}v1/models", timeout=10).status_code == 200
    gate.set()
    sender.join(60)
    assert result["r"].status_code == 200, result["r"].text[:200]


def test_the_limit_counts_the_bytes_that_arrive_and_hands_the_rest_on():
    async def run(chunks: list[bytes], limit: int) -> tuple[list, list]:
        seen, sent = [], []
        incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
        incoming.append({"type": "http.disconnect"})

        async def receive():
            return incoming.pop(0)

        async def send(message):
            sent.append(message)

        async def app(scope, receive, send):
            seen.append(await receive())
            seen.append(await receive())  # after the body: the connection's own events (a disconnect)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        await BodyLimit(app, limit=10)(scope, receive, send)
        return seen, sent

    seen, sent = asyncio.run(run([b"12345", b"", b"6789"], 10))
    assert seen == [{"type": "http.request", "body": b"123456789", "more_body": False}, {"type": "http.disconnect"}]
    assert sent == []
    seen, sent = asyncio.run(run([b"12345", b"678901"], 10))
    assert seen == [] and sent[0]["status"] == 413


def test_a_body_over_the_limit_under_v1_messages_is_refused_in_anthropic_s_shape():
    async def run(path: str) -> list:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        headers = [(b"content-length", str(OVER).encode())]
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        await BodyLimit(lambda *a: None, limit=MAX_BODY_BYTES)(scope, receive, send)
        return sent

    sent = asyncio.run(run("/v1/messages"))
    body = json.loads(sent[1]["body"])
    assert sent[0]["status"] == 413 and body["type"] == "error"
    assert body["error"]["type"] == "request_too_large" and "larger than 16 MB" in body["error"]["message"]
    assert "code" in json.loads(asyncio.run(run("/v1/chat/completions"))[1]["body"])["error"]  # OpenAI's shape


NESTED_70 = functools.reduce(lambda inner, _: [inner], range(70), [])
DEEP = b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def _body(**fields) -> bytes:
    return json.dumps({"model": "x", "messages": PROMPT, "max_tokens": 2} | fields).encode()


@pytest.mark.parametrize(
    "raw, param, said",
    [
        (DEEP, None, "nested more than 64 levels"),  # was: RecursionError, "Internal Server Error" as text
        (_body(metadata=NESTED_70), "metadata", "nested"),  # a field the app ignores: was taken
        (_body(seed=2**80), "seed", "outside the whole numbers"),  # was: a 500, OverflowError in torch
        (_body(max_tokens=2**80), "max_tokens", "outside the whole numbers"),  # was: taken
        (_body(n=-(2**64)), "n", "outside the whole numbers"),
        (_body().replace(b'"max_tokens": 2', b'"max_tokens": ' + b"9" * 5000), "max_tokens", "5,000 digits"),
        (_body(messages=[{"role": "user", "content": "a\ud800b"}]), "messages", "not valid Unicode"),  # was: a 500
        (_body(stop=["\udc00"]), "stop", "not valid Unicode"),
        (_body(user={"\ud800": 1}), "user", "field name"),
        (_body().replace(b"Tell", b"\xff\xfeTell"), None, "not UTF-8"),
        (_body().replace(b'"max_tokens": 2', b'"frequency_penalty": NaN'), "frequency_penalty", "not a finite"),
        (_body().replace(b'"max_tokens": 2', b'"presence_penalty": -Infinity'), "presence_penalty", "not a finite"),
        (_body().replace(b'"max_tokens": 2', b'"temperature": 1e999'), "temperature", "not a finite"),
    ],
    ids=[
        "deep-100000",
        "deep-70-ignored",
        "seed-2**80",
        "max_tokens-2**80",
        "n--2**64",
        "5000-digits",
        "surrogate-content",
        "surrogate-stop",
        "surrogate-key",
        "not-utf8",
        "nan",
        "-infinity",
        "1e999",
    ],
)
def test_a_value_nothing_can_represent_is_an_openai_shaped_400(served, raw, param, said):
    server, _, _ = served
    before = len(server.api.finished)
    r = httpx.post(
        f"{server.url}v1/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", (r.status_code, r.text[:200])
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and said in error["message"], error
    assert len(server.api.finished) == before


def test_whole_numbers_of_64_bits_and_valid_text_are_taken():
    body = read_body(_body(seed=2**63 - 1, stop=["\U0001f600"], messages=[{"role": "user", "content": "é😀"}]))
    assert body["seed"] == 2**63 - 1 and body["stop"] == ["😀"]
    assert read_body(b'{"a": "\\ud83d\\ude00"}') == {"a": "😀"}  # a surrogate pair is one whole character
    assert read_body(_body(seed=-(2**63)))["seed"] == -(2**63)


def test_an_error_that_quotes_broken_text_still_encodes():
    r = ApiError(400, "half a character: \ud800").response()  # was: UnicodeEncodeError, a bare 500
    assert r.status_code == 400 and json.loads(r.body)["error"]["message"].endswith("\ud800")
