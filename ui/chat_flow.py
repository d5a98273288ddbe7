"""The chat's replies: send, regenerate, continue and edit, each streaming a reply and saving it in the store.

Scope: the steps between the store and `Runtime.submit` (what the model reads, where the reply is saved), as
generators of Chatbot message lists, testable without a browser. It does NOT build components or wire events
(ui/chat.py). A user's mistake or a state the action cannot apply to raises `Problem` (a sentence); a failed
generation ends as an inline notice bubble under the text generated so far.

A reply belongs to its chat, not to the page that asked for it (`ChatReply`, kept in `Session.chat_replies`): it is
saved by its request handle's done callback, on the runtime's worker as the request ends, so a page that switches to
another chat, reloads or closes loses nothing; a page only follows the handle (`follow`), and a page that comes
back to the chat follows it again from its first word. Stop cancels through the handle; a reply the runtime ended
without its owner asking (the model unloaded under it) is saved as interrupted.

A reasoning model's reply is saved as it was written, its thought between `<think>` and `</think>`; where the chat
template opened the thought for the model (Runtime.reply_opening ends inside `<think>`), the reply is saved with
that opening marker, so every stored thought starts with it (chat_view.py shows it folded). A GPT-OSS reply is
written with its harmony markers kept and stored in that same form: its analysis channel as the `<think>` thought,
then its answer (harmony_reply.ThoughtText). The model reads earlier replies without their thoughts, as the thinking
models' own templates show them; a reply being continued is read whole (a GPT-OSS one as its template shows an
unfinished turn: its thought apart, so one cut inside it goes on there, its markers kept: harmony_reply.unfinished).

A chat's context length (its Generation value; 0: all the model reads) bounds the tokens of the prompt sent: the
oldest turns (a question and the replies after it) are left out whole until the rest fits, the system prompt and the
last turn always kept (`fit`, counting with Runtime.check). The reply then says how many messages were left out,
while it streams and in its stats line once saved.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fmoe_local.config import Sampling
from fmoe_local.request_handle import RequestHandle
from fmoe_local.runtime_types import Finished, TextDelta
from ui import harmony_reply
from ui.chat_view import bubble_messages, display, reply_bubbles, thought_of, warning
from ui.loaded_runtime import LoadedRuntime
from ui.reasoning import THINK
from ui.session import Session

log = logging.getLogger(__name__)
NO_MODEL = "No model is loaded yet. Open the Models tab to download one or load a model folder."
STILL_ANSWERING = "This chat is still answering. Wait for the reply to end, or press Stop."
WAITING = (
    "*Waiting for its turn: the model is still answering another chat (or an API request). This reply starts as soon "
    "as that one ends; you can read and write in other chats meanwhile.*"
)
# A page redraws the streaming reply at most this often. The page redraws the whole reply's Markdown each time: at one
# redraw per token a fast model kept the browser busier than a CPU core (9.6 s of Chromium's CPU for a 300-token
# reply at 63 tok/s, docs/bench.md), CPU the model's own CPU experts need. 20 a second still reads as smooth.
REDRAW_INTERVAL_S = 0.05
EDIT_WAIT_S = 60.0  # how long an edit waits for the reply it replaced to end (it was cancelled: a token or two)


class Problem(ValueError):
    """Something the user asked cannot be done now; the message is a sentence saying what to do instead."""


@dataclass(frozen=True)
class Unsaved:
    """A reply generated whole but not stored (the database refused the write): shown with `sentence` under it."""

    text: str
    sentence: str


def unsaved_sentence(exc: Exception) -> str:
    """Why a finished reply was not stored, and what to do: the text then lives only on the page."""
    said = str(exc).lower()
    if "full" in said:
        what = "The disk is full: free some space, then Regenerate for a reply that is kept."
    elif "readonly" in said or "read-only" in said:
        what = "The database file cannot be written (its owner or permissions changed): fix that, then restart the app."
    elif "locked" in said or "busy" in said:
        what = "The database stayed busy: Regenerate to try again."
    else:
        what = "Regenerate to try again; if it repeats, restart the app."
    return f"This reply could not be saved ({exc}), so it is only on this page: copy what you need. {what}"


def runtime_of(session: Session) -> LoadedRuntime:
    if session.runtime is None:
        raise Problem(session.still_loading or session.load_error or NO_MODEL)
    return session.runtime


def model_messages(stored, system: str, continued: bool = False) -> list[dict]:
    """What the model reads: the system prompt, then the stored messages (each its chosen text), the replies without
    their thoughts; `continued`: the last message is the reply being continued, read whole."""
    head = [{"role": "system", "content": system}] if system.strip() else []
    last = len(stored) - 1
    return head + [
        {"role": m.role, "content": m.content if continued and i == last else _answer(m)} for i, m in enumerate(stored)
    ]


def _answer(message) -> str:  # noqa: ANN001 - a store Message
    parts = thought_of(message.content) if message.role == "assistant" else None
    return message.content if parts is None else parts[1]


def check_context(runtime, context: int) -> None:  # noqa: ANN001 - a Runtime
    """Refuse a chat context length above what the loaded model reads (a Problem saying what to set)."""
    most = runtime.context_length
    if most is not None and context > most:
        raise Problem(
            f"This chat's context length is {context:,} tokens, but {runtime.info.name} reads at most {most:,}. Set it "
            f"to at most {most:,} under Generation, or to 0 for all the model reads."
        )


def fit(runtime, messages: list[dict], context: int) -> tuple[list[dict], int]:  # noqa: ANN001 - a Runtime
    """`messages` (the system prompt first, if any) cut to at most `context` prompt tokens (0: all of them) by
    leaving out the oldest turns whole, and how many messages were left out. The system prompt and the last turn
    (the question, or the reply being continued) are always sent: a Problem says so when they alone are longer."""
    if not context:
        return messages, 0
    from fmoe_local.engine import ContextTooLong, PromptRefused  # the tokenizer's machinery, for a chat that cuts

    check_context(runtime, context)
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(head) :]
    cuts = [0] + [i for i, m in enumerate(body) if m["role"] == "user" and i > 0]  # where a turn starts

    def tokens(cut: int) -> float:
        try:
            counted = runtime.check(head + body[cut:])
        except ContextTooLong:
            return math.inf
        except PromptRefused as exc:  # the template refused these messages: no cut makes them a prompt
            raise Problem(str(exc)) from exc
        return counted or 0  # None: not known here; the request's own check decides

    if tokens(0) <= context:
        return messages, 0
    if tokens(cuts[-1]) > context:
        raise Problem(
            f"The last message{' and the system prompt' if head else ''} alone take more than this chat's context "
            f"length of {context:,} tokens. Raise it under Generation (0 sends all the model reads), or shorten the "
            "message."
        )
    low, high = 1, len(cuts) - 1  # the first cut that fits: cuts[high] fits, cuts[low - 1] does not
    while low < high:
        mid = (low + high) // 2
        if tokens(cuts[mid]) <= context:
            high = mid
        else:
            low = mid + 1
    return head + body[cuts[low] :], cuts[low]


def left_out_sentence(left_out: int, context: int) -> str:
    """What the chat says of a reply that was asked without the oldest messages."""
    what = "1 earlier message was" if left_out == 1 else f"{left_out} earlier messages were"
    return (
        f"{what} not sent to the model: this chat's context length is {context:,} tokens. Raise it under Generation "
        "to send more."
    )


def thought_opening(runtime) -> str:  # noqa: ANN001 - a Runtime
    """The marker a fresh reply is saved after: `<think>` where the chat template opens the thought itself."""
    return THINK.start + "\n" if THINK.opened(runtime.reply_opening()) else ""


@dataclass
class ChatReply:
    """A reply being written into chat `conv_id`: its request's handle, the bubbles above it (`shown`) and the start
    of the reply it continues (`prefix`). `unsaved`: set when the store refused the finished reply."""

    conv_id: int
    handle: RequestHandle
    shown: list[dict]
    prefix: str = ""
    unsaved: Unsaved | None = None
    opening: str = ""  # the thought's marker that the template wrote for the model (`thought_opening`)
    left_out: int = 0  # the oldest messages not sent (`fit`), under the chat's context length `context`
    context: int = 0
    channels: bool = False  # a GPT-OSS reply written with its harmony markers: stored as harmony_reply.ThoughtText
    thought: str | None = None  # with `channels`: the thought of the reply continued, cut inside it

    def stats(self, stats: object) -> object:
        """The reply's stats as saved: with the messages left out, which its stats line says (chat_view.py)."""
        if not self.left_out:
            return stats
        return {**stats.to_dict(), "left_out": self.left_out, "context_length": self.context}

    def text(self, written: str) -> str:
        """The whole reply as saved, once the model has written `written` of it."""
        return self.prefix + self.opening + written


