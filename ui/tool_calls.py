"""Tool calls in a model's own text format: which format a chat template writes, the grammar that forces a call
(tool_choice "required" or a named function), and the reply's text parsed back into OpenAI's `tool_calls`.

Formats, each found from the template's own text (`format_of`): Hermes/Qwen (`<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`, Qwen2.5/Qwen3 and the many templates that copied it); Mistral's
`[TOOL_CALLS] [{"name": ..., "arguments": ...}]` (and the later `[TOOL_CALLS]name[ARGS]{...}`); GPT-OSS's harmony
(`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`); DeepSeek-V3's tool tokens
(`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the arguments in a json code block; V3.1's
`NAME<｜tool▁sep｜>{...}`). Markers that are special tokens (`ToolFormat.markers`) are dropped from a reply's text
unless the request keeps them (Runtime.submit's `keep`, the markers the tokenizer has as special tokens): the
parser reads them, and every text a user sees has them removed (`ToolFormat.clean`). As a reply streams
(`ToolFormat.reader`), its text before a call is sent at once and the call is held and parsed at the end
(CallStream); a harmony reply is read message by message, its channels sent as they come (HarmonyStream); a reply
read by the checkpoint's own response template streams through transformers' parser (TemplateStream). A reply
whose call text is malformed (not JSON, an unknown function, arguments that are not an object) is returned as
content, never an error: an unconstrained model may write anything. It does NOT render the prompt (the model's chat
template does, given the tools: fmoe_local/engine.py) or compile grammars (fmoe_local/constrained.py checks and
enforces the text built here).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ui.reasoning import CONTENT, REASONING, Piece, partial

if TYPE_CHECKING:
    from ui.loaded_runtime import ReplyReader

log = logging.getLogger(__name__)


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
    """One format: `start`, the text a reply's calls begin with ("" for harmony, whose reply is channels from its
    first token: its reader finds calls by their messages' headers); `markers`, the format's marker texts that are
    special tokens where the format is used."""

    name: str
    start: str
    markers: tuple[str, ...] = ()

    def parse(self, text: str, tools: list[dict]) -> tuple[str, list[ToolCall]] | None:
        """(content before the calls, the calls) from a reply's text; None when it holds no well-formed call of one
        of `tools` (the caller then returns the text as content, `clean`ed)."""
        at = text.find(self.start)
        if at < 0:
            return None
        found = self._objects(text[at:])
        if not found:
            return None
        names = {t["function"]["name"] for t in tools}
        calls = []
        for name, args in found:
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(name, str) or name not in names or not isinstance(args, dict):
                return None  # a name that is no string (a list: unhashable) is malformed like an unknown one
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return self.clean(text[:at]).strip(), calls

    @property
    def can_force(self) -> bool:
        """Whether `grammar` can force a call in this format."""
        return True

    def _objects(self, rest: str) -> list[tuple[object, object]] | None:
        """(name, arguments) of each call in `rest` (the text from `start` on), or None when it is not only calls."""
        raise NotImplementedError

    def reader(self, tools: list[dict]) -> CallStream:
        """A new reader of one streamed reply that may call `tools`."""
        return CallStream(self, tools)

    def clean(self, text: str) -> str:
        """`text` as a user may see it: the markers that are special tokens left out, as they are from any reply."""
        for marker in self.markers:
            text = text.replace(marker, "")
        return text

    def grammar(
        self, tools: list[dict], only: str | None = None, parallel: bool = True, specials: Mapping[str, int] = {}
    ) -> str:
        """A Lark grammar (llguidance's dialect) of a reply that is nothing but calls of `tools` — one call of
        `only` when a function is named, one or more otherwise (one when not `parallel`) — each call's arguments
        held to its parameters. `specials`: the markers that are special tokens of the model's tokenizer, by id
        (written as that token, never spelled out in text)."""
        chosen = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
        return self._grammar(chosen, bool(parallel and only is None), lambda m: _lit(m, specials))

    def _grammar(self, functions: list[dict], many: bool, lit) -> str:  # noqa: ANN001 - marker → Lark literal
        raise NotImplementedError


def _lit(text: str, specials: Mapping[str, int]) -> str:
    if text in specials:
        return f"<[{specials[text]}]>"
    return json.dumps(text)  # a JSON string is a Lark string literal


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps(schema | {"x-guidance": {"whitespace_flexible": False}})


def _params(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _call_schema(function: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": _params(function)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _json_at(text: str, at: int) -> tuple[object, int] | None:
    """The JSON value at `at` (after whitespace) and where it ends; None if there is none."""
    try:
        return json.JSONDecoder().raw_decode(text, len(text) - len(text[at:].lstrip()))
    except ValueError:
        return None


class _Hermes(ToolFormat):
    def _objects(self, rest: str) -> list[tuple[object, object]] | None:
        end = "</tool_call>"
        pattern = re.escape(self.start) + r"\s*(.*?)\s*" + re.escape(end)
        if re.sub(pattern, "", rest, flags=re.DOTALL).strip():
            return None  # text between or after the calls, or a call never closed: not a well-formed call
        try:
            objects = [json.loads(m.group(1)) for m in re.finditer(pattern, rest, re.DOTALL)]
        except ValueError:
            return None
        if not all(isinstance(o, dict) for o in objects):
            return None
        return [(o.get("name"), o.get("arguments", o.get("parameters", {}))) for o in objects]

    def _grammar(self, functions: list[dict], many: bool, lit) -> str:  # noqa: ANN001
        one = f"{lit(self.start + chr(10))} obj {lit(chr(10) + '</tool_call>')}"
        rule = 'call ("\\n" call)*' if many else "call"
        obj = _json_rule({"anyOf": [_call_schema(f) for f in functions]})
        return f"start: {rule}\ncall: {one}\nobj: {obj}\n"


class _Mistral(ToolFormat):
    def _objects(self, rest: str) -> list[tuple[object, object]] | None:
        body = rest[len(self.start) :]
        array = _json_at(body, 0)
        if array is not None:  # [TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]
            value, end = array
            if body[end:].strip() or not isinstance(value, list) or not all(isinstance(o, dict) for o in value):
                return None
            return [(o.get("name"), o.get("arguments", {})) for o in value]
        found = []  # [TOOL_CALLS]name[ARGS]{...}, repeated (Mistral's later tokenizers)
        for part in body.split(self.start):
            name, sep, args = part.partition("[ARGS]")
            value = _json_at(args, 0) if sep else None
            if value is None or args[value[1] :].strip():
                return None
            found.append((name.strip(), value[0]))
        return found

    def _grammar(self, functions: list[dict], many: bool, lit) -> str:  # noqa: ANN001
        calls = {"type": "array", "items": {"anyOf": [_call_schema(f) for f in functions]}, "minItems": 1}
        calls |= {} if many else {"maxItems": 1}
        return f'start: {lit(self.start)} " " calls\ncalls: {_json_rule(calls)}\n'


_CALL_BEGIN, _CALL_END, _SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALLS_END = "<｜tool▁calls▁end｜>"


class _DeepSeek(ToolFormat):
    """`block`: V3's form (`function<｜tool▁sep｜>NAME` and the arguments in a json code block); else V3.1's."""

    block: bool = True

    def __init__(self, name: str, block: bool) -> None:
        super().__init__(
            name, "<｜tool▁calls▁begin｜>", ("<｜tool▁calls▁begin｜>", _CALL_BEGIN, _CALL_END, _SEP, _CALLS_END)
        )
        object.__setattr__(self, "block", block)

    def _objects(self, rest: str) -> list[tuple[object, object]] | None:
        body = rest[len(self.start) :].strip()
        if body.endswith(_CALLS_END):
            body = body[: -len(_CALLS_END)]  # the end may also be cut by the end of the reply (an EOS after it)
        found = []
        for part in body.split(_CALL_END):
            if not part.strip():
                continue
            if not part.lstrip().startswith(_CALL_BEGIN):
                return None
            head, sep, args = part.lstrip()[len(_CALL_BEGIN) :].partition(_SEP)
            if not sep:
                return None
            if head.strip() == "function":  # V3: NAME, then the arguments in a json code block
                name, _, args = args.partition("\n")
                args = args.strip().removeprefix("```json").removesuffix("```")
            else:
                name = head
            value = _json_at(args, 0)
            if value is None or args[value[1] :].strip():
                return None
            found.append((name.strip(), value[0]))
        return found or None

    def _grammar(self, functions: list[dict], many: bool, lit) -> str:  # noqa: ANN001
        rules, alts = [], []
        for i, f in enumerate(functions):
            args = _json_rule(_params(f))
            if self.block:
                head = (
                    f'{lit(_CALL_BEGIN)} "function" {lit(_SEP)} {json.dumps(f["name"] + chr(10) + "```json" + chr(10))}'
                )
                tail = f"{json.dumps(chr(10) + '```')} {lit(_CALL_END)}"
            else:
                head, tail = f"{lit(_CALL_BEGIN)} {json.dumps(f['name'])} {lit(_SEP)}", lit(_CALL_END)
            rules.append(f"call{i}: {head} args{i} {tail}\nargs{i}: {args}")
            alts.append(f"call{i}")
        rule = "call call*" if many else "call"
        call = " | ".join(alts)
        return f"start: {lit(self.start)} {rule} {lit(_CALLS_END)}\ncall: {call}\n" + "\n".join(rules) + "\n"


_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>", "<|end|>", "<|return|>")
_HARMONY_CALL = re.compile(
    r"(?:<\|start\|>assistant)?(?:\s*to=functions\.(?P<a>[^\s<]+))?\s*<\|channel\|>commentary"
    r"(?:\s+to=functions\.(?P<b>[^\s<]+))?\s*(?:<\|constrain\|>\s*json|json)?\s*<\|message\|>"
)

_HARMONY_MESSAGE = re.compile(
    r"<\|channel\|>([^<]*)(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)(?=<\|end\|>|<\|start\|>|<\|call\|>|<\|return\|>|$)",
    re.DOTALL,
)


class _Harmony(ToolFormat):
    """GPT-OSS: the reply is messages on channels (analysis: its reasoning; commentary to=functions.NAME: a call;
    final: the answer), each opened by <|channel|> and its body by <|message|>; a call ends with <|call|>, which is
    one of the model's end tokens, so the text may stop without it."""

    def parse(self, text: str, tools: list[dict]) -> tuple[str, list[ToolCall]] | None:
        found = []
        for m in _HARMONY_CALL.finditer(text):
            name = m.group("a") or m.group("b")
            value = _json_at(text, m.end())
            if name is None or value is None:
                continue  # a commentary message to the user, or a call whose text is no JSON: left as content
            after = text[value[1] :].lstrip()
            if after and not after.startswith(("<|call|>", "<|end|>", "<|start|>")):
                return None
            found.append((m.start(), name, value[0]))
        if not found:
            return None
        names = {t["function"]["name"] for t in tools}
        if any(name not in names or not isinstance(args, dict) for _, name, args in found):  # names: regex text
            return None
        calls = [ToolCall(name, json.dumps(args, ensure_ascii=False)) for _, name, args in found]
        return self.clean(text[: found[0][0]]).strip(), calls

    def reader(self, tools: list[dict]) -> CallStream:
        return HarmonyStream(self, tools)

    @staticmethod
    def _messages(text: str) -> list[tuple[str, str]]:
        """(channel, body) of each message; the channel's name without its recipient or format."""
        return [((m.group(1).split() or [""])[0], m.group(2)) for m in _HARMONY_MESSAGE.finditer(text)]

    def clean(self, text: str) -> str:
        """The final channel's text when there is one; otherwise the text of every message but the analysis
        channel's (the model's reasoning: `reasoning`); the markers and channel names left out."""
        messages = self._messages(text)
        if not messages:
            return super().clean(text)
        finals = [body for channel, body in messages if channel == "final"]
        return finals[-1] if finals else "".join(body for channel, body in messages if channel != "analysis")

    def _grammar(self, functions: list[dict], many: bool, lit) -> str:  # noqa: ANN001
        del many  # <|call|> ends the reply: one call per reply
        alts, rules = [], []
        for i, f in enumerate(functions):
            head = json.dumps(f"commentary to=functions.{f['name']} ")
            alts.append(f"call{i}")
            rules.append(
                f'call{i}: {lit("<|channel|>")} {head} {lit("<|constrain|>")} "json" {lit("<|message|>")} args{i}\n'
                f"args{i}: {_json_rule(_params(f))}"
            )
        return f"start: {' | '.join(alts)}\n" + "\n".join(rules) + "\n"


class TemplateFormat(ToolFormat):
    """A checkpoint's own response template (tokenizer_config.json's `response_template`), read by transformers'
    response parser (`read(tools, prefix)`: Runtime.reply_reader) after `opening`, the text the reply follows:
    preferred over our parsers wherever a checkpoint ships one. The reply streams through it (TemplateStream), every
    special token kept for the parser (`markers`) and left out of what a user sees. A call is forced (tool_choice
    required or named) with `forced`'s grammar, the format the chat template writes; without one, a forced call is
    refused (`can_force`). Where the parser cannot be made for a reply, `forced`'s own reader reads it."""

    def __init__(
        self,
        read: Callable[[list[dict], str], ReplyReader | None],
        opening: str,
        markers: tuple[str, ...],
        forced: ToolFormat | None,
    ) -> None:
        super().__init__("response template", "", markers)
        object.__setattr__(self, "_read", read)
        object.__setattr__(self, "opening", opening)
        object.__setattr__(self, "forced", forced)

    @property
    def can_force(self) -> bool:
        return self.forced is not None

    def reader(self, tools: list[dict]) -> CallStream:
        try:
            read = self._read(tools, self.opening)
        except Exception:  # noqa: BLE001 - an opening the parser cannot read (its errors are of no one type)
            log.warning("The response template cannot read this reply's opening: read by the family's format.")
            read = None
        if read is None and self.forced is not None:
            return self.forced.reader(tools)
        return TemplateStream(self, tools, read)

    def after_thought(self, end: str) -> TemplateFormat:
        """This format for a reply whose thought is split off before it is read (ui/reasoning.py's ThinkSplit, where
        the opening leaves one open): the parser is told the thought ended (`end`), as the text it reads has none."""
        return TemplateFormat(self._read, self.opening + end, self.markers, self.forced)

    @staticmethod
    def calls_of(message: object, tools: list[dict]) -> list[ToolCall] | None:
        """The calls of a message the parser read, each of one of `tools` with an object of arguments; None when it
        has none, or one is malformed (the reply is then content)."""
        if not isinstance(message, dict) or not message.get("tool_calls"):
            return None
        names = {t["function"]["name"] for t in tools}
        calls = []
        for call in message["tool_calls"]:
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                return None
            if function["name"] not in names:
                return None
            args = function.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(function["name"], json.dumps(args, ensure_ascii=False)))
        return calls

    def grammar(
        self, tools: list[dict], only: str | None = None, parallel: bool = True, specials: Mapping[str, int] = {}
    ) -> str:
        if self.forced is None:
            raise ValueError("a response template gives no grammar of a call")
        return self.forced.grammar(tools, only, parallel, specials)


