"""One reply's text as it streams, in the parts an API sends it as: the model's reasoning, its content, and the tool
calls in that content — the one reading both APIs share (the OpenAI API's `reasoning_content`, `content` and
`tool_calls`; the Anthropic API's thinking, text and tool_use blocks).

Scope: the order of the three readers each piece of text goes through: cut at the first stop sequence
(openai_stream.Generation: stops apply to everything the model wrote, as OpenAI and Anthropic apply them), split
into reasoning and content (reasoning.ThinkSplit, when the model thinks in a format we read), and the content's
tool calls held back and parsed at the end (tool_calls.CallStream, when the model may call tools; a GPT-OSS reply's
channels are reasoning and content there too: tool_calls.HarmonyStream, which reads every GPT-OSS chat reply, with
no tools as well: harmony_reply.reader). It does NOT write any API's shapes (openai_stream.py, anthropic_stream.py).
"""

from __future__ import annotations

from ui.openai_stream import Generation
from ui.reasoning import CONTENT, REASONING, Piece, ThinkSplit
from ui.tool_calls import CallStream, ToolCall

__all__ = ("CONTENT", "REASONING", "Piece", "ReplyParts", "merged")


class ReplyParts:
    def __init__(self, stops: list[str], think: ThinkSplit | None = None, calls: CallStream | None = None) -> None:
        """`think`: the splitter of the reply's reasoning, or None when it has none; `calls`: the reader of the
        reply's tool calls, or None when the model may call none."""
        self.gen, self.think, self.calls = Generation(stops), think, calls

    @property
    def stopped(self) -> bool:
        """A stop sequence has cut the text: whatever comes after is thrown away."""
        return self.gen.stopped

    @property
    def matched(self) -> str | None:
        return self.gen.matched

    def add(self, delta: str) -> list[Piece]:
        """The pieces that may be sent now (none once stopped)."""
        if self.gen.stopped:
            return []
        return self._route(self.gen.add(delta))

    def finish(self) -> tuple[list[Piece], list[ToolCall]]:
        """(the pieces not yet sent, the tool calls): call text that does not parse is content."""
        pieces = self._route(self.gen.flush())
        if self.think is not None:
            pieces += self._calls(self.think.finish())
        found: list[ToolCall] = []
        if self.calls is not None:
            rest, found = self.calls.finish()
            pieces += rest
        return merged(pieces), found

    def _route(self, text: str) -> list[Piece]:
        pieces = self.think.add(text) if self.think is not None else [(CONTENT, text)]
        return merged(self._calls(pieces))

    def _calls(self, pieces: list[Piece]) -> list[Piece]:
        if self.calls is None:
            return pieces
        return [out for kind, text in pieces for out in (self.calls.add(text) if kind == CONTENT else [(kind, text)])]


def merged(pieces: list[Piece]) -> list[Piece]:
    """Empty pieces dropped, neighbours of one kind joined."""
    out: list[Piece] = []
    for kind, text in pieces:
        if not text:
            continue
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out
