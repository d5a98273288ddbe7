"""What a chat request asks of its reply's shape, checked against the loaded model before it is queued: tools the
model's chat template must show it (else a 400 saying so), a tool call forced by tool_choice ("required" or a
named function) or a reply held to JSON (response_format json_object / json_schema) — each a grammar the runtime
enforces token by token (fmoe_local/constrained.py), one it cannot compile a 400 naming the schema's path.

Scope: the grammar of the request (`Shaped.sampling`) and how its reply is read back (`Shaped.parts`: the model's
tool-call format and the tools, for the format's reader, ui/tool_calls.py's `ToolFormat.reader`; its thinking
format, for ui/reasoning.py's ThinkSplit — a chat reply of a model whose template writes <think>, unless a grammar
holds the reply: the grammar starts at the reply's first token, so there is no thought to read — except where the
request gives the thought a budget and the prompt opened it: then the grammar starts after the thought,
logits_rules.grammar_after_thought; a GPT-OSS chat reply without tools, under the same rule, keeps its harmony
markers and is read by harmony_reply.reader, its analysis channel the reasoning) and the thought's budget
(`Sampling.thought`: the most tokens it may take before its end is written for the model, in <think> or in GPT-OSS's
analysis channel — reasoning.budget_format —; a budget not less than max_tokens is dropped, as it could never bind,
unless a grammar holds the reply: there it says the grammar starts after the thought). It does NOT parse the body
(openai_request.py) or write the reply (openai_stream.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fmoe_local.config import Sampling, ThoughtBudget
from fmoe_local.logits_rules import grammar_after_thought
from ui import harmony_reply, reasoning
from ui.loaded_runtime import LoadedRuntime
from ui.openai_request import ApiError, ApiRequest
from ui.reasoning import ThinkFormat, ThinkSplit
from ui.reply_parts import ReplyParts
from ui.tool_calls import FORMATS, CallStream, TemplateFormat, ToolFormat, format_of

# Where tool-calling works today, for the sentence that refuses a model without it.
TOOL_MODELS = (
    "Qwen3 30B-A3B Instruct and gpt-oss 20B in the catalog, and other Qwen2.5/Qwen3, Mistral (with [TOOL_CALLS] in "
    "its template) and DeepSeek-V3 models (their chat templates show the model its tools and we read their calls)"
)


@dataclass(frozen=True)
class Shaped:
    sampling: Sampling
    tools: list[dict]
    fmt: ToolFormat | None = None
    think: ThinkFormat | None = None  # the reply's thinking format; None: the reply is not read for a thought
    opened: bool = False  # the prompt opened the thought: the reply starts inside it
    keep: frozenset[str] = frozenset()  # the tool format's markers that are special tokens: the reply keeps them
    variables: dict | None = None  # the chat template's switches the request sets (enable_thinking)
    channels: bool = False  # a GPT-OSS reply without tools: its harmony channels read (harmony_reply.reader)

    def submit_options(self) -> dict:
        """Runtime.submit's keywords beyond the prompt and sampling: the tools, the markers the reply keeps, the
        template's switches."""
        options = ({"tools": self.tools} if self.tools else {}) | ({"keep": self.keep} if self.keep else {})
        return options | ({"variables": self.variables} if self.variables else {})

    def calls(self) -> CallStream | None:
        """A new reader of the reply's tool calls; None when the model may not call any."""
        return self.fmt.reader(self.tools) if self.fmt is not None and self.tools else None

    def parts(self, stops: list[str]) -> ReplyParts:
        """A new reader of the reply: cut at `stops`, its thought apart from its content, its tool calls."""
        think = ThinkSplit(self.think, self.opened) if self.think is not None else None
        return ReplyParts(stops, think, harmony_reply.reader(self.opened) if self.channels else self.calls())


