"""A GPT-OSS reply read for its channels in every chat request, with tools or without: harmony writes a reply as
messages on channels (analysis: the model's thought; final: its answer; commentary: preambles and tool calls), each
opened by markers that are special tokens, which a reply's text leaves out unless its request keeps them
(Runtime.submit's `keep`). Without them the thought and the answer would arrive joined.

Scope: which chat templates write harmony's channels (`writes_channels`, the test reasoning.budget_format makes),
the markers a request keeps so they can be read (`kept`), a reader of the channels when the request has no tools
(`reader`: tool_calls.HarmonyStream with no tools, so a call the model writes anyway is content, as a malformed
call is), and the chat's stored form of such a reply (`ThoughtText`: the analysis as a `<think>` thought before the
answer — the form chat_view.py folds and chat_flow.py leaves out of later turns), and how a stored reply cut by the
length limit is continued (`unfinished`).

Continuing: the model reads its unfinished turn as its own template renders one. GPT-OSS's template shows a last
assistant message's `thinking` as an analysis message before its final one when no reply is asked after it, and
transformers' continue_final_message="thinking" ends the prompt inside that analysis (Engine.tokenize_prompt does so
for a final assistant message with no content but a `thinking`): so a reply cut inside its thought is sent as its
thought with no content, and goes on in the analysis with its markers kept, read from there (`ThoughtText(thought)`)
into the same stored form — the thought continued, then the answer. A reply cut in its answer is sent as its
thought and the answer so far, which goes on as text, as any model's reply does.

It does NOT parse harmony itself (tool_calls.HarmonyStream does, here and with tools) or decide when a reply may
think (structured.py: a reply held to a grammar from its first token has no channels to read).
"""

from __future__ import annotations

from ui.chat_view import thought_of
from ui.loaded_runtime import LoadedRuntime
from ui.reasoning import CONTENT, HARMONY_ANALYSIS, REASONING, THINK, Piece, budget_format
from ui.tool_calls import HARMONY, HarmonyStream


def writes_channels(template: str | None) -> bool:
    """Whether a chat template writes harmony's channels (GPT-OSS): its replies are channels from the first token."""
    return budget_format(template) is HARMONY_ANALYSIS


def kept(runtime: LoadedRuntime) -> frozenset[str]:
    """The harmony markers that are special tokens of the model's tokenizer: what a request keeps to read them."""
    return frozenset(runtime.special_tokens(HARMONY.markers))


def reader(opened: bool = False, midway: bool = False) -> HarmonyStream:
    """A new reader of a reply's channels with no tools; `opened`: the prompt opened the analysis message, so the
    reply starts inside it (`midway`: inside its text, a thought being continued)."""
    return HarmonyStream(HARMONY, [], opened, midway)


def unfinished(stored: str, template: str | None) -> tuple[dict, str | None]:
    """The message the model reads for a GPT-OSS reply being continued, `stored` in the chat's form, and the thought
    it goes on with: None where the reply was cut in its answer (or has no thought), which goes on as text. A
    harmony `template` that never reads `thinking` (GPT-OSS's own does) is sent the reply whole, as any model's:
    no prompt can end inside a thought it does not show."""
    parts = thought_of(stored) if template and "thinking" in template else None
    if parts is None:
        return {"role": "assistant", "content": stored}, None
    thought, answer, still_open = parts
    if still_open:
        return {"role": "assistant", "content": "", "thinking": thought}, thought
    return {"role": "assistant", "content": answer, "thinking": thought}, None


class ThoughtText:
    """A GPT-OSS reply, streamed with its markers, as the chat stores a reasoning model's reply: `<think>\\n`, its
    analysis, `\\n</think>\\n\\n`, then its answer (the final channel, and preambles) — the thought left open while no
    answer has come, as a thought cut short is stored. Analysis that comes after answer text is still the thought:
    the stored form has one thought, before the answer."""

    def __init__(self, thought: str | None = None) -> None:
        """`thought`: the thought of a stored reply cut inside it, which this reply continues from inside its
        analysis; what it returns is then the text that goes after the stored reply (its stored form only grows at
        its end while no answer came before: the thought, then the answer)."""
        self.stream = reader(opened=thought is not None, midway=thought is not None)
        self.continued, self.thought, self.answer = thought is not None, thought or "", ""
        self.before = len(self.text)

    def add(self, delta: str) -> str:
        """The reply so far in its stored form (what may still be part of a marker held back), after the stored
        reply it continues."""
        self._take(self.stream.add(delta))
        return self.text[self.before :]

    def finish(self) -> str:
        """The whole reply in its stored form, once it has ended, after the stored reply it continues."""
        rest, _ = self.stream.finish()  # no tools: a call is content
        self._take(rest)
        return self.text[self.before :]

    @property
    def text(self) -> str:
        if not self.thought and not self.continued:
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


def stored_form(text: str, thought: str | None = None) -> str:
    """A whole GPT-OSS reply, written with its markers, in the chat's stored form (`ThoughtText`; `thought`: the
    stored thought it continues, and then what goes after it)."""
    view = ThoughtText(thought)
    view.add(text)
    return view.finish()