def start(
    session: Session,
    conv_id: int,
    messages: list[dict],
    shown: list[dict],
    save: Callable[[str, object], object],
    sampling: Sampling,
    prefix: str = "",
    context: int = 0,
    thought: str | None = None,
) -> ChatReply:
    """Submit the model's reply to `messages` for chat `conv_id`, within the chat's `context` length (`fit`);
    `save(text, stats)` stores it when it ends (even a stopped or interrupted one), whatever becomes of the page that
    asked. `thought`: the GPT-OSS reply continued (`prefix`) was cut inside this thought (harmony_reply.unfinished)."""
    runtime = runtime_of(session)
    if session.chat_reply(conv_id) is not None:
        raise Problem(STILL_ANSWERING)
    messages, left_out = fit(runtime, messages, context)
    opening = "" if prefix else thought_opening(runtime)  # a continued reply carries its own marker
    # A continued GPT-OSS reply goes on inside the message it was cut in: its answer as text, its thought with the
    # markers that may close it and open the answer.
    channels = (not prefix or thought is not None) and harmony_reply.writes_channels(runtime.chat_template)
    keep = harmony_reply.kept(runtime) if channels else frozenset()
    handle = runtime.submit(messages, sampling, keep=keep)
    reply = ChatReply(
        conv_id,
        handle,
        shown,
        prefix,
        opening=opening,
        left_out=left_out,
        context=context,
        channels=channels,
        thought=thought if channels else None,
    )
    if not session.begin_chat_reply(conv_id, reply):  # another page started one in between
        handle.cancel()
        raise Problem(STILL_ANSWERING)
    handle.add_done_callback(lambda final: _ended(session, reply, save, final))
    return reply