HERMES = _Hermes("hermes", "<tool_call>")
MISTRAL = _Mistral("mistral", "[TOOL_CALLS]", ("[TOOL_CALLS]", "[ARGS]"))
DEEPSEEK_V3 = _DeepSeek("deepseek-v3", block=True)
DEEPSEEK_V31 = _DeepSeek("deepseek-v3.1", block=False)
HARMONY = _Harmony("harmony", "", _HARMONY_MARKERS)
FORMATS = (HERMES, MISTRAL, DEEPSEEK_V3, DEEPSEEK_V31, HARMONY)


def format_of(template: str | None) -> ToolFormat | None:
    """The format a chat template writes tool calls in (it shows the model an example or writes past calls in it);
    None when it is none of FORMATS."""
    if not template:
        return None
    if "to=functions." in template and "<|channel|>" in template:
        return HARMONY
    if "<｜tool▁calls▁begin｜>" in template:
        return DEEPSEEK_V3 if "```json" in template else DEEPSEEK_V31
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<tool_call>" in template:
        return HERMES
    return None


class CallStream:
    """A reply's text as it streams, when the model may call tools: text before a call is passed on at once (less
    what may still become the start of one, held until it cannot); from the call's start on, the text is kept and
    parsed when the reply ends. Its pieces are content: what reasoning a reply has is split off before
    (ui/reasoning.py), except where the format carries it (HarmonyStream)."""

    def __init__(self, fmt: ToolFormat, tools: list[dict]) -> None:
        self.fmt, self.tools = fmt, tools
        self.text, self.sent, self.calling = "", 0, False

    def add(self, delta: str) -> list[Piece]:
        """The pieces that may be sent now."""
        self.text += delta
        if self.calling:
            return []
        at = self.text.find(self.fmt.start, self.sent)
        if at >= 0:
            self.calling = True
            out, self.sent = self.text[self.sent : at], at
            return _content(self.fmt.clean(out))
        safe = len(self.text) - partial(self.text, (self.fmt.start,))
        out, self.sent = self.text[self.sent : max(safe, self.sent)], max(safe, self.sent)
        return _content(self.fmt.clean(out))

    def finish(self) -> tuple[list[Piece], list[ToolCall]]:
        """(the pieces not yet sent, the calls): a call that does not parse is content, sent as it was written less
        the format's special-token markers."""
        parsed = self.fmt.parse(self.text[self.sent :], self.tools) if self.calling else None
        if parsed is None:
            rest, self.sent = self.text[self.sent :], len(self.text)
            return _content(self.fmt.clean(rest)), []
        before, calls = parsed
        self.sent = len(self.text)
        return _content(before), calls


