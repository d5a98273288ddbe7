"""The chat's replies: send, regenerate, continue and edit, each streaming a reply and saving it in the store.

Scope: the steps between the store and `Runtime.stream` (what the model reads, where the reply is saved), as
generators of Chatbot message lists, testable without a browser. It does NOT build components or wire events
(ui/chat.py). A user's mistake or a state the action cannot apply to raises `Problem` (a sentence); a failed
generation ends as an inline notice bubble under the text generated so far.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from fmoe_local.config import Sampling
from ui.chat_view import display, warning
from ui.render import safe_markdown
from ui.session import Session

NO_MODEL = "No model is loaded yet. Open the Models tab to download one or load a model folder."


class Problem(ValueError):
    """Something the user asked cannot be done now; the message is a sentence saying what to do instead."""


def runtime_of(session: Session):  # noqa: ANN201 - a fmoe_local.runtime.Runtime
    if session.runtime is None:
        raise Problem(session.load_error or NO_MODEL)
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
    continued); `save(text, stats)` stores it (even a stopped one). Yields Chatbot message lists."""
    from fmoe_local.runtime import Finished, TextDelta

    text = ""
    for event in runtime_of(session).stream(messages, sampling):
        if isinstance(event, TextDelta):
            text += event.text
            yield shown + [{"role": "assistant", "content": safe_markdown(prefix + text)}]
        elif isinstance(event, Finished):
            if event.reason == "error":
                # Inline, under what was generated before the failure; the chat stays usable (Regenerate, Send).
                if event.text.strip():
                    save(event.text, event.stats)
                notice = {"role": "assistant", "content": warning(event.error)}
                yield display(session.store.chats.messages(conv_id)) + [notice]
                return
            session.record(event.stats)
            save(event.text, event.stats)
            yield display(session.store.chats.messages(conv_id))


def reply(session: Session, conv_id: int, system: str, sampling: Sampling) -> Iterator[list[dict]]:
    """A new reply at the end of the stored conversation."""
    chats = session.store.chats
    stored = chats.messages(conv_id)
    after = stored[-1].position if stored else -1  # the reply belongs after this message, or nowhere

    def save(text: str, stats: object) -> None:
        chats.append(conv_id, "assistant", text, stats, after=after)

    yield from stream_reply(session, conv_id, model_messages(stored, system), display(stored), save, sampling)
