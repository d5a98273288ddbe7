"""A /v1/messages body turned into the runtime's request (ui/anthropic_request.py): the messages as a chat template
reads them, sampling, tools and tool_choice, and the 400s' sentences — no model needed."""

from __future__ import annotations

import pytest

from fmoe_local.config import Sampling
from ui.anthropic_models import REFUSALS, UNREADABLE
from ui.anthropic_request import parse_count, parse_messages
from ui.openai_request import ApiError

DEFAULTS = Sampling(max_new_tokens=77, temperature=0.6, top_p=0.8)
WEATHER = {"name": "weather", "description": "Today's weather", "input_schema": {"type": "object", "properties": {}}}


def _parse(**body: object):  # noqa: ANN202 - an ApiRequest
    return parse_messages(
        {"model": "x", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]} | body, DEFAULTS
    )


def _refused(**body: object) -> str:
    with pytest.raises(ApiError) as info:
        _parse(**body)
    assert info.value.status == 400
    return info.value.message


def test_a_conversation_becomes_the_messages_a_chat_template_reads():
    req = _parse(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "Use metric."}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "user", "content": [{"type": "text", "text": "In Oslo."}]},  # combined with the turn before
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Call the tool.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
                    {"type": "text", "text": "Thanks!"},
                ],
            },
        ],
        tools=[WEATHER],
    )  # fmt: skip
    assert req.prompt == [
        {"role": "system", "content": "Be brief.\n\nUse metric."},
        {"role": "user", "content": "Weather?\nIn Oslo."},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Call the tool.",
            "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "user", "content": "Thanks!"},
    ]  # fmt: skip
    assert req.tools == [{"type": "function", "function": {"name": "weather", "description": "Today's weather", "parameters": WEATHER["input_schema"]}}]  # fmt: skip
    assert (req.tool_choice, req.parallel_tool_calls, req.stream) == ("auto", True, False)


def test_sampling_takes_the_request_s_values_and_the_app_s_settings_for_the_rest():
    req = _parse(max_tokens=5, temperature=0.3, top_k=40, stop_sequences=["END"], stream=True)
    s = req.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.greedy) == (5, 0.3, 0.8, 40, False)
    assert req.stops == ["END"] and req.stream
    assert _parse(temperature=0).sampling.greedy
    assert _parse().sampling.top_k == 0 and _parse().sampling.temperature == 0.6


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({"type": "auto"}, ("auto", True)),
        ({"type": "any", "disable_parallel_tool_use": True}, ("required", False)),
        ({"type": "tool", "name": "weather"}, ("weather", True)),
        ({"type": "none"}, ("none", True)),
    ],
)
def test_tool_choice_in_openai_s_terms(choice, expected):
    req = _parse(tools=[WEATHER], tool_choice=choice)
    assert (req.tool_choice, req.parallel_tool_calls) == expected
    assert (req.tools == []) == (choice["type"] == "none")  # "none": the model is not shown the tools


def test_output_config_s_schema_is_a_json_schema_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = _parse(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert req.response_format.type == "json_schema" and req.response_format.json_schema.schema_ == schema


def test_count_tokens_reads_the_same_prompt():
    messages, tools = parse_count(
        {"model": "x", "system": "S", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    )
    assert messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}] and len(tools) == 1  # fmt: skip


def test_wrong_fields_are_refused_with_a_sentence_naming_them():
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ApiError) as info:
        parse_messages(body, DEFAULTS)  # no max_tokens: the Messages API requires it
    assert info.value.message == REFUSALS["max_tokens"]
    assert _refused(max_tokens=0) == REFUSALS["max_tokens"]
    assert _refused(temperature=1.5) == REFUSALS["temperature"]
    assert _refused(top_k=-1) == REFUSALS["top_k"]
    assert _refused(messages=[{"role": "system", "content": "x"}]) == REFUSALS["messages.role"]
    assert _refused(stop_sequences=[""]) == REFUSALS["stop_sequences"]
    bad_input = [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "weather", "input": "x"}]}]
    assert _refused(messages=bad_input) == REFUSALS["messages.content.tool_use.input"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    assert _refused(messages=[{"role": "user", "content": [image]}]) == UNREADABLE["image"]
    assert "'bash_20250124'" in _refused(tools=[{"type": "bash_20250124", "name": "bash"}])
    assert "'nope', which is not in 'tools'" in _refused(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    assert "no 'tools' were sent" in _refused(tool_choice={"type": "any"})
    result = {"type": "tool_result", "tool_use_id": "t", "content": "x"}
    assert "cannot hold a 'tool_result'" in _refused(messages=[{"role": "assistant", "content": [result]}])
