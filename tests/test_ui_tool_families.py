"""A scripted tool-call round trip, for every family whose real chat template takes tools, through the real app and
the official openai (plain and streamed) and anthropic clients: call forced by tool_choice, the tool's result sent
back, a text reply. Each tiny model gets its family's tool template (tests/tool_templates.py) and, as the real
checkpoints have them, the format's markers as special tokens, which the reply keeps for the parser and the user
never sees. Qwen3-MoE's round trips are tests/test_ui_structured.py's and tests/test_ui_anthropic_api.py's; the
other families (OLMoE, Phi-3.5-MoE, DeepSeek-V2-Lite, Mixtral-8x7B-Instruct) ship templates without tools."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.api_server import serving
from tests.tiny import with_special_tokens
from tests.tool_templates import (
    ASK,
    DEEPSEEK_TEMPLATE,
    HARMONY_TEMPLATE,
    HERMES_TEMPLATE,
    MISTRAL_TEMPLATE,
    TIME,
    WEATHER,
)
from ui.tool_calls import DEEPSEEK_V3, HARMONY, HERMES, MISTRAL

openai = pytest.importorskip("openai")

FAMILIES = {  # family → (its tool template, its format)
    "qwen2_moe": (HERMES_TEMPLATE, HERMES),
    "mixtral": (MISTRAL_TEMPLATE, MISTRAL),
    "gpt_oss": (HARMONY_TEMPLATE, HARMONY),
    "deepseek_v3": (DEEPSEEK_TEMPLATE, DEEPSEEK_V3),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tiny_model_dir, tmp_path_factory):
    template, fmt = FAMILIES[request.param]
    model = with_special_tokens(
        tiny_model_dir(request.param), tmp_path_factory.mktemp("marked") / request.param, list(fmt.markers), 2048
    )
    with serving(model, tmp_path_factory.mktemp(f"tools-{request.param}"), template=template) as (s, session, c):
        yield fmt, c, anthropic.Anthropic(base_url=s.url.rstrip("/"), api_key="x", max_retries=0, timeout=120), session


def _unmarked(fmt, text: str | None) -> None:  # noqa: ANN001 - a ToolFormat
    assert not any(marker in (text or "") for marker in fmt.markers), text


def test_a_required_call_and_its_result_round_trip_through_the_openai_client(served):
    fmt, client, _, _ = served
    first = client.chat.completions.create(
        model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=60,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert (call.function.name, args) in (("time", {}), ("weather", {"city": "Oslo"}), ("weather", {"city": "Lisbon"}))
    _unmarked(fmt, choice.message.content)
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Dry."},
    ]
    second = client.chat.completions.create(
        model="x", messages=history, tools=[WEATHER, TIME], max_tokens=8, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were in the prompt
    _unmarked(fmt, second.choices[0].message.content)


def test_a_named_call_streams_and_its_result_round_trips_streamed(served):
    fmt, client, _, _ = served
    named = {"type": "function", "function": {"name": "weather"}}
    chunks = list(client.chat.completions.create(
        model="x", messages=ASK, tools=[TIME, WEATHER], tool_choice=named, temperature=0, max_tokens=60, stream=True
    ))  # fmt: skip
    pieces = [p for c in chunks for p in c.choices[0].delta.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and [p.index for p in pieces] == [0], chunks
    call = pieces[0]
    assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Lisbon")
    _unmarked(fmt, "".join(c.choices[0].delta.content or "" for c in chunks))
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "weather", "arguments": call.function.arguments}}
        ]},
        {"role": "tool", "tool_call_id": call.id, "content": "Dry."},
    ]  # fmt: skip
    second = list(client.chat.completions.create(
        model="x", messages=history, tools=[WEATHER], max_tokens=8, temperature=0, stream=True
    ))  # fmt: skip
    assert second[-1].choices[0].finish_reason in ("stop", "length")
    assert not any(c.choices[0].delta.tool_calls for c in second)
    _unmarked(fmt, "".join(c.choices[0].delta.content or "" for c in second))


def test_a_tool_use_round_trips_through_the_anthropic_client(served):
    fmt, _, client, _ = served
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    first = client.messages.create(
        model="x", messages=ASK, tools=tools, max_tokens=60, extra_body={"temperature": 0},
        tool_choice={"type": "tool", "name": "weather"},
    )  # fmt: skip
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"], first
    use = first.content[0]
    assert use.name == "weather" and use.input["city"] in ("Oslo", "Lisbon")
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Dry."}]},
    ]
    second = client.messages.create(model="x", messages=history, tools=tools, max_tokens=8)
    assert second.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in second.content)
    _unmarked(fmt, "".join(b.text for b in second.content))


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_call_text_from_an_unconstrained_model_is_content_not_an_error(served, stream):
    """The model, pushed by logit_bias, writes nothing but its format's call opening (tool_choice auto: no grammar):
    a call that never forms. The reply is a 200 whose content is what the model wrote less the special tokens."""
    fmt, client, _, session = served
    if not fmt.start:  # harmony: every token of the reply may open a channel; its opening marker then
        opening = "<|channel|>"
    elif fmt.markers:
        opening = fmt.start
    else:
        pytest.skip("Hermes' <tool_call> is text, not one token: tests/test_tool_calls.py covers its malformed calls")
    ids = session.runtime.special_tokens([opening])
    kwargs = dict(model="x", messages=ASK, tools=[WEATHER], max_tokens=6, temperature=0, logit_bias={ids[opening]: 100})
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert not any(c.choices[0].delta.tool_calls for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, reason = choice.message.content, choice.finish_reason
        assert choice.message.tool_calls is None
    assert reason == "length"
    _unmarked(fmt, content)