def shape(runtime: LoadedRuntime, req: ApiRequest) -> Shaped:
    """Blocking (renders and compiles): run it on a thread. Raises ApiError 400 for what the model cannot do."""
    from fmoe_local.constrained import JSON_OBJECT_SCHEMA, GrammarRefused, json_schema_grammar, lark_grammar

    sampling, fmt, keep = req.sampling, None, frozenset()
    try:
        if req.tools:
            fmt = format_of(runtime.chat_template)
            spec = runtime.response_template
            if spec is not None and "tool_calls" in (spec.get("fields") or {}):  # the checkpoint's own reader first
                opening = runtime.reply_opening()  # here, on a thread: the reply is read on the event loop
                fmt = TemplateFormat(runtime.reply_reader, opening, tuple(runtime.special_tokens()), fmt)
            if fmt is None or not runtime.supports_tools():
                raise ApiError(
                    400,
                    "The loaded model's chat template does not take tools (or writes tool calls in a format this app "
                    f"does not read yet: it reads {', '.join(f.name for f in FORMATS)}), so the model would never "
                    f"see them. Tool calling works with {TOOL_MODELS}; send this request without 'tools', or "
                    'with tool_choice "none".',
                    "tools",
                )
            for i, tool in enumerate(req.tools):  # each schema alone first, so that a refusal names its path
                params = tool["function"].get("parameters")
                if params:
                    runtime.check_grammar(json_schema_grammar(params), params, f"tools[{i}].function.parameters")
            specials = runtime.special_tokens(fmt.markers)
            keep = frozenset(specials)
            if req.tool_choice not in ("auto", "none"):
                if not fmt.can_force:
                    raise ApiError(
                        400,
                        "The loaded model's tool calls are read by its own response template, and its chat template "
                        "writes them in no format this app can force, so tool_choice 'required' or a named function "
                        'cannot be guaranteed. Send tool_choice "auto" and check the reply\'s tool_calls.',
                        "tool_choice",
                    )
                only = None if req.tool_choice == "required" else req.tool_choice
                grammar = lark_grammar(fmt.grammar(req.tools, only, req.parallel_tool_calls, specials))
                runtime.check_grammar(grammar, None, "tools")
                sampling = replace(sampling, grammar=grammar)
        rf = req.response_format
        if rf is not None and rf.type != "text" and sampling.grammar is None:
            schema = JSON_OBJECT_SCHEMA if rf.type == "json_object" else rf.json_schema.schema_
            grammar = json_schema_grammar(schema)
            runtime.check_grammar(grammar, schema, "response_format.json_schema.schema")
            sampling = replace(sampling, grammar=grammar)
    except GrammarRefused as exc:
        param = "response_format" if exc.path.startswith("response_format") else "tools"
        raise ApiError(400, str(exc), param) from exc
    except ValueError as exc:  # a schema llguidance cannot even read as JSON schema
        raise ApiError(400, f"A JSON schema in the request cannot be read: {exc}.", "response_format") from exc
    chat = isinstance(req.prompt, list)
    think = reasoning.format_of(runtime.chat_template) if chat else None
    marks = reasoning.budget_format(runtime.chat_template, bool(req.tools)) if chat else None  # think's or harmony's
    variables = _thinking(runtime.chat_template or "", marks, req.thinking)
    # GPT-OSS without tools: its channels are read here (with tools, by the tool format's reader, HarmonyStream too)
    channels = chat and not req.tools and harmony_reply.writes_channels(runtime.chat_template)
    if marks is None or (think is None and not channels and req.thought_budget is None):  # nothing to read or hold
        return Shaped(sampling, req.tools, fmt, keep=keep, variables=variables)
    last = req.prompt[-1] if req.prompt else {}
    prefill = last.get("role") == "assistant" and bool(last.get("content"))  # the reply goes on from its text
    opened = marks.opened(last["content"] if prefill else runtime.reply_opening())
    budget = req.thought_budget
    # A budget of max_new_tokens or more forces nothing, but with a grammar it still says where the grammar starts:
    # after the thought, not inside it.
    if budget is not None and (budget < sampling.max_new_tokens or sampling.grammar is not None):
        sampling = replace(sampling, thought=ThoughtBudget(budget, marks.start, marks.end, marks.close, opened))
    # A prefill that leaves no analysis open goes on inside its own message, with no header to read: as written.
    if channels and (opened or not prefill) and (sampling.grammar is None or grammar_after_thought(sampling)):
        return Shaped(sampling, [], None, None, opened, harmony_reply.kept(runtime), variables, channels=True)
    if think is None or (sampling.grammar is not None and not grammar_after_thought(sampling)):
        return Shaped(sampling, req.tools, fmt, keep=keep, variables=variables)
    if opened and isinstance(fmt, TemplateFormat):  # ThinkSplit takes the thought off before the parser reads
        fmt = fmt.after_thought(think.end)
    return Shaped(sampling, req.tools, fmt, think, opened, keep, variables)


def _thinking(template: str, think: ThinkFormat | None, asked: str | None) -> dict | None:
    """The template switch an Anthropic `thinking` option sets: Qwen3's hybrid models take `enable_thinking`;
    "disabled" for a model that thinks with no switch to stop it (`think`: the format it thinks in, <think> or
    GPT-OSS's analysis channel, whose reasoning effort has no "none") is refused by name; "enabled"/"adaptive" for a
    model that does not think is a reply without a thought (Anthropic's budget is a most, not a least)."""
    if asked is None:
        return None
    if "enable_thinking" in template:
        return {"enable_thinking": asked != "disabled"}
    if asked == "disabled" and think is not None:
        raise ApiError(
            400,
            "The loaded model thinks before every answer and its chat template has no switch to turn that off, so "
            "'thinking' cannot be disabled. Send the request without 'thinking': the thought comes back as thinking "
            "blocks, apart from the answer.",
            "thinking",
        )
    return None