class TemplateStream(CallStream):
    """A reply as it streams, read by the checkpoint's response template (`reader`: transformers' ResponseParser):
    the text of its content and reasoning regions is sent as the parser lets it go (what may still be a delimiter is
    held until it is not; the leading whitespace of each kind left out, as a reply read whole was stripped); from the
    first region of another field on (a call) everything is held and read when the reply ends: the calls, and the
    content the parser found after them, each region a line of its own. Calls that do not read (malformed, of an
    unknown function, a parser error, no reader and no `forced` format) leave what was held as content: the text as
    written from the first call on where what was sent is the text before it, else the held regions' text without
    their delimiters (the parser's events say what a region holds, not where it was)."""

    def __init__(self, fmt: TemplateFormat, tools: list[dict], reader: ReplyReader | None) -> None:
        super().__init__(fmt, tools)
        self.reader, self.calling = reader, reader is None
        self.streamed = ""  # every region's text sent as it came, as the parser gave it
        self.held: list[str] = []  # every region's text from the first call on
        self.after: list[str] = []  # the content regions after the first call, one entry each
        self.fresh = {CONTENT: True, REASONING: True}  # nothing of that kind sent yet
        self.unread = -1  # where in `text` the parser stopped reading after an error (-1: it did not)

    def add(self, delta: str) -> list[Piece]:
        self.text += delta
        if self.reader is None:
            return []
        try:
            return self._route(self.reader.feed(delta))
        except Exception:  # noqa: BLE001 - the parser's errors on a malformed reply are of no one type
            log.debug("reply not read by the response template", exc_info=True)
            # What the failing delta held is lost with its events (a delimiter's last token, as a reply streams
            # token by token); what comes after it is content as written.
            self.reader, self.calling, self.unread = None, True, len(self.text)
            return []

    def finish(self) -> tuple[list[Piece], list[ToolCall]]:
        out: list[Piece] = []
        message = None
        if self.reader is not None:
            try:
                message, events = self.reader.finalize()
                out = self._route(events)
            except Exception:  # noqa: BLE001 - as in add
                log.debug("reply not read by the response template", exc_info=True)
                message = None
        calls = TemplateFormat.calls_of(message, self.tools) if self.calling else None
        if calls is not None:
            after = "\n".join(text for text in (self.fmt.clean(a).strip() for a in self.after) if text)
            return out + _content("\n" + after if after and not self.fresh[CONTENT] else after), calls
        if not self.calling:
            return out, []
        body = self.text.lstrip()
        sent = self.streamed.lstrip()
        if body.startswith(sent):  # only text before the first call was sent: the rest as written
            rest = self.text[len(self.text) - len(body) + len(sent) :]
        else:
            rest = "".join(self.held) + (self.text[self.unread :] if self.unread >= 0 else "")
        return out + _content(self.fmt.clean(rest)), []

    def _route(self, events: list[dict]) -> list[Piece]:
        out: list[Piece] = []
        for event in events:
            kind = _TEMPLATE_FIELDS.get(event.get("field"))
            if event.get("type") == "region_open":
                if kind is None:
                    self.calling = True  # a call, or a field we do not send: held from here on
                elif kind == CONTENT and self.calling:
                    self.after.append("")
                continue
            if event.get("type") != "region_chunk":
                continue
            text = event.get("text", "")
            if self.calling:
                self.held.append(text)
                if kind == CONTENT:
                    if not self.after:  # a region the parser opened before the first call
                        self.after.append("")
                    self.after[-1] += text
                continue
            self.streamed += text
            piece = self.fmt.clean(text)
            if self.fresh[kind]:
                piece = piece.lstrip()
                self.fresh[kind] = not piece
            if piece:
                out.append((kind, piece))
        return out


