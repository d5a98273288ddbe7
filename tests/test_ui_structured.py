"""Tools, forced tool calls and JSON replies through the real app and the official openai client, on tiny models
whose chat template is Qwen's Hermes tool format (tests/tool_templates.py): untrained, so every valid call or JSON
reply below comes from constrained decoding, not from the model knowing the format."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.api_server import serving
from tests.tool_templates import HERMES_TEMPLATE

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Lisbon"]}, "rain": {"type": "boolean"}},
            "required": ["city", "rain"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Will it rain in Oslo today?"}]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe"])
def served(request, tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp(f"structured-{request.param}")
    with serving(tiny_model_dir(request.param), data, template=HERMES_TEMPLATE) as served:
        yield served


def _call_args(call) -> dict:  # noqa: ANN001 - an openai tool call
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Oslo", "Lisbon") and isinstance(args["rain"], bool) and set(args) == {"city", "rain"}
    return args


def test_a_required_tool_call_round_trip_non_streaming(served):
    _, _, client = served
    first = client.chat.completions.create(
        model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=120,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    if call.function.name == "weather":
        _call_args(call)
    else:
        assert call.function.name == "time" and json.loads(call.function.arguments) == {}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"rain": false}'},
    ]
    second = client.chat.completions.create(model="x", messages=history, tools=[WEATHER], max_tokens=4)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None and isinstance(second.choices[0].message.content, str)


def test_a_named_tool_call_streams_as_delta_tool_calls(served):
    _, _, client = served
    choice = {"type": "function", "function": {"name": "weather"}}
    stream = client.chat.completions.create(
        model="x", messages=ASK, tools=[TIME, WEATHER], tool_choice=choice, temperature=0, max_tokens=120,
        stream=True,
    )  # fmt: skip
    calls, reasons = {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        for piece in delta.tool_calls or []:
            got = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            got["name"] += piece.function.name or ""
            got["arguments"] += piece.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and list(calls) == [0], (reasons, calls)
    assert calls[0]["name"] == "weather"
    args = json.loads(calls[0]["arguments"])
    assert args["city"] in ("Oslo", "Lisbon") and isinstance(args["rain"], bool)


@pytest.mark.parametrize("stream", [False, True])
def test_a_strict_json_schema_reply_is_valid(served, stream):
    _, _, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    kwargs = dict(model="x", messages=ASK, response_format=fmt, temperature=0, max_tokens=60)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True))
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    reply = json.loads(text)
    assert reply["answer"] in ("yes", "no") and isinstance(reply["sure"], bool) and set(reply) == {"answer", "sure"}


def test_a_json_object_reply_is_a_json_object(served):
    _, _, client = served
    reply = client.chat.completions.create(
        model="x", messages=ASK, response_format={"type": "json_object"}, temperature=0, max_tokens=200
    )
    if reply.choices[0].finish_reason == "stop":  # an untrained model may run out of tokens inside the object
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "extra, param, path",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "strin"}}}}}}}},
            "response_format",
            "response_format.json_schema.schema.properties.a.properties.b",
        ),
        (
            {"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"q": {"$ref": "#/$defs/missing"}}}}}]},
            "tools",
            "tools[1].function.parameters.properties.q",
        ),
    ],
)  # fmt: skip
def test_a_schema_the_engine_cannot_compile_is_a_400_naming_its_path(served, extra, param, path):
    server, _, _ = served
    before = len(server.api.finished)
    body = {"model": "x", "messages": ASK, "max_tokens": 2} | extra
    r = httpx.post(f"{server.url}v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and f"'{path}'" in r.json()["error"]["message"], r.json()
    assert len(server.api.finished) == before
