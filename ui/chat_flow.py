"""The chat's replies: send, regenerate, continue and edit, each streaming a reply and saving it in the store.

Scope: the steps between the store and `Runtime.stream` (what the model reads, where the reply is saved), as
generators of Chatbot message lists, testable without a browser. It does NOT build components or wire events
(ui/chat.py). A user's mistake or a state the action cannot apply to raises `Problem` (a sentence); a failed
generation ends as an inline notice bubble under the text generated so far.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fmoe_local.config import Sampling
from ui.chat_view import display, warning
from ui.render import safe_markdown
from ui.session import Session

log = logging.getLogger(__name__)
_RELAY_POLL_S = 0.5  # how often the page's relay checks that the reply's thread still runs
NO_MODEL = "No model is loaded yet. Open the Models tab to download one or load a model folder."


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


def runtime_of(session: Session):  # noqa: ANN201 - a fmoe_local.runtime.Runtime
    if session.runtime is None:
        raise Problem(session.still_loading or session.load_error or NO_MODEL)
    return session.runtime


def model_messages(stored, system: str) -> list[dict]:
    """What the model reads: the system prompt, then the stored messages (each its chosen text)."""
    head = [{"role": "system", "content": system}] if system.strip() else []
    return head + [{"role": m.role, "content": m.content} for m in stored]


def stream_reply(
    session: Session,
    conv_id: int,
    messages: list[dict],
    shown: list[dict],
    save: Callable[[str, object], object],
    sampling: Sampling,
    prefix: str = "",
) -> Iterator[list[dict]]:
    """Stream the model's reply to `messages` under the bubbles `shown` (after `prefix`, the start of a reply being
    continued); `save(text, stats)` stores it (even a stopped or interrupted one). Yields Chatbot message lists."""
    from fmoe_local.runtime_types import Finished, TextDelta

    runtime = runtime_of(session)
    stop = threading.Event()  # the chat's Stop ends this reply (and any other chat reply), not an API request
    session.chat_reply(stop, running=True)
    updates: queue.Queue = queue.Queue()
    left = threading.Event()  # the page went away: the user's doing, like Stop

    def produce() -> None:
        # The reply is generated and saved on this thread, whatever becomes of the page that asked for it: a reload
        # or a closed tab cannot lose it. (gradio closes the relay below at a yield when the page goes away, which
        # stops the model and this saves what it wrote as a stopped reply; when it cannot close it, because the
        # relay is waiting for a token, the reply runs to its end and is saved whole.)
        text = ""
        try:
            for event in runtime.stream(messages, sampling, stop=stop):
                if isinstance(event, TextDelta):
                    text += event.text
                    updates.put(prefix + text)
                elif isinstance(event, Finished):
                    if event.reason == "cancelled" and not left.is_set() and stop in session.chat_replies:
                        # Neither Stop (it takes the flag out of chat_replies) nor the page ended it: the runtime
                        # was closed under it (a model loaded from another tab, the API, the Models tab).
                        event.stats.finish_reason = "interrupted"
                    if event.reason != "error":
                        session.record(event.stats)
                    if event.reason != "error" or event.text.strip():  # a failure keeps what was written before it
                        try:
                            save(event.text, event.stats)
                        except Exception as exc:  # noqa: BLE001 - the text must stay on the page, with why
                            log.exception("a finished reply could not be saved")
                            updates.put(Unsaved(prefix + event.text, unsaved_sentence(exc)))
                            return
                    updates.put(event)
        except Exception as exc:  # noqa: BLE001 - handed to the relay, which raises it for the page
            updates.put(exc)
        finally:
            session.chat_reply(stop, running=False)

    worker = threading.Thread(target=produce, name="fmoe-chat-reply", daemon=True)
    worker.start()
    finished = False
    try:
        while True:
            try:
                item = updates.get(timeout=_RELAY_POLL_S)
            except queue.Empty:
                if worker.is_alive():
                    continue
                try:
                    item = updates.get_nowait()  # put just before the thread ended
                except queue.Empty:
                    raise RuntimeError("The reply stopped unexpectedly. Send the message again.") from None
            if isinstance(item, str):
                yield shown + [{"role": "assistant", "content": safe_markdown(item)}]
                continue
            finished = True
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Unsaved):
                yield shown + [
                    {"role": "assistant", "content": safe_markdown(item.text)},
                    {"role": "assistant", "content": warning(item.sentence)},
                ]
                return
            shown_now = display(session.store.chats.messages(conv_id))
            if item.reason == "error":
                # Inline, under what was generated before the failure; the chat stays usable (Regenerate, Send).
                shown_now = shown_now + [{"role": "assistant", "content": warning(item.error)}]
            yield shown_now
            return
    finally:
        if not finished:
            left.set()
            stop.set()  # the page went away: the model stops at its next token, and `produce` saves what it wrote


def reply(session: Session, conv_id: int, system: str, sampling: Sampling) -> Iterator[list[dict]]:
    """A new reply at the end of the stored conversation."""
    chats = session.store.chats
    stored = chats.messages(conv_id)
    after = stored[-1].position if stored else -1  # the reply belongs after this message, or nowhere

    def save(text: str, stats: object) -> None:
        chats.append(conv_id, "assistant", text, stats, after=after)

    yield from stream_reply(session, conv_id, model_messages(stored, system), display(stored), save, sampling)


def regenerate(session: Session, conv_id: int | None, system: str, sampling: Sampling) -> Iterator[list[dict]]:
    """Another reply to the last question; the reply it replaces stays as an alternative (< 1/2 >)."""
    chats = session.store.chats
    stored = chats.messages(conv_id) if conv_id is not None else []
    if not any(m.role == "user" for m in stored):
        raise Problem("Nothing to regenerate yet. Send a message first.")
    runtime_of(session)
    last = stored[-1]
    if last.role == "assistant":
        context = stored[:-1]

        def save(text: str, stats: object) -> None:
            chats.add_alternative(conv_id, last.position, text, stats)

    else:  # the last reply failed before any text: there is nothing to keep, only a reply to add
        context = stored

        def save(text: str, stats: object) -> None:
            chats.append(conv_id, "assistant", text, stats, after=last.position)

    yield from stream_reply(session, conv_id, model_messages(context, system), display(context), save, sampling)


def can_continue(message) -> bool:  # noqa: ANN001 - a store Message
    """A reply cut by Max new tokens; not one the model's context cut ("context"): no more of it can fit."""
    return message.role == "assistant" and (message.stats or {}).get("finish_reason") == "length"


