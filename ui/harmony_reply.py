"""A GPT-OSS reply read for its channels in every chat request, with tools or without: harmony writes a reply as
messages on channels (analysis: the model's thought; final: its answer; commentary: preambles and tool calls), each
opened by markers that are special tokens, which a reply's text leaves out unless its request keeps them
(Runtime.submit's `keep`). Without them the thought and the answer would arrive joined.

Scope: which chat templates write harmony's channels (`writes_channels`, the test reasoning.budget_format makes),
the markers a request keeps so they can be read (`kept`), a reader of the channels when the request has no tools
(`reader`: tool_calls.HarmonyStream with no tools, so a call the model writes anyway is content, as a malformed
call is), and the chat's stored form of such a reply (`ThoughtText`: the analysis as a `<think>` thought before the
answer — the form chat_view.py folds and chat_flow.py leaves out of later turns). It does NOT parse harmony itself
(tool_calls.HarmonyStream does, here and with tools) or decide when a reply may think (structured.py: a reply held
to a grammar from its first token has no channels to read).
"""

from __future__ import annotations

from ui.loaded_runtime import LoadedRuntime
from ui.reasoning import CONTENT, HARMONY_ANALYSIS, REASONING, THINK, Piece, budget_format
from ui.tool_calls import HARMONY, HarmonyStream


def writes_channels(template: str | None) -> bool:
    """Whether a chat template writes harmony's channels (GPT-OSS): its replies are channels from the first token."""
    return budget_format(template) is HARMONY_ANALYSIS


def kept(runtime: LoadedRuntime) -> frozenset[str]:
    """The harmony markers that are special tokens of the model's tokenizer: what a request keeps to read them."""
    return frozenset(runtime.special_tokens(HARMONY.markers))


def reader(opened: bool = False) -> HarmonyStream:
    """A new reader of a reply's channels with no tools; `opened`: the prompt opened the analysis message, so the
    reply starts inside it."""
    return HarmonyStream(HARMONY, [], opened)


class ThoughtText:
    """A GPT-OSS reply, streamed with its markers, as the chat stores a reasoning model's reply: `<think>\\n`, its
    analysis, `\\n</think>\\n\\n`, then its answer (the final channel, and preambles) — the thought left open while no
    answer has come, as a thought cut short is stored. Analysis that comes after answer text is still the thought:
    the stored form has one thought, before the answer."""

    def __init__(self) -> None:
        self.stream, self.thought, self.answer = reader(), "", ""

    def add(self, delta: str) -> str:
        """The reply so far in its stored form (what may still be part of a marker held back)."""
        self._take(self.stream.add(delta))
        return self.text

    def finish(self) -> str:
        """The whole reply in its stored form, once it has ended."""
        rest, _ = self.stream.finish()  # no tools: a call is content
        self._take(rest)
        return self.text

    @property
    def text(self) -> str:
        if not self.thought:
            return self.answer
        if not self.answer:
            return f"{THINK.start}\n{self.thought}"
        return f"{THINK.start}\n{self.thought}{THINK.close}{self.answer}"

    def _take(self, pieces: list[Piece]) -> None:
        for kind, text in pieces:
            if kind == REASONING:
                self.thought += text
            elif kind == CONTENT:
                self.answer += text


def stored_form(text: str) -> str:
    """A whole GPT-OSS reply, written with its markers, in the chat's stored form (`ThoughtText`)."""
    view = ThoughtText()
    view.add(text)
    return view.finish()
