"""A real agent loop against the app: the OpenAI Agents SDK's Runner (its own loop: call the model, run the tools it
asked for, send their results back, until a reply without a call) through the app's /v1/chat/completions on a tiny
Qwen3-MoE model with Qwen's Hermes tool template (tests/tool_templates.py).

The model is untrained, so which tool it calls is scripted: each model call names the function it must call (the
app then forces the call by constrained decoding), and the third forbids tools ("none"), so that the loop ends on a
text answer. Everything else is the SDK's: its tool schemas (strict), its Chat Completions messages (assistant
tool_calls, tool results) and its parsing of the app's replies. Tracing (which would send spans to OpenAI) is off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from typing import Literal

import pytest

from tests.api_server import serving
from tests.tool_templates import HERMES_TEMPLATE

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")

SCRIPT = ("weather", "clock", "none")  # the tool_choice of the loop's first, second and third model call


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("agents")
    # The SDK's two tool schemas and a conversation with two calls need more than the tiny model's 512 tokens; its
    # rotary positions take any length.
    model = tmp_path_factory.mktemp("agents-model") / "qwen3_moe"
    shutil.copytree(tiny_model_dir("qwen3_moe"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    with serving(model, data, template=HERMES_TEMPLATE) as served:
        yield served


class Scripted(agents.OpenAIChatCompletionsModel):
    """The SDK's Chat Completions model, with the tool_choice of each call taken from SCRIPT by how many tool
    results the conversation already holds, and greedy decoding. Every call is recorded."""

    def __init__(self, client: openai.AsyncOpenAI) -> None:
        super().__init__(model="tiny", openai_client=client)
        self.calls: list[tuple[str, list]] = []

    def _scripted(self, input: str | list, settings: agents.ModelSettings) -> agents.ModelSettings:  # noqa: A002
        done = sum(1 for item in input if isinstance(item, dict) and item.get("type") == "function_call_output")
        choice = SCRIPT[min(done, len(SCRIPT) - 1)]
        self.calls.append((choice, list(input) if isinstance(input, list) else [input]))
        return dataclasses.replace(settings, tool_choice=choice, temperature=0, max_tokens=120)

    async def get_response(self, system_instructions, input, model_settings, *args, **kwargs):  # noqa: A002, ANN001, ANN201
        return await super().get_response(
            system_instructions, input, self._scripted(input, model_settings), *args, **kwargs
        )

    def stream_response(self, system_instructions, input, model_settings, *args, **kwargs):  # noqa: A002, ANN001, ANN201
        return super().stream_response(
            system_instructions, input, self._scripted(input, model_settings), *args, **kwargs
        )


def _agent(model: Scripted, ran: list) -> agents.Agent:
    @agents.function_tool
    def weather(city: Literal["Oslo", "Lisbon"]) -> str:
        """Today's weather in a city."""
        ran.append(("weather", city))
        return f"Dry in {city}."

    @agents.function_tool
    def clock() -> str:
        """The time now."""
        ran.append(("clock", None))
        return "09:00"

    return agents.Agent(
        name="helper", instructions="Answer briefly.", model=model, tools=[weather, clock], reset_tool_choice=False
    )


def _check(result, model: Scripted, ran: list) -> None:  # noqa: ANN001 - a RunResult
    assert [c for c, _ in model.calls] == list(SCRIPT), model.calls  # three model calls: two with a tool, the answer
    assert [name for name, _ in ran] == ["weather", "clock"] and ran[0][1] in ("Oslo", "Lisbon"), ran
    items = [item.type for item in result.new_items]
    assert items == [
        "tool_call_item", "tool_call_output_item", "tool_call_item", "tool_call_output_item", "message_output_item"
    ], items  # fmt: skip
    # The SDK sent each tool's result back with the id of the call the app made, before the next model call.
    outputs = [i for i in model.calls[2][1] if isinstance(i, dict) and i.get("type") == "function_call_output"]
    called = [i for i in model.calls[2][1] if isinstance(i, dict) and i.get("type") == "function_call"]
    assert [o["call_id"] for o in outputs] == [c["call_id"] for c in called] and len(called) == 2
    assert [c["name"] for c in called] == ["weather", "clock"] and json.loads(called[1]["arguments"]) == {}
    assert outputs[0]["output"] == f"Dry in {ran[0][1]}." and outputs[1]["output"] == "09:00"
    assert isinstance(result.final_output, str)  # the model's text answer, whatever an untrained model writes
    assert result.raw_responses[-1].output[-1].type == "message"


def test_the_agents_sdk_runner_completes_two_tool_calls_and_answers(served):
    _, _, client = served
    async_client = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="anything", max_retries=0, timeout=120)
    model, ran = Scripted(async_client), []
    config = agents.RunConfig(tracing_disabled=True)
    result = asyncio.run(
        agents.Runner.run(_agent(model, ran), "Is it dry in Oslo, and what time is it?", run_config=config)
    )
    _check(result, model, ran)


def test_the_streamed_runner_completes_the_same_loop(served):
    _, _, client = served
    async_client = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="anything", max_retries=0, timeout=120)
    model, ran = Scripted(async_client), []
    config = agents.RunConfig(tracing_disabled=True)

    async def run():  # noqa: ANN202
        streamed = agents.Runner.run_streamed(_agent(model, ran), "Is it dry in Lisbon?", run_config=config)
        async for _ in streamed.stream_events():
            pass
        return streamed

    _check(asyncio.run(run()), model, ran)
