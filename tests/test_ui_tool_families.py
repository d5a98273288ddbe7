"""A scripted tool-call round trip, for every family whose real chat template takes tools, through the real app and
the official openai (plain and streamed) and anthropic clients: call forced by tool_choice, the tool's result sent
back, a text reply. Each tiny model gets its family's tool template (tests/tool_templates.py) and, as the real
checkpoints have them, the format's markers as special tokens, which the reply keeps for the parser and the user
never sees. Qwen3-MoE's round trips are tests/test_ui_structured.py's and tests/test_ui_anthropic_api.py's; the
other families (OLMoE, Phi-3.5-MoE, DeepSeek-V2-Lite, Mixtral-8x7B-Instruct) ship templates without tools. Last, a
GPT-OSS reply from a scripted runtime, token by token: through both clients, its channels arrive as it is written."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import anthropic
import pytest

from tests.api_server import serving, serving_script
from tests.fake_runtime import FakeRuntime
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


# ---- a GPT-OSS reply streamed as it comes, from a scripted runtime ----

PAUSE = None  # in a script: the runtime waits there until the test's client has read what came before

ANALYSIS = ["<|channel|>", "analysis", "<|message|>", "The", " user", " asks", ".", "<|end|>"]
FINAL = ["<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "It", " is", PAUSE, " dry", "."]
PREAMBLE = ["<|start|>", "assistant", "<|channel|>", "commentary", "<|message|>", "Check", "ing", ".", "<|end|>"]
CALL = [
    "<|start|>", "assistant", "<|channel|>", "commentary", " to", "=", "functions", ".", "weather", " ",
    "<|constrain|>", "json", "<|message|>", '{"', "city", '":', ' "', "Oslo", '"}', "<|call|>",
]  # fmt: skip


class HarmonyScript(FakeRuntime):
    """GPT-OSS as a script: `script`'s tokens written one by one, the markers as the text a request with tools keeps
    (special tokens kept: Runtime.submit's keep), stopping at each PAUSE until the test lets it go on (`go`) — a
    bounded wait, whose outcome is `waited` (False: the client had not been sent what came before it)."""

    chat_template = HARMONY_TEMPLATE

    def __init__(self, info: SimpleNamespace) -> None:
        super().__init__()
        self.info, self.script, self.go, self.waited = info, [], threading.Semaphore(0), []

    def supports_tools(self) -> bool:
        return True

    def check_grammar(self, grammar, schema=None, where="schema") -> None:  # noqa: ANN001
        return None  # the tools' schemas compile (tests/test_ui_structured.py checks the real check)

    def events(self, prompt, sampling, stop):  # noqa: ANN001, ANN201
        from fmoe_local.runtime_types import Finished, TextDelta
        from fmoe_local.stats import RequestStats

        text, ids = "", []
        for token in self.script:
            if token is PAUSE:
                self.waited.append(self.go.acquire(timeout=30))
                continue
            text, ids = text + token, [*ids, len(ids)]
            yield TextDelta(token, ids[-1])
        yield Finished(text, ids, RequestStats(prompt_tokens=3, finish_reason="stop"), "stop")


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """The real app with no model loaded, then the script as its runtime; (the script, openai, anthropic)."""
    script = HarmonyScript(SimpleNamespace(name="gpt-oss-script"))
    with serving_script(script, tmp_path_factory.mktemp("harmony-script")) as clients:
        yield (script, *clients)


class Reader:
    """What a client has read of a streamed reply, by kind (reasoning, content, a call), in order; it lets the
    scripted runtime go on past its next PAUSE once the text of `until`'s next (kind, text) has all come."""

    def __init__(self, fake: HarmonyScript, until: list[tuple[str, str]]) -> None:
        self.fake, self.until, self.events = fake, list(until), []

    def read(self, kind: str, text: str | None) -> None:
        if not text:
            return
        self.events.append((kind, text))
        if self.until and self.until[0] == (kind, self.text(kind)):
            self.until.pop(0)
            self.fake.go.release()

    def text(self, kind: str) -> str:
        return "".join(text for k, text in self.events if k == kind)

    def kinds(self) -> list[str]:
        """The kinds in the order they came, each run of one kind once."""
        return [k for i, (k, _) in enumerate(self.events) if i == 0 or self.events[i - 1][0] != k]


def _openai_stream(fake: HarmonyScript, client, until: list[tuple[str, str]]) -> tuple[Reader, list]:  # noqa: ANN001
    reader, reasons = Reader(fake, until), []
    stream = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], stream=True, max_tokens=99)
    for chunk in stream:
        delta = chunk.choices[0].delta
        reader.read("reasoning", (delta.model_extra or {}).get("reasoning_content"))
        reader.read("content", delta.content)
        for call in delta.tool_calls or []:
            reader.read("call", f"{call.function.name} {call.function.arguments}")
        reasons.append(chunk.choices[0].finish_reason)
    return reader, reasons


