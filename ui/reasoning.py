"""A reasoning model's thinking, read out of its reply: the text between `<think>` and `</think>` (Qwen3, QwQ,
DeepSeek-R1 and its distills) is the reasoning, sent apart from the content — the OpenAI API's `reasoning_content`,
the Anthropic API's thinking blocks (reply_parts.py routes the pieces).

Which models: those whose chat template writes both markers (`format_of`). The reply starts inside the thought
when the template's reply opening already holds an unclosed `<think>` (Qwen3-Thinking-2507 and DeepSeek-R1 open it
for the model: `opened`, from Runtime.reply_opening); otherwise a thought is read only where the reply begins with
`<think>` (Qwen3's hybrid models write it themselves). A reply cut before `</think>` is reasoning to its end. The
whitespace around the markers (Qwen3 writes "<think>\\n…\\n</think>\\n\\n") is left out. GPT-OSS's analysis channel
is not read here: its markers (`<|channel|>`, `<|message|>`) are special tokens, which every chat request on a
harmony template keeps (ui/harmony_reply.py), and ui/tool_calls.py's HarmonyStream reads its channels. It does NOT
decide whether a reply may think, nor how long (structured.py: a reply held to a grammar has no thought, the grammar
starting at its first token, unless a thinking budget bounds a thought the prompt opened).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

REASONING, CONTENT = "reasoning", "content"
Piece = tuple[str, str]  # (REASONING or CONTENT, text)


@dataclass(frozen=True)
class ThinkFormat:
    start: str
    end: str
    close: str  # what ends a thought when its budget is spent (Sampling.thought): the end as the template writes it

    def opened(self, opening: str) -> bool:
        """Whether a reply opening (Runtime.reply_opening) leaves a thought open: the reply starts inside it."""
        at = opening.rfind(self.start)
        return at >= 0 and self.end not in opening[at:]


THINK = ThinkFormat("<think>", "</think>", "\n</think>\n\n")
FORMATS = (THINK,)
# GPT-OSS's analysis channel, for a thought's budget only (`budget_format`): a reply opens it with these markers and
# ends its message with <|end|>; a budget spent ends it and opens the final channel's message, the answer. Never read
# by ThinkSplit: the markers are special tokens, read by HarmonyStream (harmony_reply.py, and with tools).
HARMONY_ANALYSIS = ThinkFormat(
    "<|channel|>analysis<|message|>", "<|end|>", "<|end|><|start|>assistant<|channel|>final<|message|>"
)
# With tools, a spent budget opens the next message's channel only: the model names it, the final one or a call
# (`commentary to=functions.NAME`), where forcing the final channel would forbid every call.
HARMONY_ANALYSIS_TOOLS = replace(HARMONY_ANALYSIS, close="<|end|><|start|>assistant<|channel|>")


def format_of(template: str | None) -> ThinkFormat | None:
    """The thinking format a chat template writes (it shows past thoughts, or opens or closes one); None if none."""
    for fmt in FORMATS:
        if template and fmt.start in template and fmt.end in template:
            return fmt
    return None


def budget_format(template: str | None, tools: bool = False) -> ThinkFormat | None:
    """The markers a thinking budget (Sampling.thought) is held with: the <think> format's, or GPT-OSS's analysis
    channel where the template writes harmony's channels (`tools`: the request sends tools); None for a model that
    does not think."""
    if format_of(template) is not None:
        return format_of(template)
    if template and "<|channel|>" in template:  # harmony: every reply is channels, its thought the analysis one
        return HARMONY_ANALYSIS_TOOLS if tools else HARMONY_ANALYSIS
    return None


_BEFORE, _THINKING, _AFTER, _CONTENT = "before", "thinking", "after", "content"


class ThinkSplit:
    """A reply's text as it streams, split into reasoning and content pieces. Text that may still be (part of) a
    marker, or whitespace next to one, is held until it cannot."""

    def __init__(self, fmt: ThinkFormat, opened: bool = False) -> None:
        """`opened`: the prompt opened the thought, so the reply starts inside it."""
        self.fmt, self.state, self.held, self.leading = fmt, _THINKING if opened else _BEFORE, "", True

    def add(self, text: str) -> list[Piece]:
        """The pieces that may be sent now."""
        self.held += text
        out: list[Piece] = []
        while True:
            if self.state == _BEFORE:
                lead = self.held.lstrip()
                if lead.startswith(self.fmt.start):
                    self.held, self.state = lead[len(self.fmt.start) :], _THINKING
                elif self.fmt.start.startswith(lead):
                    return out  # nothing yet, or the start of the marker: wait
                else:
                    self.state = _CONTENT
            elif self.state == _THINKING:
                if self.leading:
                    self.held = self.held.lstrip()
                    if not self.held:
                        return out
                    self.leading = False
                at = self.held.find(self.fmt.end)
                if at >= 0:
                    out.append((REASONING, self.held[:at].rstrip()))
                    self.held, self.state = self.held[at + len(self.fmt.end) :], _AFTER
                    continue
                sendable = self.held[: len(self.held) - partial(self.held, (self.fmt.end,))].rstrip()
                out.append((REASONING, sendable))
                self.held = self.held[len(sendable) :]
                return out
            elif self.state == _AFTER:
                self.held = self.held.lstrip()
                if not self.held:
                    return out
                self.state = _CONTENT
            else:
                out.append((CONTENT, self.held))
                self.held = ""
                return out

    def finish(self) -> list[Piece]:
        """What is still held, once the reply has ended: a thought never closed is reasoning to its end."""
        held, self.held = self.held, ""
        if self.state == _THINKING:  # what was held is whitespace (its start, if nothing was sent yet) and text
            return [(REASONING, (held.lstrip() if self.leading else held).rstrip())]
        return [] if self.state == _AFTER else [(CONTENT, held)]


def partial(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the start of one of `markers` (and may become it): what a
    streamed reply holds back until it cannot be a marker (here, and for tool calls: ui/tool_calls.py)."""
    for keep in range(min(max(map(len, markers), default=1) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-keep:]) for marker in markers):
            return keep
    return 0
