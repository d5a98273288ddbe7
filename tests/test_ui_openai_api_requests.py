"""The /v1 API's answers to requests it cannot serve as asked: a prompt the model cannot take is a 400 (before a
stream's 200), never a 500 that OpenAI's client retries. Served by the real app (`app.serve`) on a tiny Mixtral
whose chat template is Mixtral-Instruct's strict one (roles alternate after one optional system message)."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from fmoe_local.config import Sampling
from tests.api_server import serving

openai = pytest.importorskip("openai")

PROMPT = [{"role": "user", "content": "Tell me about the sea and the ships."}]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("api-requests-data")
    with serving(tiny_model_dir("mixtral"), data, strict_template=True) as served:
        yield served


def _post(server, **body) -> httpx.Response:
    body = {"model": "x", "messages": PROMPT, "max_tokens": 2} | body
    return httpx.post(f"{server.url}v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_context_is_a_400_before_anything_runs(served, stream):
    server, _, client = served
    before = len(server.api.finished)
    too_long = [{"role": "user", "content": "sea ships " * 3000}]
    with pytest.raises(openai.BadRequestError) as caught:  # was: 500 server_error, which the client retries twice
        client.chat.completions.create(model="x", messages=too_long, max_tokens=2, stream=stream)
    assert caught.value.status_code == 400 and caught.value.code == "context_length_exceeded"
    assert caught.value.body["param"] == "messages" and "tokens long, but" in caught.value.body["message"]
    assert len(server.api.finished) == before  # refused before it was queued: nothing ran


@pytest.mark.parametrize("stream", [False, True])
def test_messages_the_chat_template_refuses_are_a_400(served, stream):
    server, _, _ = served
    twice = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    r = _post(server, messages=twice, stream=stream)  # streaming too: a 400 status, not a 200 and an error event
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert "must alternate" in error["message"]


def test_a_system_prompt_and_a_developer_message_become_one_system_message(served):
    from ui.openai_request import parse_chat

    _, _, client = served
    both = [
        {"role": "system", "content": "You are brief."},
        {"role": "developer", "content": "Context: ships float."},
        *PROMPT,
    ]
    assert parse_chat({"messages": both}, Sampling(max_new_tokens=8)).prompt == [
        {"role": "system", "content": "You are brief.\n\nContext: ships float."},
        *PROMPT,
    ]
    reply = client.chat.completions.create(model="x", messages=both, max_tokens=2)  # the strict template takes it
    assert reply.choices[0].finish_reason in ("length", "stop")


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "extra, param",
    [
        # Mixtral's strict template shows the model no tools: it could never call them, whatever tool_choice says
        ({"tools": [TOOL]}, "tools"),
        ({"tools": [TOOL], "tool_choice": "required"}, "tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice"),  # no such tool
        ({"functions": [TOOL["function"]]}, "functions"),
        ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),  # no schema
        ({"logit_bias": {"word": 3}}, "logit_bias"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"messages": [*PROMPT, {"role": "tool", "content": "sunny"}]}, "messages"),  # answers no call
    ],
)
def test_what_the_app_cannot_do_is_refused_by_name_not_ignored(served, extra, param):
    server, _, _ = served
    before = len(server.api.finished)
    r = _post(server, **extra)  # was: a 200 that silently ignored it
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert len(server.api.finished) == before


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "text"}},
        {"response_format": {"type": "json_object"}},  # held to JSON by constrained decoding
        {"frequency_penalty": 1.5, "presence_penalty": -0.5, "logit_bias": {"5": -100}},
        {"logprobs": False},
        {"tools": [TOOL], "tool_choice": "none"},  # "none" promises a text reply: that is what it gets
        {"tool_choice": "auto"},
    ],
)
def test_what_asks_for_nothing_the_app_lacks_is_served(served, extra):
    server, _, _ = served
    r = _post(server, **extra)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        "a bare string",
    ],
)
def test_a_part_the_model_cannot_read_is_refused_not_dropped(served, part):
    server, _, _ = served
    parts = [{"type": "text", "text": "What is in this picture?"}, part]
    r = _post(server, messages=[{"role": "user", "content": parts}])  # was: answered as if the text were all
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "reads text only" in r.json()["error"]["message"]


def test_text_parts_are_joined_by_a_line_break():
    from ui.openai_request import parse_chat

    parts = [{"type": "text", "text": "First line."}, {"type": "text", "text": "Second line."}]
    got = parse_chat({"messages": [{"role": "user", "content": parts}]}, Sampling(max_new_tokens=8)).prompt
    assert got == [{"role": "user", "content": "First line.\nSecond line."}]  # was: "First line.Second line."


def test_a_null_max_completion_tokens_leaves_max_tokens_in_force(served):
    server, _, _ = served
    r = _post(server, max_completion_tokens=None, max_tokens=2, temperature=0)  # clients send unset fields as null
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text  # was: Settings' 512


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),  # was: reported as 'max_tokens'
        ({"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"temperature": 7}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
    ],
)
def test_a_value_out_of_range_names_its_own_field(served, extra, param):
    server, _, _ = served
    r = _post(server, **extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert f"'{param}'" in r.json()["error"]["message"]


def test_more_than_four_stop_strings_are_taken_up_to_sixteen(served):
    server, _, _ = served
    r = _post(server, stop=[f"stop{i}" for i in range(16)])  # was: a 400 past 4 (Continue sends its whole list)
    assert r.status_code == 200, r.text
    r = _post(server, stop=[f"stop{i}" for i in range(17)])
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop" and "16" in r.json()["error"]["message"]


def test_top_p_zero_is_taken_as_greedy(served):
    from ui.openai_request import parse_chat

    server, _, _ = served
    assert parse_chat({"messages": PROMPT, "top_p": 0}, Sampling(max_new_tokens=8)).sampling.greedy
    greedy = _post(server, temperature=0, max_tokens=6).json()["choices"][0]["message"]["content"]
    r = _post(server, top_p=0, temperature=1.5, max_tokens=6)  # was: a 400 (OpenAI's range is 0 to 1)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == greedy, r.text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
        ({"stream": True, "stream_options": True}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_a_malformed_field_is_an_openai_shaped_400_not_a_bare_500(served, extra, param):
    server, _, _ = served
    r = _post(server, **extra)  # was: "Internal Server Error" as text/plain
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", (r.status_code, r.text[:80])
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "method, path, status",
    [("POST", "embeddings", 404), ("GET", "completions", 405), ("GET", "chat/completions", 405), ("GET", "", 404)],
)
def test_an_unknown_v1_route_is_an_openai_shaped_error_naming_the_served_ones(served, method, path, status):
    server, _, _ = served
    r = httpx.request(method, f"{server.url}v1/{path}", json={"model": "x", "prompt": "hi"}, timeout=30)
    assert r.status_code == status, r.text  # was: FastAPI's {"detail": "Not Found"}
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and f"{method} /v1/{path} is not served" in error["message"]
    assert "GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/completions" in error["message"]


def test_a_503_while_a_model_loads_says_when_to_ask_again(served):
    from pathlib import Path

    from ui.load_job import LoadJob

    server, session, _ = served
    loaded, job = session.runtime, session.loading
    session.runtime, session.loading = None, LoadJob(Path("mixtral-strict"), "auto")
    try:
        r = _post(server)
        assert r.status_code == 503 and "still loading" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "5"  # was: none, so clients retried at once or not at all
        # Listed while it loads (was: an empty list, so a client that lists first said "no model" and gave up).
        listed = httpx.get(f"{server.url}v1/models", timeout=30).json()
        assert [m["id"] for m in listed["data"]] == ["mixtral-strict"] and listed["first_id"] == "mixtral-strict"
        assert httpx.get(f"{server.url}v1/models/mixtral-strict", timeout=30).json()["id"] == "mixtral-strict"
        messages = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{server.url}v1/messages", json=messages, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "5" and r.json()["type"] == "error"
        session.loading.finished.set()  # the load ended without a model: asking again soon would not help
        r = _post(server)
        assert r.status_code == 503 and "retry-after" not in r.headers
        assert httpx.get(f"{server.url}v1/models", timeout=30).json()["data"] == []
    finally:
        session.runtime, session.loading = loaded, job


def test_top_k_and_the_penalties_reach_the_sampler():
    from ui.openai_request import parse_chat

    body = {"messages": PROMPT, "top_k": 5, "repetition_penalty": 1.2, "frequency_penalty": 0.5}
    sampling = parse_chat(body | {"presence_penalty": -0.5}, Sampling()).sampling
    assert (sampling.top_k, sampling.repetition_penalty, sampling.frequency_penalty) == (5, 1.2, 0.5)
    assert sampling.presence_penalty == -0.5
    assert parse_chat({"messages": PROMPT, "top_k": -1}, Sampling(top_k=9)).sampling.top_k == 0  # vLLM's "no limit"


def test_what_a_request_leaves_out_takes_the_app_s_own_defaults_never_a_chat_s_nor_its_reply_length(served):
    from ui.openai_request import UNTIL_CONTEXT, parse_chat

    server, session, _ = served
    settings = Sampling(max_new_tokens=5, temperature=0.3, top_p=0.4)
    got = parse_chat({"messages": PROMPT, "top_p": None}, settings).sampling
    assert got == replace(settings, max_new_tokens=UNTIL_CONTEXT)  # was: 1.0 and 1.0; and the chat's 5 tokens
    asked = _post(server, temperature=0, max_tokens=8, seed=1).json()
    config, before = session.config, session.store.settings.load()
    session.config = config.with_changes(sampling=Sampling(max_new_tokens=4, temperature=0.0))
    # What the Chat tab keeps: its "Save as default" values and a chat's own. Before, /v1 took the chat's last Send.
    session.store.settings.set(temperature=1.5, top_p=0.5, max_new_tokens=2, top_k=3)
    chat = session.store.chats.create("a chat", generation={"temperature": 2.0, "max_new_tokens": 1})
    try:
        reply = _post(server, max_tokens=None, seed=1).json()  # no temperature, no top_p, a null max_tokens
        assert "usage" in reply and "usage" in asked, (reply, asked)  # a failure's error, shown whole
        assert reply["usage"]["completion_tokens"] > 4  # was: cut at a Max new tokens (the chat's or the app's)
        text = reply["choices"][0]["message"]["content"]  # the app's temperature 0, not the chat's 2.0
        assert text.startswith(asked["choices"][0]["message"]["content"])
    finally:
        session.config = config
        session.store.chats.delete(chat.id)
        session.store.settings.set(**before.generation())


def test_the_loaded_model_is_retrieved_by_its_id_and_another_is_a_404(served):
    _, session, client = served
    assert client.models.retrieve(session.model_id).id == session.model_id  # was: a 404 for every id
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.body["param"] == "model" and f"'{session.model_id}'" in caught.value.body["message"]
