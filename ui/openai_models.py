"""The bodies of /v1/chat/completions and /v1/completions as pydantic models: what each field may be.

Scope: the fields' types, ranges and shapes (pydantic checks them), the few rules that span fields (a named
tool_choice names a tool that was sent), and `refusal`: the sentence a 400 says for a field that fails, from
REFUSALS (one place for every such sentence; `param` is the top-level field, as OpenAI reports it). Fields the app
does not read are ignored, as OpenAI's own server ignores unknown ones. It does NOT check the JSON as a whole
(openai_request.read_body runs first: encoding, depth, numbers, surrogates) nor turn a body into what the runtime
takes (openai_request.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

# OpenAI caps `stop` at 4, but local servers (LM Studio, Ollama, vLLM) take more and editors send more (Continue
# sends its whole list): refusing them refuses the editor. Each stop string is searched for after every token, so
# a bound stays, well above what clients send.
MAX_STOPS = 16
ROLES = "system, developer, user, assistant or tool"

# The sentence a 400 says when pydantic finds a field wrong, by the field's path without list indices
# (`messages.tool_calls`); the longest path that names the failing place wins. A validator's own refusal
# (`refused`) says its sentence instead.
REFUSALS = {
    "messages": "'messages' must be a non-empty list of {role, content}.",
    "messages.role": f"Each message needs a role: {ROLES}.",
    "messages.content": "Each message's content must be text.",
    "messages.tool_calls": "An assistant message's 'tool_calls' must be a list of {id, type: \"function\", "
    "function: {name, arguments}}, arguments a JSON string.",
    "messages.tool_call_id": "A tool message's 'tool_call_id' must be the id of the call it answers, a string.",
    "messages.name": "A message's 'name' must be a string.",
    "prompt": "'prompt' must be a non-empty string.",
    "echo": "'echo' must be true or false.",
    "max_tokens": "'max_tokens' must be a whole number of at least 1.",
    "max_completion_tokens": "'max_completion_tokens' must be a whole number of at least 1.",
    "temperature": "'temperature' must be a number from 0.0 to 2.0.",
    "top_p": "'top_p' must be a number from 0.0 to 1.0.",
    "top_k": "'top_k' must be a whole number: -1 or 0 for no limit, else how many tokens to keep.",
    "repetition_penalty": "'repetition_penalty' must be a number above 0 and at most 2 (1 is off).",
    "frequency_penalty": "'frequency_penalty' must be a number from -2.0 to 2.0.",
    "presence_penalty": "'presence_penalty' must be a number from -2.0 to 2.0.",
    "logit_bias": "'logit_bias' must map token ids (as strings, such as \"50256\") to numbers from -100 to 100.",
    "seed": "'seed' must be a whole number.",
    "n": "Only n=1 is supported: this app generates one reply at a time.",
    "best_of": "Only best_of=1 is supported: this app generates one reply at a time.",
    "stop": f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings.",
    "stream": "'stream' must be true or false.",
    "stream_options": "'stream_options' must be an object such as {\"include_usage\": true}.",
    "response_format": '\'response_format\' must be {"type": "text"}, {"type": "json_object"} or '
    '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}.',
    "tools": '\'tools\' must be a list of {"type": "function", "function": {"name", "description", '
    '"parameters"}}, each name letters, digits, _ or - (at most 64), parameters a JSON schema object.',
    "tool_choice": '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", '
    '"function": {"name": ...}}.',
    "parallel_tool_calls": "'parallel_tool_calls' must be true or false.",
    "thinking_token_budget": "'thinking_token_budget' must be a whole number of at least 0: the most tokens the "
    "model may think before its answer.",
    "logprobs": "'logprobs' is not supported: this app does not return token probabilities.",
    "top_logprobs": "'top_logprobs' is not supported: this app does not return token probabilities.",
    "suffix": "'suffix' is not supported: this app continues a prompt but does not fill in between.",
}


def refused(sentence: str, param: str | None = None) -> PydanticCustomError:
    """A validator's refusal: the 400 says `sentence` as it is; `param`: the field it names, where the validator
    spans several (else the field being validated)."""
    # The sentence goes in the context, not the template: pydantic fills a template's {name} from the context and
    # leaves every other brace as it is (no {{ escape), so a sentence quoting JSON, escaped, kept its doubled braces.
    return PydanticCustomError("refused", "{sentence}", {"sentence": sentence, "param": param})


def refusal(exc: ValidationError, sentences: dict[str, str] | None = None) -> tuple[str, str | None]:
    """(sentence, param) for the first thing pydantic found wrong; `sentences`: another API's REFUSALS (the
    Anthropic bodies', anthropic_models.py)."""
    sentences = REFUSALS if sentences is None else sentences
    error = exc.errors(include_url=False)[0]
    names = [part for part in error["loc"] if isinstance(part, str) and not part.startswith(("function-", "list["))]
    param = names[0] if names else None
    if error["type"] == "refused":
        return error["msg"], (error.get("ctx") or {}).get("param") or param
    for end in range(len(names), 0, -1):
        if (sentence := sentences.get(".".join(names[:end]))) is not None:
            return sentence, param
    return f"The request body is not valid: {error['msg']}.", param


