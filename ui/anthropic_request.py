"""A /v1/messages body (Anthropic's Messages API) turned into the request the OpenAI side makes of the runtime: an
ApiRequest (openai_request.py), so both APIs share everything after the body — the check of tools and the grammar
of a forced call or a JSON reply (structured.py), the prompt check, the run, the reading of tool calls.

Scope: `parse_messages` (and `parse_count`, for /v1/messages/count_tokens): the pydantic checks of
anthropic_models.py (a 400 with its sentence), then the translation. The messages become what a chat template
reads, as openai_request._messages makes them: `system` (text, or text blocks joined by a blank line) the first
message; a user turn's text blocks one user message, each tool_result block a tool message with its call's id (in
their order, so results come first as Anthropic clients send them); an assistant turn's text its content, its
tool_use blocks `tool_calls` (arguments as an object, transformers' convention), its thinking blocks
`reasoning_content` (what Qwen3's template reads back). Consecutive turns of one role are one turn, as Anthropic
combines them. A final assistant turn is a prefill: the reply continues it (engine.py). Sampling left out is the
app's Settings (as for the OpenAI API), top_k included (0: every token); tool_choice any → required, tool → that
function, none → no tools shown; output_config.format → response_format json_schema. It does NOT talk to the
runtime (anthropic_api.py does).
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import ValidationError

from fmoe_local.config import Sampling
from ui.anthropic_models import REFUSALS, CountTokensBody, Message, MessagesBody, TextBlock, Tool, ToolChoice
from ui.openai_models import ResponseFormat, refusal
from ui.openai_request import ApiError, ApiRequest


def parse_messages(body: dict, defaults: Sampling) -> ApiRequest:
    """`defaults`: the app's own sampling (RuntimeConfig.sampling) for what the request leaves out."""
    req = _validated(MessagesBody, body)
    temperature = defaults.temperature if req.temperature is None else float(req.temperature)
    top_p = defaults.top_p if req.top_p is None else float(req.top_p)
    sampling = replace(
        defaults,
        max_new_tokens=req.max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=req.top_k or 0,
        greedy=temperature == 0.0 or top_p == 0.0,
    )
    tools, choice, parallel = _tools(req.tools, req.tool_choice)
    enabled = req.thinking is not None and req.thinking.type == "enabled"  # with budget_tokens (anthropic_models.py)
    fmt = None
    if req.output_config is not None and req.output_config.format is not None:
        schema = req.output_config.format.schema_
        fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"schema": schema}})
    return ApiRequest(
        _chat(req.system, req.messages),
        sampling,
        list(req.stop_sequences or []),
        bool(req.stream),
        False,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=fmt,
        thinking=req.thinking.type if req.thinking is not None else None,
        thought_budget=req.thinking.budget_tokens if enabled else None,
    )


def parse_count(body: dict) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of a count_tokens body: what the prompt would be."""
    req = _validated(CountTokensBody, body)
    return _chat(req.system, req.messages), _tools(req.tools, req.tool_choice)[0]


def _validated(model: type, body: dict):  # noqa: ANN202 - a MessagesBody or CountTokensBody
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = refusal(exc, REFUSALS)
        raise ApiError(400, message, param) from exc


def _tools(tools: list[Tool] | None, choice: ToolChoice | None) -> tuple[list[dict], str, bool]:
    """(tools as the chat template reads them, OpenAI's tool_choice, parallel calls allowed)."""
    shown = [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in tools or []
    ]
    kind = choice.type if choice is not None else ("auto" if shown else "none")
    if kind == "none":
        return [], "none", True  # a text reply is promised: the model is not shown tools it may not use
    forced = {"auto": "auto", "any": "required"}.get(kind) or choice.name
    return shown, forced, not (choice is not None and choice.disable_parallel_tool_use)


def _chat(system: str | list[TextBlock] | None, messages: list[Message]) -> list[dict]:
    out = []
    if isinstance(system, list):
        system = "\n\n".join(b.text for b in system)
    if system:
        out.append({"role": "system", "content": system})
    turns: list[tuple[str, list]] = []
    for m in messages:  # consecutive turns of one role are one turn
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend(m.blocks)
        else:
            turns.append((m.role, list(m.blocks)))
    for role, blocks in turns:
        out.extend(_assistant(blocks) if role == "assistant" else _user(blocks))
    return out


def _user(blocks: list) -> list[dict]:
    """Text blocks in a row are one user message; each tool result is a tool message, in the blocks' order."""
    out, texts = [], []
    for block in blocks:
        if block.type == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
        elif block.type == "text":
            texts.append(block.text)
        else:
            raise ApiError(400, f"A user message cannot hold a '{block.type}' block: only the assistant's can.")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list) -> list[dict]:
    message: dict = {"role": "assistant", "content": "\n".join(b.text for b in blocks if b.type == "text")}
    thinking = "\n".join(b.thinking for b in blocks if b.type == "thinking")
    if thinking:
        message["reasoning_content"] = thinking
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in blocks
        if b.type == "tool_use"
    ]
    if calls:
        message["tool_calls"] = calls
    if any(b.type == "tool_result" for b in blocks):
        raise ApiError(400, "An assistant message cannot hold a 'tool_result' block: send it in the next user message.")
    return [message]