def test_a_gpt_oss_reply_streams_its_analysis_and_final_channels_as_they_come(scripted):
    """The client reads the analysis channel as reasoning_content before the model writes its final channel, and
    the final channel's first words before the model writes the rest (before, a reply that might call tools was
    read whole at its end: the runtime's waits would time out)."""
    fake, client, _ = scripted
    fake.script, fake.waited = [*ANALYSIS, PAUSE, *FINAL], []
    reader, reasons = _openai_stream(fake, client, [("reasoning", "The user asks."), ("content", "It is")])
    assert fake.waited == [True, True], reader.events
    assert reader.kinds() == ["reasoning", "content"] and reasons[-1] == "stop"
    assert reader.text("reasoning") == "The user asks." and reader.text("content") == "It is dry."
    fake.script = [token for token in fake.script if token is not PAUSE]
    whole = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], max_tokens=99)
    message = whole.choices[0].message  # as a reply held whole was read
    assert (message.model_extra["reasoning_content"], message.content) == ("The user asks.", "It is dry.")


def test_a_gpt_oss_call_streams_its_analysis_first_and_the_call_when_it_completes(scripted):
    fake, client, _ = scripted
    fake.script, fake.waited = [*ANALYSIS, PAUSE, *CALL], []
    reader, reasons = _openai_stream(fake, client, [("reasoning", "The user asks.")])
    assert fake.waited == [True] and reader.kinds() == ["reasoning", "call"] and reasons[-1] == "tool_calls"
    assert reader.text("call") == 'weather {"city": "Oslo"}' and reader.text("content") == ""
    fake.script = [*ANALYSIS, *CALL]
    message = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], max_tokens=99).choices[0].message
    assert message.model_extra["reasoning_content"] == "The user asks." and message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("weather", '{"city": "Oslo"}')]


def test_only_a_final_channel_streams_as_content(scripted):
    fake, client, _ = scripted
    fake.script, fake.waited = FINAL, []
    reader, reasons = _openai_stream(fake, client, [("content", "It is")])
    assert fake.waited == [True] and reader.kinds() == ["content"] and reader.text("content") == "It is dry."
    assert reasons[-1] == "stop"


def test_a_malformed_gpt_oss_call_is_content_at_the_end(scripted):
    fake, client, _ = scripted
    fake.script, fake.waited = [*PREAMBLE, PAUSE, *CALL[:-3]], []  # cut before the JSON closes
    reader, reasons = _openai_stream(fake, client, [("content", "Checking.")])
    assert fake.waited == [True] and reader.kinds() == ["content"] and reasons[-1] == "stop"
    assert reader.text("content") == 'Checking.{"city": "'


def test_a_gpt_oss_reply_streams_as_thinking_text_and_tool_use_through_the_anthropic_client(scripted):
    fake, _, claude = scripted
    fake.script, fake.waited = [*ANALYSIS, PAUSE, *PREAMBLE, PAUSE, *CALL], []
    reader = Reader(fake, [("thinking_delta", "The user asks."), ("text_delta", "Checking.")])
    tools = [{"name": "weather", "input_schema": WEATHER["function"]["parameters"]}]
    with claude.messages.stream(model="x", messages=ASK, tools=tools, max_tokens=99) as stream:
        for event in stream:
            if event.type == "content_block_start" and event.content_block.type == "tool_use":
                reader.read("tool_use", event.content_block.name)
            if event.type == "content_block_delta":
                field = {"thinking_delta": "thinking", "text_delta": "text", "input_json_delta": "partial_json"}
                reader.read(event.delta.type, getattr(event.delta, field[event.delta.type]))
        final = stream.get_final_message()
    assert fake.waited == [True, True]
    assert reader.kinds() == ["thinking_delta", "text_delta", "tool_use", "input_json_delta"]
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].thinking == "The user asks." and final.content[1].text == "Checking."
    assert final.content[2].input == {"city": "Oslo"}
