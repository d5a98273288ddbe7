"""Tool calls in a model's own text format: which format a chat template writes, the grammar that forces a call
(tool_choice "required" or a named function), and the reply's text parsed back into OpenAI's `tool_calls`.

Formats: Hermes/Qwen (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen2.5/Qwen3 and the many
templates that copied it), found from the template's own text (`format_of`); Mistral's `[TOOL_CALLS]`, GPT-OSS's
harmony and DeepSeek's tool tokens are special tokens that the runtime's text leaves out, so they are not read yet
(a template that writes them is refused as having no tool format we read). A reply whose call text is malformed
(not JSON, an unknown function, arguments that are not an object) is returned as content, never an error: an
unconstrained model may write anything. It does NOT render the prompt (the model's chat template does, given the
tools: fmoe_local/engine.py) or compile grammars (fmoe_local/constrained.py checks and enforces the text built here).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it

    def openai(self, index: int) -> dict:
        return {
            "index": index,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # the text a reply's tool calls begin with
    end: str  # the text a call ends with

    def parse(self, text: str, tools: list[dict]) -> tuple[str, list[ToolCall]] | None:
        """(content before the calls, the calls) from a reply's text; None when it holds no well-formed call of one
        of `tools` (the caller then returns the text as content)."""
        at = text.find(self.start)
        if at < 0:
            return None
        names = {t["function"]["name"] for t in tools}
        pattern = re.escape(self.start) + r"\s*(.*?)\s*" + re.escape(self.end)
        rest = text[at:]
        if re.sub(pattern, "", rest, flags=re.DOTALL).strip():
            return None  # text between or after the calls, or a call never closed: not a well-formed call
        try:
            objects = [json.loads(m.group(1)) for m in re.finditer(pattern, rest, re.DOTALL)]
        except ValueError:
            return None
        calls = []
        for obj in objects:
            if not isinstance(obj, dict) or obj.get("name") not in names:
                return None
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
        return (text[:at].strip(), calls) if calls else None

    def grammar(self, tools: list[dict], only: str | None = None, parallel: bool = True) -> str:
        """A Lark grammar (llguidance's dialect) of a reply that is nothing but calls of `tools` — one call of
        `only` when a function is named, one or more otherwise (one when not `parallel`) — each call's arguments
        held to its parameters."""
        chosen = [t for t in tools if only is None or t["function"]["name"] == only]
        call = {"anyOf": [_call_schema(t["function"]) for t in chosen]}
        call["x-guidance"] = {"whitespace_flexible": False}
        one = f'"{_lark(self.start)}\\n" obj "\\n{_lark(self.end)}"'
        rule = "call" if only or not parallel else 'call ("\\n" call)*'
        return f"start: {rule}\ncall: {one}\nobj: %json {json.dumps(call)}\n"


def _call_schema(function: dict) -> dict:
    params = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _lark(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
FORMATS = (HERMES,)


def format_of(template: str | None) -> ToolFormat | None:
    """The format a chat template writes tool calls in (it shows the model an example or writes past calls in it);
    None when it is none of FORMATS."""
    for fmt in FORMATS:
        if template and fmt.start in template:
            return fmt
    return None


class CallStream:
    """A reply's text as it streams, when the model may call tools: text before a call is passed on at once (less
    what may still become the start of one, held until it cannot); from the call's start on, the text is kept and
    parsed when the reply ends."""

    def __init__(self, fmt: ToolFormat, tools: list[dict]) -> None:
        self.fmt, self.tools = fmt, tools
        self.text, self.sent, self.calling = "", 0, False

    def add(self, delta: str) -> str:
        """Content that may be sent now."""
        self.text += delta
        if self.calling:
            return ""
        at = self.text.find(self.fmt.start, self.sent)
        if at >= 0:
            self.calling = True
            out, self.sent = self.text[self.sent : at], at
            return out
        safe = len(self.text)
        for keep in range(min(len(self.fmt.start) - 1, len(self.text)), 0, -1):
            if self.fmt.start.startswith(self.text[-keep:]):
                safe -= keep
                break
        out, self.sent = self.text[self.sent : max(safe, self.sent)], max(safe, self.sent)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, the calls): a call that does not parse is content, sent as it was written."""
        parsed = self.fmt.parse(self.text[self.sent :], self.tools) if self.calling else None
        if parsed is None:
            rest, self.sent = self.text[self.sent :], len(self.text)
            return rest, []
        before, calls = parsed
        self.sent = len(self.text)
        return before, calls