def _ended(session: Session, reply: ChatReply, save: Callable[[str, object], object], final: Finished) -> None:
    """The reply's request ended (on the runtime's worker, before anyone following it sees the end): save it."""
    try:
        if final.reason == "cancelled" and not reply.handle.cancelled:
            # Neither Stop nor an edit ended it: the runtime was closed under it (a model loaded from another tab, the
            # API, the Models tab).
            final.stats.finish_reason = "interrupted"
        if final.reason != "error":
            session.record(final.stats)
        written = harmony_reply.stored_form(final.text, reply.thought) if reply.channels else final.text
        if final.reason != "error" or written.strip():  # a failure keeps what was written before it
            try:
                save(reply.opening + written, reply.stats(final.stats))
            except Exception as exc:  # noqa: BLE001 - the text must stay on the page, with why
                log.exception("a finished reply could not be saved")
                reply.unsaved = Unsaved(reply.text(written), unsaved_sentence(exc))
    finally:
        session.end_chat_reply(reply.conv_id, reply)


def follow(session: Session, reply: ChatReply) -> Iterator[list[dict]]:
    """The reply as it streams, under its bubbles, from its first word (a page that comes back to the chat sees it
    whole), then the chat as stored once it is saved. Closing this generator leaves the reply running."""
    said = [_bubble(f"*{left_out_sentence(reply.left_out, reply.context)}*")] if reply.left_out else []
    if reply.handle.behind and not reply.handle.started:
        so_far = reply_bubbles(reply.text(""), writing=True) if reply.text("").strip() else [_bubble("…")]
        yield reply.shown + so_far + [_bubble(WAITING)]
    text, final = "", None
    view = harmony_reply.ThoughtText(reply.thought) if reply.channels else None
    for batch in reply.handle.batches(REDRAW_INTERVAL_S):
        for event in batch:
            if isinstance(event, TextDelta):
                text = view.add(event.text) if view is not None else text + event.text
            else:
                final = event
        if final is None:
            yield reply.shown + reply_bubbles(reply.text(text), writing=True) + said
    if reply.unsaved is not None:
        yield reply.shown + reply_bubbles(reply.unsaved.text) + [_bubble(warning(reply.unsaved.sentence))]
        return
    shown_now = display(session.store.chats.messages(reply.conv_id))
    if final.reason == "error":
        # Inline, under what was generated before the failure; the chat stays usable (Regenerate, Send).
        shown_now = shown_now + [_bubble(warning(final.error))]
    yield shown_now


def _bubble(content: str) -> dict:
    return {"role": "assistant", "content": content}


def stream_reply(
    session: Session,
    conv_id: int,
    messages: list[dict],
    shown: list[dict],
    save: Callable[[str, object], object],
    sampling: Sampling,
    prefix: str = "",
    context: int = 0,
    thought: str | None = None,
) -> Iterator[list[dict]]:
    """`start` the reply, then `follow` it: Chatbot message lists."""
    yield from follow(session, start(session, conv_id, messages, shown, save, sampling, prefix, context, thought))


def start_reply(session: Session, conv_id: int, system: str, sampling: Sampling, context: int = 0) -> ChatReply:
    """Submit a new reply at the end of the stored conversation now; `context`: the chat's context length (0: all).

    Not a generator, so that a handler can submit before it first yields: a page that goes away right after its
    message was stored (a reload, a closed tab) must still get the reply it asked for."""
    chats = session.store.chats
    stored = chats.messages(conv_id)
    after = stored[-1].position if stored else -1  # the reply belongs after this message, or nowhere

    def save(text: str, stats: object) -> None:
        chats.append(conv_id, "assistant", text, stats, after=after)

    return start(session, conv_id, model_messages(stored, system), display(stored), save, sampling, context=context)