# A response template's fields whose text is sent as it streams, and as what.
_TEMPLATE_FIELDS = {"content": CONTENT, "reasoning_content": REASONING, "thinking": REASONING, "reasoning": REASONING}


def _content(text: str) -> list[Piece]:
    return [(CONTENT, text)] if text else []


_HARMONY_BODY_ENDS = ("<|end|>", "<|start|>", "<|call|>", "<|return|>")  # as _HARMONY_MESSAGE ends a body


class HarmonyStream(CallStream):
    """A GPT-OSS reply as it streams, its markers kept (every chat request on a harmony template keeps them; without
    tools, `tools` is empty and every call is content: ui/harmony_reply.py): each message's body is sent
    as it comes — the analysis channel's as reasoning (each message's stripped, a line between two, as a reply held
    whole was read), any other channel's as content (the final answer; a commentary message to no recipient, the
    preamble OpenAI's harmony guide says is shown to the user) — and a message's header never. From the first
    header with a recipient (commentary to=functions.NAME) on, the text is held and parsed when the reply ends
    (<|call|> is an end token: the call completes the reply), as CallStream holds a call from its start; a call
    that does not parse is content then. What may still be part of a marker is held until it cannot; so is the
    content's trailing whitespace, until more content comes (content before a call ends stripped). A reply in which
    no message opens is content less its markers, at its end. `opened`: the prompt opened an analysis message (a
    prefill that ends inside one), so the reply starts in its body; `midway`: the prompt ends inside that body's
    text (a thought being continued), so the reply's leading whitespace is the thought's own, not left out."""

    def __init__(self, fmt: ToolFormat, tools: list[dict], opened: bool = False, midway: bool = False) -> None:
        super().__init__(fmt, tools)
        self.at = 0  # where the next (or the held call's) header begins
        # the open body's kind: REASONING, CONTENT, or "" (no message: sent as nothing)
        self.body: str | None = REASONING if opened else None
        self.opened = opened  # a message has opened: text outside messages is no one's
        self.thoughts = int(opened)  # analysis messages opened
        self.fresh = opened and not midway  # nothing of the open body sent yet: its leading whitespace is left out
        self.space = {REASONING: "", CONTENT: ""}  # trailing whitespace held, per kind

    def add(self, delta: str) -> list[Piece]:
        self.text += delta
        out: list[Piece] = []
        while not self.calling:
            if self.body is None:  # in a header: wait for its <|message|>
                end = self.text.find("<|message|>", self.at)
                if end < 0:
                    return out
                header = self.text[self.at : end + len("<|message|>")]
                call = _HARMONY_CALL.search(header)
                if call is not None and (call.group("a") or call.group("b")):
                    self.calling, self.sent = True, self.at
                    return out
                out += self._open(_HARMONY_MESSAGE.search(header))
                self.sent = end + len("<|message|>")
                continue
            ends = [at for marker in _HARMONY_BODY_ENDS if (at := self.text.find(marker, self.sent)) >= 0]
            if ends:
                out += self._send(self.text[self.sent : min(ends)], closed=True)
                self.at = self.sent = min(ends)
                self.body = None
                continue
            safe = len(self.text) - partial(self.text[self.sent :], _HARMONY_MARKERS)
            out += self._send(self.text[self.sent : safe], closed=False)
            self.sent = safe
            return out
        return out

    def finish(self) -> tuple[list[Piece], list[ToolCall]]:
        if not self.opened and not self.calling:
            return _content(ToolFormat.clean(self.fmt, self.text)), []
        if not self.calling:
            out = self._send(self.text[self.sent :], closed=True) if self.body else []
            return out + _content(self.space[CONTENT]), []
        held = self.text[self.sent :]
        bodies = [body.strip() for channel, body in _Harmony._messages(held) if channel == "analysis"]
        thought = [(REASONING, "\n" * bool(self.thoughts) + "\n".join(bodies))] if bodies else []
        parsed = self.fmt.parse(held, self.tools)
        if parsed is None:
            return thought + _content(self.space[CONTENT] + self.fmt.clean(held)), []
        before, calls = parsed
        return thought + _content(self.space[CONTENT] + before if before else ""), calls

    def _open(self, message: re.Match | None) -> list[Piece]:
        """Open a body after its header (`message`: the header as a message, None when it is none)."""
        if message is None:
            self.body = ""
            return []
        self.opened = True
        if (message.group(1).split() or [""])[0] != "analysis":
            self.body, self.fresh = CONTENT, False
            return []
        self.body, self.fresh, self.thoughts = REASONING, True, self.thoughts + 1
        return [(REASONING, "\n")] if self.thoughts > 1 else []

    def _send(self, text: str, closed: bool) -> list[Piece]:
        """The piece of the open body's `text` that may be sent; `closed`: the body ends with it."""
        kind = self.body
        if not kind:
            return []
        text = self.space[kind] + ToolFormat.clean(self.fmt, text)  # a marker inside a body is no one's text
        if self.fresh:
            text = text.lstrip()
        sent = text.rstrip()
        self.fresh = self.fresh and not sent
        self.space[kind] = "" if closed and kind == REASONING else text[len(sent) :]
        return [(kind, sent)] if sent else []
