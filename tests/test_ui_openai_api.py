"""The /v1 API through the official openai client against the real app (`app.serve` on a tiny model): plain and
streamed replies agree, usage is counted, stop sequences cut, concurrent requests queue, errors have OpenAI's
shape, a disconnected client stops its generation, and nothing lands in the user's chat list."""

from __future__ import annotations

import http.client
import json
import os
import queue
import socket
import threading
import time

import pytest

from tests.api_server import serving
from tests.fake_runtime import FakeRuntime

openai = pytest.importorskip("openai")

PROMPT = [{"role": "user", "content": "Tell me about the sea and the ships."}]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    with serving(tiny_model_dir("mixtral"), tmp_path_factory.mktemp("api-data")) as served:
        yield served


def test_models_lists_the_loaded_model(served):
    _, session, client = served
    assert [m.id for m in client.models.list().data] == [session.runtime.info.name]


def test_plain_and_streamed_replies_agree_and_count_usage(served):
    _, session, client = served
    plain = client.chat.completions.create(model="x", messages=PROMPT, max_tokens=8, temperature=0)
    text = plain.choices[0].message.content
    assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
    assert plain.usage.completion_tokens <= 8 and plain.usage.prompt_tokens > 0
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    assert plain.choices[0].finish_reason == ("length" if plain.usage.completion_tokens == 8 else "stop")
    chunks = list(
        client.chat.completions.create(
            model="x", messages=PROMPT, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the same reply either way
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    # The same prompt again: all but its last token came from the first request's kept KV cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens - 1
    assert session.store.chats.list() == []  # API chats are not the user's chats


def test_a_stop_sequence_cuts_the_reply(served):
    _, _, client = served
    full = client.chat.completions.create(model="x", messages=PROMPT, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    cut_at = text[len(text) // 2 :][:3]
    assert cut_at.strip(), text
    for stream in (False, True):
        kw = dict(model="x", messages=PROMPT, max_tokens=24, temperature=0, stop=[cut_at])
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = client.chat.completions.create(**kw)
            got, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert got == text[: text.index(cut_at)] and reason == "stop"


def test_concurrent_requests_queue_behind_the_one_model(served):
    _, _, client = served
    results, errors = [], []

    def ask() -> None:
        try:
            results.append(client.chat.completions.create(model="x", messages=PROMPT, max_tokens=6, temperature=0))
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and len(results) == 4
    assert len({r.choices[0].message.content for r in results}) == 1  # one model, one at a time, greedy


def test_bad_requests_get_openai_shaped_errors(served):
    _, _, client = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="x", messages=PROMPT, n=2)
    assert "Only n=1" in caught.value.body["message"] and caught.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=PROMPT, temperature=7)


def test_a_client_that_disconnects_stops_its_generation(served):
    server, _, _ = served
    port = int(server.url.rstrip("/").rsplit(":", 1)[1])
    recent = server.api.finished  # (finish reason, tokens) of recent API requests
    before = len(recent)
    body = json.dumps({"model": "x", "messages": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event: generation has started
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-reply (close() alone waits for the reader)
    response.close()
    conn.close()
    deadline = time.monotonic() + 60
    while len(recent) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    reason, tokens = recent[-1]
    assert reason == "cancelled" and tokens < 400


def test_a_request_that_meets_a_model_being_unloaded_gets_the_sentence(served, tiny_model_dir):
    from fmoe_local.config import RuntimeConfig
    from fmoe_local.runtime import CLOSED, Runtime

    _, session, client = served
    closing = Runtime.load(tiny_model_dir("qwen2_moe"), RuntimeConfig(device="cpu"))
    closing.close()  # Load was pressed: the old runtime is closed, and the session still holds it for a moment
    current, session.runtime = session.runtime, closing
    try:
        with pytest.raises(openai.InternalServerError) as plain:  # was: a bare "Internal Server Error"
            client.chat.completions.create(model="x", messages=PROMPT, max_tokens=4)
        assert CLOSED in str(plain.value)
        with pytest.raises(openai.APIError, match="unloaded before this request ran"):  # was: a stream cut short
            list(client.chat.completions.create(model="x", messages=PROMPT, max_tokens=4, stream=True))
    finally:
        session.runtime = current
    after = client.chat.completions.create(model="x", messages=PROMPT, max_tokens=2)  # the loaded model answers
    assert after.choices[0].finish_reason in ("length", "stop") and after.usage.completion_tokens > 0


def _long_stream(client):
    return client.chat.completions.create(model="x", messages=PROMPT, max_tokens=300, temperature=0, stream=True)


def test_the_chat_s_stop_leaves_an_api_client_s_reply_alone(served):
    from ui import build

    server, session, client = served
    chat_stop = next(f for f in build(session).fns.values() if f.api_name == "stop").fn  # the chat tab's Stop
    assert not session.chat_replies  # no chat reply: Stop has nothing of its own to end
    chunks = iter(_long_stream(client))
    assert next(chunks).choices[0].delta.role == "assistant"
    chat_stop()  # before the fix: ended whatever ran, and the client saw a short reply reported as complete
    rest = list(chunks)
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] in ("length", "stop")
    assert server.api.finished[-1][0] != "cancelled"  # the runtime's own reason: it ran to its end


def test_an_api_reply_cut_by_an_unload_is_an_error_not_a_complete_reply(served):
    from fmoe_local.runtime_types import Finished, TextDelta
    from fmoe_local.stats import RequestStats
    from ui.openai_stream import INTERRUPTED

    _, session, client = served

    class UnloadedMidReply(FakeRuntime):
        """A reply that a model unload ended after its first words (a stop the client did not ask for)."""

        info = session.runtime.info
        chat_template = None  # no thinking format: the reply is content

        def events(self, messages, sampling, stop):
            yield TextDelta("Once upon", 7)
            yield Finished("Once upon", [7], RequestStats(finish_reason="cancelled"), "cancelled")

    loaded, session.runtime = session.runtime, UnloadedMidReply()
    try:
        chunks = client.chat.completions.create(model="x", messages=PROMPT, max_tokens=300, stream=True)
        with pytest.raises(openai.APIError, match="interrupted because the model was unloaded"):
            list(chunks)  # before: a normal end, finish_reason "stop", as if the reply were complete
        with pytest.raises(openai.InternalServerError) as plain:
            client.chat.completions.create(model="x", messages=PROMPT, max_tokens=300)
        assert INTERRUPTED in str(plain.value)
    finally:
        session.runtime = loaded


def test_a_reply_cut_by_the_model_s_context_is_length_in_openai_s_terms(served):
    from fmoe_local.runtime_types import Finished, TextDelta
    from fmoe_local.stats import RequestStats

    _, session, client = served

    class ContextFull(FakeRuntime):
        """A reply the model's context ended (the runtime's own reason "context")."""

        info = session.runtime.info
        chat_template = None  # no thinking format: the reply is content

        def events(self, messages, sampling, stop):
            yield TextDelta("Once upon", 7)
            yield Finished("Once upon", [7], RequestStats(finish_reason="context"), "context")

    loaded, session.runtime = session.runtime, ContextFull()
    try:
        plain = client.chat.completions.create(model="x", messages=PROMPT, max_tokens=300)
        assert plain.choices[0].finish_reason == "length" and plain.choices[0].message.content == "Once upon"
        chunks = list(client.chat.completions.create(model="x", messages=PROMPT, max_tokens=300, stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    finally:
        session.runtime = loaded


class _OneAtATime(FakeRuntime):
    """A runtime that serves one request at a time, like the real one: the first request writes each word only when
    the test hands it one; the others wait for their turn, counted in `waiting`."""

    chat_template = None  # no thinking format: the reply is content

    def __init__(self, info) -> None:  # noqa: ANN001
        super().__init__()
        self.info, self.words = info, queue.Queue()
        self.waiting, self.served, self._count = 0, 0, threading.Lock()

    def submit(self, prompt, sampling=None, tools=None, keep=frozenset(), variables=None):  # noqa: ANN001, ANN201
        with self._count:
            self.waiting += self.served > 0
            self.served += 1
        return super().submit(prompt, sampling, tools, keep, variables)

    def events(self, messages, sampling, stop):  # noqa: ANN001, ANN201
        from fmoe_local.runtime_types import Finished, TextDelta
        from fmoe_local.stats import RequestStats

        first = self.served == 1 and self.words is not None
        words = iter(lambda: self.words.get(timeout=60), None) if first else iter(["ok"])
        text, ids = "", []
        for word in words:
            text, ids = text + word, [*ids, len(ids)]
            yield TextDelta(word, ids[-1])
        self.words = None  # the first reply has ended: the others answer "ok"
        yield Finished(text, ids, RequestStats(prompt_tokens=3, finish_reason="stop"), "stop")


def test_a_reply_keeps_streaming_while_many_requests_wait_their_turn(served):
    """Before the fix each waiting request held one of the event loop's executor threads (asyncio.to_thread on its
    queue); with them all taken, the reply being generated found no thread to read its next word and froze (for
    good here, since the others wait for it). More waiting requests than the executor has threads shows it: the
    handles are iterated on the event loop itself, so a waiting request holds no thread of the server's."""
    import httpx

    server, session, _ = served
    url = f"{server.url}v1/chat/completions"
    fake = _OneAtATime(session.runtime.info)
    waiters = min(32, (os.cpu_count() or 1) + 4) + 2  # ThreadPoolExecutor's default size, and more
    answers = []

    def wait_for_turn() -> None:
        answers.append(httpx.post(url, json={"model": "x", "messages": PROMPT}, timeout=120).status_code)

    loaded, session.runtime = session.runtime, fake
    others = [threading.Thread(target=wait_for_turn) for _ in range(waiters)]
    try:
        body = {"model": "x", "messages": PROMPT, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=httpx.Timeout(120, read=20)) as r:
            lines = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
            assert next(lines)["choices"][0]["delta"]["role"] == "assistant"
            for t in others:
                t.start()
            deadline = time.monotonic() + 60
            while fake.waiting < waiters and time.monotonic() < deadline:
                time.sleep(0.02)
            assert fake.waiting == waiters
            for i in range(4):  # each word reaches the client while all the others wait
                fake.words.put(f"w{i} ")
                assert next(lines)["choices"][0]["delta"]["content"] == f"w{i} "
            fake.words.put(None)
            assert [c["choices"][0]["finish_reason"] for c in lines] == ["stop"]
        for t in others:
            t.join(120)
        assert answers == [200] * waiters  # and then each got its turn
    finally:
        if fake.words is not None:
            fake.words.put(None)
        session.runtime = loaded