def continue_reply(session: Session, conv_id: int | None, system: str, sampling: Sampling) -> Iterator[list[dict]]:
    """Go on with the last reply where the token limit cut it: the new text is appended to the same message."""
    chats = session.store.chats
    stored = chats.messages(conv_id) if conv_id is not None else []
    if stored and (stored[-1].stats or {}).get("finish_reason") == "context":
        raise Problem(
            "This reply ended because the model's context is full, so it cannot be continued. Start a new chat."
        )
    if not stored or not can_continue(stored[-1]):
        raise Problem("Only a reply cut by the length limit can be continued. Send a message or Regenerate instead.")
    runtime_of(session)
    last = stored[-1]

    def save(text: str, stats: object) -> None:
        chats.extend_last(conv_id, last.position, text, stats)

    # The model reads the reply so far as its own unfinished turn (Engine.encode_prompt continues a final assistant
    # message instead of opening a new one).
    messages = model_messages(stored, system)
    yield from stream_reply(session, conv_id, messages, display(stored[:-1]), save, sampling, prefix=last.content)


def edit(
    session: Session, conv_id: int | None, index: int, text: str, system: str, sampling: Sampling
) -> Iterator[list[dict]]:
    """Replace the user message shown at `index` with `text`, drop everything after it, and reply to it again."""
    chats = session.store.chats
    text = (text or "").strip()
    if not text:
        raise Problem("A message cannot be empty. Type the new text, or start a new chat.")
    shown = [m for m in (chats.messages(conv_id) if conv_id is not None else []) if m.role != "system"]
    if not isinstance(index, int) or not 0 <= index < len(shown) or shown[index].role != "user":
        raise Problem("Only your own messages can be edited. Use Regenerate for another reply.")
    runtime_of(session)
    chats.edit(conv_id, shown[index].position, text)
    yield from reply(session, conv_id, system, sampling)


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
