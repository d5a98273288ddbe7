"""The Anthropic Messages API (/v1/messages) through the real app and the official anthropic client, on a tiny Qwen3-MoE
model whose chat template is Qwen's Hermes tool format (tests/tool_templates.py): plain and streamed replies (the
same greedy text as the OpenAI API gives for the same conversation), stop sequences, count_tokens, a tool_use round
trip forced by tool_choice (the model is untrained: every valid call comes from constrained decoding) and errors in
Anthropic's shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.api_server import serving
from tests.tool_templates import HERMES_TEMPLATE
from ui.anthropic_models import REFUSALS

WEATHER = {
    "name": "weather",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Lisbon"]}, "rain": {"type": "boolean"}},
        "required": ["city", "rain"],
        "additionalProperties": False,
    },
}
TIME = {"name": "time", "input_schema": {"type": "object", "properties": {}}}
SYSTEM = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in English."}]
TURNS = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
    {"role": "user", "content": [{"type": "text", "text": "And another?"}]},
]
GREEDY = {"temperature": 0}  # not a parameter of this anthropic client's create(): sent as it is


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("anthropic-api")
    with serving(tiny_model_dir("qwen3_moe"), data, template=HERMES_TEMPLATE) as (server, session, openai):
        client = anthropic.Anthropic(base_url=server.url.rstrip("/"), api_key="anything", max_retries=0, timeout=120)
        yield server, session, openai, client


def test_a_reply_is_the_openai_api_s_greedy_reply_with_anthropic_s_usage(served):
    _, _, openai, client = served
    reply = client.messages.create(model="x", system=SYSTEM, messages=TURNS, max_tokens=12, extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [b.type for b in reply.content] == ["text"] and reply.stop_reason in ("end_turn", "max_tokens")
    assert (reply.stop_reason == "max_tokens") == (reply.usage.output_tokens == 12)
    # The same conversation through the OpenAI API: Anthropic's system blocks and content blocks read the same.
    same = [{"role": "system", "content": "You are terse.\n\nAnswer in English."}]
    same += [
        {"role": t["role"], "content": t["content"] if isinstance(t["content"], str) else t["content"][0]["text"]}
        for t in TURNS
    ]
    other = openai.chat.completions.create(model="x", messages=same, max_tokens=12, temperature=0)
    assert reply.content[0].text == other.choices[0].message.content
    prompt = reply.usage.input_tokens + reply.usage.cache_read_input_tokens  # Anthropic counts the cached apart
    assert prompt == other.usage.prompt_tokens and reply.usage.output_tokens == other.usage.completion_tokens
    counted = client.messages.count_tokens(model="x", system=SYSTEM, messages=TURNS)
    assert counted.input_tokens == prompt
    # The same prompt again: the KV cache the last request kept holds all of it but its last token.
    again = client.messages.create(model="x", system=SYSTEM, messages=TURNS, max_tokens=12, extra_body=GREEDY)
    assert (again.usage.input_tokens, again.usage.cache_read_input_tokens) == (1, prompt - 1)


def test_a_streamed_reply_is_the_same_reply_as_events(served):
    _, _, _, client = served
    whole = client.messages.create(model="x", system=SYSTEM, messages=TURNS, max_tokens=12, extra_body=GREEDY)
    kinds = []
    with client.messages.stream(model="x", system=SYSTEM, messages=TURNS, max_tokens=12, extra_body=GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )


def test_a_stop_sequence_ends_the_reply_and_is_named(served):
    _, _, _, client = served
    text = client.messages.create(model="x", messages=TURNS, max_tokens=24, extra_body=GREEDY).content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert len(stop) == 2 and stop.strip(), text  # the tiny model wrote enough to cut in the middle
    reply = client.messages.create(model="x", messages=TURNS, max_tokens=24, stop_sequences=[stop], extra_body=GREEDY)
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    before = text[: text.find(stop)]
    assert [b.text for b in reply.content] == ([before] if before else [])


def test_a_forced_tool_use_round_trip(served):
    _, _, _, client = served
    ask = [{"role": "user", "content": "Will it rain in Oslo today?"}]
    first = client.messages.create(
        model="x", messages=ask, tools=[WEATHER, TIME], max_tokens=120, extra_body=GREEDY,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    assert first.stop_reason == "tool_use", first
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].id.startswith("toolu_")
    use = uses[0]
    if use.name == "weather":
        assert use.input["city"] in ("Oslo", "Lisbon") and isinstance(use.input["rain"], bool)
    else:
        assert use.name == "time" and use.input == {}
    history = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"rain": false}'}]},
    ]
    second = client.messages.create(model="x", messages=history, tools=[WEATHER], max_tokens=4)  # 512-token context
    assert second.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in second.content)


def test_a_named_tool_streams_as_a_tool_use_block(served):
    _, _, _, client = served
    ask = [{"role": "user", "content": "Will it rain in Lisbon?"}]
    with client.messages.stream(
        model="x", messages=ask, tools=[TIME, WEATHER], tool_choice={"type": "tool", "name": "weather"},
        max_tokens=120, extra_body=GREEDY,
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"], final
    assert final.content[0].name == "weather" and final.content[0].input["city"] in ("Oslo", "Lisbon")


def test_errors_are_in_anthropic_s_shape_with_the_api_s_sentences(served):
    server, _, _, client = served
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="x", messages=TURNS, max_tokens=0)
    assert info.value.status_code == 400
    assert info.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": REFUSALS["max_tokens"]},
    }
    # Without max_tokens (which this client will not send): the same sentence, from the raw API.
    r = httpx.post(f"{server.url}v1/messages", json={"model": "x", "messages": TURNS}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == REFUSALS["max_tokens"]
    r = httpx.post(f"{server.url}v1/messages", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error" and "must be JSON" in r.json()["error"]["message"]
    long = [{"role": "user", "content": "word " * 2000}]  # over the tiny model's 512 tokens
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="x", messages=long, max_tokens=4)
    assert "reads at most 512" in info.value.body["error"]["message"]
    r = httpx.get(f"{server.url}v1/messages", timeout=30)
    assert r.status_code == 405 and "POST /v1/messages" in r.json()["error"]["message"]


def test_a_prefilled_reply_continues_the_assistant_s_text_as_the_openai_api_does(served):
    _, _, openai, client = served
    whole = client.messages.create(model="x", messages=TURNS, max_tokens=8, extra_body=GREEDY).content[0].text
    head = whole[:3]
    assert head.strip(), whole
    prefill = {"role": "assistant", "content": head}
    reply = client.messages.create(model="x", messages=[*TURNS, prefill], max_tokens=8, extra_body=GREEDY)
    flat = [
        {"role": t["role"], "content": t["content"] if isinstance(t["content"], str) else t["content"][0]["text"]}
        for t in TURNS
    ]
    other = openai.chat.completions.create(model="x", messages=[*flat, prefill], max_tokens=8, temperature=0)
    assert reply.content[0].text == other.choices[0].message.content


def test_the_anthropic_client_lists_and_retrieves_the_served_model(served):
    _, session, openai, client = served
    listed = client.models.list()
    assert [m.id for m in listed.data] == [session.model_id] and listed.data[0].type == "model"
    assert client.models.retrieve(session.model_id).display_name == session.model_id
    assert [m.id for m in openai.models.list().data] == [session.model_id]  # the same list, OpenAI's shape