def reply(session: Session, conv_id: int, system: str, sampling: Sampling, context: int = 0) -> Iterator[list[dict]]:
    """`start_reply`, then `follow` it: Chatbot message lists."""
    yield from follow(session, start_reply(session, conv_id, system, sampling, context))


def regenerate(
    session: Session, conv_id: int | None, system: str, sampling: Sampling, context: int = 0
) -> Iterator[list[dict]]:
    """Another reply to the last question; the reply it replaces stays as an alternative (< 1/2 >)."""
    chats = session.store.chats
    stored = chats.messages(conv_id) if conv_id is not None else []
    if not any(m.role == "user" for m in stored):
        raise Problem("Nothing to regenerate yet. Send a message first.")
    runtime_of(session)
    last = stored[-1]
    if last.role == "assistant":
        earlier = stored[:-1]

        def save(text: str, stats: object) -> None:
            chats.add_alternative(conv_id, last.position, text, stats)

    else:  # the last reply failed before any text: there is nothing to keep, only a reply to add
        earlier = stored

        def save(text: str, stats: object) -> None:
            chats.append(conv_id, "assistant", text, stats, after=last.position)

    messages = model_messages(earlier, system)
    yield from stream_reply(session, conv_id, messages, display(earlier), save, sampling, context=context)


def can_continue(message) -> bool:  # noqa: ANN001 - a store Message
    """A reply cut by Max new tokens; not one the model's context cut ("context"): no more of it can fit."""
    return message.role == "assistant" and (message.stats or {}).get("finish_reason") == "length"


def continue_reply(
    session: Session, conv_id: int | None, system: str, sampling: Sampling, context: int = 0
) -> Iterator[list[dict]]:
    """Go on with the last reply where the token limit cut it: the new text is appended to the same message."""
    chats = session.store.chats
    stored = chats.messages(conv_id) if conv_id is not None else []
    if stored and (stored[-1].stats or {}).get("finish_reason") == "context":
        raise Problem(
            "This reply ended because the model's context is full, so it cannot be continued. Start a new chat."
        )
    if not stored or not can_continue(stored[-1]):
        raise Problem("Only a reply cut by the length limit can be continued. Send a message or Regenerate instead.")
    runtime = runtime_of(session)
    last = stored[-1]

    def save(text: str, stats: object) -> None:
        chats.extend_last(conv_id, last.position, text, stats)

    # The model reads the reply so far as its own unfinished turn (Engine.encode_prompt continues a final assistant
    # message instead of opening a new one).
    messages, thought = model_messages(stored, system, continued=True), None
    if harmony_reply.writes_channels(runtime.chat_template):
        messages[-1], thought = harmony_reply.unfinished(last.content, runtime.chat_template)
    shown = display(stored[:-1])
    yield from stream_reply(session, conv_id, messages, shown, save, sampling, last.content, context, thought)


def edit(
    session: Session, conv_id: int | None, index: int, text: str, system: str, sampling: Sampling, context: int = 0
) -> Iterator[list[dict]]:
    """Replace the user message shown at `index` with `text`, drop everything after it, and reply to it again."""
    chats = session.store.chats
    text = (text or "").strip()
    if not text:
        raise Problem("A message cannot be empty. Type the new text, or start a new chat.")
    shown = bubble_messages(chats.messages(conv_id) if conv_id is not None else [])  # a thought is a bubble too
    if not isinstance(index, int) or not 0 <= index < len(shown) or shown[index].role != "user":
        raise Problem("Only your own messages can be edited. Use Regenerate for another reply.")
    runtime_of(session)
    previous = session.chat_reply(conv_id)
    if previous is not None:  # it answers the old text: ended (and saved, then dropped below) before the new one
        previous.handle.cancel()
        previous.handle.result(timeout=EDIT_WAIT_S)
    chats.edit(conv_id, shown[index].position, text)
    yield from reply(session, conv_id, system, sampling, context)


def choose(session: Session, conv_id: int | None, step: int) -> list[dict]:
    """Show the previous (step −1) or next (+1) version of the last reply; the model reads that one from now on."""
    chats = session.store.chats
    stored = chats.messages(conv_id) if conv_id is not None else []
    last = stored[-1] if stored else None
    if last is None or len(last.alternatives) < 2:
        raise Problem("This reply has no other version. Regenerate makes one.")
    index = last.chosen + step
    if not 0 <= index < len(last.alternatives):
        return display(stored)  # already at the first or last version
    chats.choose_alternative(conv_id, last.position, index)
    return display(chats.messages(conv_id))


def versions_label(stored) -> str:  # noqa: ANN001 - store Messages
    """ "2/3" for the last reply's versions, "" when it has only one."""
    last = stored[-1] if stored else None
    if last is None or len(last.alternatives) < 2:
        return ""
    return f"{last.chosen + 1}/{len(last.alternatives)}"