class _Strict(BaseModel):
    # strict: true is not 1, "5" is not 5 (OpenAI refuses both); extra fields are ignored, as OpenAI's are
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | None = None  # a list of parts arrives as text (`_parts`)
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, content: object) -> object:
        return _text_of(content) if isinstance(content, list) else content

    @model_validator(mode="after")
    def _complete(self) -> Message:
        if self.role == "function":
            raise refused(
                "Legacy 'function' messages are not supported: send the result as a 'tool' message with the "
                "'tool_call_id' of the call it answers."
            )
        if self.role == "tool" and self.tool_call_id is None:
            raise refused("A tool message needs 'tool_call_id': the id of the tool call it answers.")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise refused("Each message's content must be text.")
        return self


def _text_of(parts: list) -> str:
    """A message's content parts as one text, joined by "\n" as vLLM's and TensorRT-LLM's OpenAI servers join them
    (OpenAI does not document it). A part the model cannot read (image_url, input_audio, file…) is refused: answered
    without it, the reply would be about something the model never saw."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "refusal"):  # a refusal: an earlier assistant turn's text, in OpenAI's history
            what = f"a '{kind}' part" if isinstance(kind, str) else "a content part without a type"
            raise refused(f"This model reads text only, and a message has {what}. Send text parts only.")
        text = part.get(kind)
        if not isinstance(text, str):
            raise refused(f"A '{kind}' content part needs '{kind}', a string.")
        texts.append(text)
    return "\n".join(texts)


class FunctionDef(_Strict):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema; compiled (and refused, naming its path) by the runtime
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: StrictStr = "reply"
    description: StrictStr | None = None
    schema_: dict = Field(alias="schema")  # `schema` shadows BaseModel's own attribute
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise refused(
                'response_format {"type": "json_schema"} needs \'json_schema\': {"name": ..., "schema": {...}}.'
            )
        return self


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None


Number = StrictFloat | StrictInt


class _Body(_Strict):
    model: object = None  # any: the loaded model answers
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None  # 0 keeps only the likeliest token: greedy
    # Not OpenAI's, but what vLLM, llama.cpp and LM Studio take and their clients send.
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    logit_bias: dict | None = None  # its keys and values checked by `_bias` (a JSON object's keys are text)
    seed: StrictInt | None = None
    n: Literal[1] | None = None
    stop: StrictStr | list[StrictStr] | None = Field(None, validate_default=True)  # a list after `_stops`
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if not all(stops) or len(stops) > MAX_STOPS:
            raise refused(REFUSALS["stop"])
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict | None) -> dict | None:
        for token, value in (bias or {}).items():
            if not (token.isascii() and token.isdigit() and len(token) <= 9):
                raise refused(REFUSALS["logit_bias"])
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise refused(REFUSALS["logit_bias"])
        return bias

    @property
    def max_tokens_param(self) -> str:
        """max_completion_tokens is OpenAI's newer name; null means "not given" (clients send their unset fields as
        null), so it must not hide a max_tokens beside it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: Literal[False] | None = None
    top_logprobs: Literal[0] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # Not OpenAI's, but vLLM's name for a cap on the reply's thinking (Anthropic's budget_tokens): structured.py.
    thinking_token_budget: Annotated[StrictInt, Field(ge=0)] | None = None
    functions: list | None = None  # OpenAI's deprecated form of tools
    function_call: object = None

    @model_validator(mode="after")
    def _tools_agree(self) -> ChatBody:
        if self.functions and self.function_call != "none":
            raise refused(
                "'functions' is OpenAI's deprecated form of tools and is not supported: send 'tools' with "
                "'tool_choice' instead.",
                "functions",
            )
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise refused("Each tool in 'tools' needs a name of its own.", "tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise refused(
                f"'tool_choice' names the function '{self.tool_choice.function.name}', which is not in 'tools'. "
                "Send that function in 'tools', or choose another.",
                "tool_choice",
            )
        if self.tool_choice == "required" and not names:
            raise refused(
                "'tool_choice' is \"required\" but no 'tools' were sent. Send the tools to choose from.", "tool_choice"
            )
        return self


class CompletionBody(_Body):
    prompt: StrictStr | list | None = Field(None, validate_default=True)  # one string: `_one_prompt`
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: Literal[1] | None = None
    logprobs: Literal[0, False] | None = None  # a count here: 0 asks for none

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> None:
        if suffix:
            raise refused(REFUSALS["suffix"])

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: object) -> str:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # one prompt in a list, as the openai client sends a batch of one
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            raise refused("Send one prompt per request: this app generates one reply at a time.")
        if isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
            raise refused("Send the prompt as text: token ids are not supported.")
        if not isinstance(prompt, str) or not prompt:
            raise refused(REFUSALS["prompt"])
        return prompt
