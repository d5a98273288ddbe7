"""The body of a POST /v1/messages (Anthropic's Messages API) as pydantic models: what each field may be.

Scope: the fields' types, ranges and shapes, the content blocks this app reads (text, tool_use, tool_result,
thinking), the rules that span fields (a named tool_choice names a tool that was sent), and REFUSALS: the sentence
a 400 says for each field, by its path (openai_models.refusal picks it; `param` is not part of Anthropic's error
shape, so only the sentence is sent). Fields the app does not read (metadata, cache_control, service_tier…) are
ignored, as the OpenAI side ignores unknown ones; what it cannot do (images, documents, Anthropic's server tools)
is refused by name. It does NOT check the JSON as a whole (openai_request.read_body runs first) nor turn the body
into what the runtime takes (anthropic_request.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from ui.openai_models import MAX_STOPS, refused

# Anthropic's rule for a tool's name.
TOOL_NAME = r"^[A-Za-z0-9_-]{1,128}$"
# Block types of Anthropic's API that this app cannot read, and why (a 400 naming the type).
UNREADABLE = {
    "image": "This model reads text only, and a message has an 'image' block. Send text blocks only.",
    "document": "This model reads text only, and a message has a 'document' block. Send its text as a text block.",
    "search_result": "A 'search_result' block is not supported here. Send its text as a text block.",
    "server_tool_use": "Anthropic's server tools do not run here, and a message has a 'server_tool_use' block.",
    "web_search_tool_result": "Anthropic's server tools do not run here: send the search results as text.",
    "container_upload": "Anthropic's code execution does not run here, and a message has a 'container_upload' block.",
}
BLOCKS = "text, tool_use, tool_result or thinking"
MIN_BUDGET = 1024  # Anthropic's least thinking.budget_tokens: its API refuses a smaller one

REFUSALS = {
    "model": "'model' must be a string (any name: the model this app has loaded answers).",
    "max_tokens": "'max_tokens' must be a whole number of at least 1: the Messages API requires it.",
    "messages": '\'messages\' must be a non-empty list of {role: "user" or "assistant", content}.',
    "messages.role": 'Each message\'s role must be "user" or "assistant"; a system prompt goes in \'system\'.',
    "messages.content": "Each message's content must be text or a list of content blocks (" + BLOCKS + ").",
    "messages.content.text.text": "A text block needs 'text', a string.",
    "messages.content.tool_use.id": "A tool_use block needs 'id', a string.",
    "messages.content.tool_use.name": "A tool_use block needs 'name', a string.",
    "messages.content.tool_use.input": "A tool_use block's 'input' must be a JSON object: the tool's arguments.",
    "messages.content.tool_result.tool_use_id": "A tool_result block needs 'tool_use_id': the id of the tool_use it answers.",
    "messages.content.tool_result.content": "A tool_result block's 'content' must be text or a list of text blocks.",
    "messages.content.tool_result.is_error": "A tool_result block's 'is_error' must be true or false.",
    "messages.content.thinking.thinking": "A thinking block needs 'thinking', a string.",
    "system": '\'system\' must be text or a list of {"type": "text", "text": ...} blocks.',
    "stop_sequences": f"'stop_sequences' must be a list of up to {MAX_STOPS} non-empty strings.",
    "temperature": "'temperature' must be a number from 0.0 to 1.0.",
    "top_p": "'top_p' must be a number from 0.0 to 1.0.",
    "top_k": "'top_k' must be a whole number of at least 0 (0 keeps every token).",
    "stream": "'stream' must be true or false.",
    "tools": "'tools' must be a list of {name, description, input_schema}, each name letters, digits, _ or - (at "
    "most 128), input_schema a JSON schema object.",
    "tool_choice": '\'tool_choice\' must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
    '{"type": "tool", "name": ...}.',
    "thinking": '\'thinking\' must be {"type": "enabled", "budget_tokens": ...}, {"type": "adaptive"} or '
    '{"type": "disabled"}.',
    "output_config": '\'output_config\' must be an object such as {"format": {"type": "json_schema", '
    '"schema": {...}}}.',
}


class _Strict(BaseModel):
    # As the OpenAI bodies: true is not 1, "5" is not 5; unknown fields (cache_control, metadata…) are ignored.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class TextBlock(_Strict):
    type: Literal["text"]
    text: StrictStr


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: list[TextBlock] | StrictStr = ""
    is_error: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: object) -> object:
        content = data.get("content") if isinstance(data, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                what = f"a '{kind}' block" if isinstance(kind, str) else "a block without a type"
                raise refused(f"This model reads text only, and a tool_result holds {what}. Send text blocks only.")
        return data

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]  # Claude's encrypted thinking: nothing a local model can read, left out


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: list[Block] | StrictStr  # the list first: its errors are the ones a 400 names

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: object) -> object:
        """A block type this app cannot read is refused by name (pydantic would only say the tag is wrong)."""
        content = data.get("content") if isinstance(data, dict) else None
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in UNREADABLE:
                raise refused(UNREADABLE[kind], "messages")
            if kind not in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
                what = f"'{kind}'" if isinstance(kind, str) else "a block without a type"
                raise refused(f"A message's content has {what}; this app reads {BLOCKS} blocks.", "messages")
        return data

    @property
    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class Tool(_Strict):
    type: Literal["custom"] | None = None
    name: Annotated[StrictStr, Field(pattern=TOOL_NAME)]
    description: StrictStr | None = None
    input_schema: dict

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: object) -> object:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise refused(
                f"'tools' has Anthropic's server tool '{kind}', which does not run here. Send your own tools as "
                "{name, description, input_schema} and run them yourself.",
                "tools",
            )
        return data


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and self.name is None:
            raise refused('tool_choice {"type": "tool"} needs \'name\': the tool the reply must use.', "tool_choice")
        return self


class Thinking(_Strict):
    # Acted on where the chat template has a switch (Qwen3's enable_thinking); "disabled" refused for a model that
    # always thinks (ui/structured.py). Otherwise a local model thinks when its training makes it, and what it thinks
    # comes back as thinking blocks. "enabled" needs budget_tokens, at least MIN_BUDGET and less than max_tokens, as
    # Anthropic's API requires (MessagesBody._agree): a thought that reaches it has its end written for the model,
    # and the reply goes on as the answer (fmoe_local/logits_rules.py).
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = None

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        if self.type != "enabled":
            if self.budget_tokens is not None:  # Anthropic's "disabled" and "adaptive" take no budget either
                raise refused(
                    f'\'thinking.budget_tokens\' goes with {{"type": "enabled"}} only, not with '
                    f'"{self.type}". Send {{"type": "enabled", "budget_tokens": ...}}, or leave the budget out.',
                    "thinking",
                )
            return self
        if self.budget_tokens is None:
            raise refused(
                "'thinking' {\"type\": \"enabled\"} needs 'budget_tokens': the most tokens the model may think, at "
                f'least {MIN_BUDGET} and less than max_tokens. Send one, or {{"type": "adaptive"}} for no budget.',
                "thinking",
            )
        if self.budget_tokens < MIN_BUDGET:
            raise refused(
                f"'thinking.budget_tokens' must be at least {MIN_BUDGET}, as Anthropic's API requires. Send "
                f'{MIN_BUDGET} or more (less than max_tokens), or {{"type": "adaptive"}} for no budget.',
                "thinking",
            )
        return self


class JsonFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")  # `schema` shadows BaseModel's own attribute


class OutputConfig(_Strict):
    format: JsonFormat | None = None


Number = StrictFloat | StrictInt


class MessagesBody(_Strict):
    model: StrictStr | None = None  # any: the loaded model answers
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: list[TextBlock] | StrictStr | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    stream: StrictBool | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _agree(self) -> MessagesBody:
        stops = self.stop_sequences or []
        if not all(stops) or len(stops) > MAX_STOPS:
            raise refused(REFUSALS["stop_sequences"], "stop_sequences")
        budget = self.thinking.budget_tokens if self.thinking is not None and self.thinking.type == "enabled" else None
        if budget is not None and budget >= self.max_tokens:
            raise refused(
                f"'max_tokens' ({self.max_tokens}) must be greater than 'thinking.budget_tokens' ({budget}): the "
                "thought and the answer both count toward max_tokens. Raise max_tokens or lower budget_tokens.",
                "thinking",
            )
        names = [t.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise refused("Each tool in 'tools' needs a name of its own.", "tools")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise refused(
                f"'tool_choice' names the tool '{choice.name}', which is not in 'tools'. Send that tool in 'tools', "
                "or choose another.",
                "tool_choice",
            )
        if choice is not None and choice.type == "any" and not names:
            raise refused(
                "'tool_choice' is {\"type\": \"any\"} but no 'tools' were sent. Send the tools to choose from.",
                "tool_choice",
            )
        return self


class CountTokensBody(_Strict):
    """POST /v1/messages/count_tokens: what a request would read, without max_tokens or sampling."""

    model: StrictStr | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: list[TextBlock] | StrictStr | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
