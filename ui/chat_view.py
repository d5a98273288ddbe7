"""What the chat shows: stored messages → Chatbot bubbles, the stats line under a reply, the conversation list.

Scope: pure formatting of store records (no events, no store writes). What the model reads is always the stored
text; the stats line is display-only and kept outside the reply's Markdown.

A reasoning model's reply is stored as the model wrote it, its thinking between `<think>` and `</think>`
(chat_flow.py writes the opening marker when the chat template opened the thought for the model). It is shown as
two bubbles: the thinking in Gradio's folded thought block ("Thinking", closed until clicked), then the answer with
its stats line, so the thought is never part of the answer's text. `bubble_messages` maps a bubble back to its
stored message (an edit's index counts the thought blocks).
"""

from __future__ import annotations

from ui.reasoning import REASONING, THINK, ThinkSplit
from ui.render import literal, safe_markdown
from ui.session import Session

THINKING = "Thinking"  # the folded block's title


def stats_line(stats: dict | None) -> str:
    if not stats:
        return ""
    parts = [f"{stats.get('tokens_per_s', 0):.1f} tok/s", f"TTFT {1000 * stats.get('ttft_s', 0):.0f} ms"]
    parts.append(f"expert hit rate {100 * stats.get('hit_rate', 0):.0f}%")
    if stats.get("finish_reason") == "cancelled":
        parts.append("stopped")
    elif stats.get("finish_reason") == "interrupted":  # ended by a model load, not the user (chat_flow)
        parts.append("interrupted: the model was unloaded or reloaded mid-reply (Regenerate for a whole reply)")
    elif stats.get("finish_reason") == "length":
        parts.append("length limit reached (raise Max new tokens under Generation for longer replies)")
    elif stats.get("finish_reason") == "context":  # the runtime's: no room left for more, whatever Max new tokens
        parts.append("the model's context is full (start a new chat to go on)")
    left_out, context = stats.get("left_out"), stats.get("context_length")
    if isinstance(left_out, int) and isinstance(context, int) and left_out > 0:  # chat_flow.fit
        parts.append(f"{left_out} earlier message{'s' if left_out > 1 else ''} not sent (context length {context:,})")
    return " · ".join(parts)


def display(messages) -> list[dict]:
    """Stored messages → Chatbot messages, with the stats line under each reply."""
    return [bubble for _, bubble in _bubbles(messages)]


def bubble_messages(messages) -> list:  # noqa: ANN001 - store Messages
    """The stored message each of `display(messages)`'s bubbles shows, bubble by bubble."""
    return [m for m, _ in _bubbles(messages)]


def _bubbles(messages) -> list[tuple[object, dict]]:  # noqa: ANN001 - store Messages
    out = []
    for m in messages:
        if m.role == "system":
            continue
        if m.role == "assistant":
            out += [(m, bubble) for bubble in reply_bubbles(m.content, stats_line(m.stats))]
        else:
            out.append((m, {"role": m.role, "content": safe_markdown(m.content)}))
    return out


def thought_of(text: str, whole: bool = True) -> tuple[str, str, bool] | None:
    """(thinking, answer, still open) of a reply that starts with a thought (`<think>`), read by the API's reader
    (reasoning.ThinkSplit); None when it has none. Not `whole` (still streaming): what may be the start of a marker
    is held back."""
    if not text.lstrip().startswith(THINK.start):
        return None
    split = ThinkSplit(THINK)
    pieces = split.add(text) + (split.finish() if whole else [])
    thinking = "".join(piece for kind, piece in pieces if kind == REASONING)
    return thinking, "".join(piece for kind, piece in pieces if kind != REASONING), THINK.end not in text


def reply_bubbles(text: str, line: str = "", writing: bool = False) -> list[dict]:
    """A reply's bubbles: its thinking folded (when it has one), then its answer with the stats `line` under it.
    `writing`: the reply is still streaming (no answer bubble before the answer starts; a thought still open says
    so beside its title)."""
    if writing and text.strip() and THINK.start.startswith(text.lstrip()):
        return [{"role": "assistant", "content": "…"}]  # the start of a thought's marker: not shown as text
    parts = thought_of(text, whole=not writing)
    out = []
    if parts is not None:
        thinking, text, still_open = parts
        meta = {"title": THINKING, "status": "done"}  # "done": Gradio draws the block closed
        if writing and still_open:
            meta["log"] = "still thinking…"
        out.append({"role": "assistant", "content": safe_markdown(thinking) or "…", "metadata": meta})
    content = safe_markdown(text)
    if line:
        # A reply cut inside a code block would swallow the stats line as code: close the block first.
        content = f"{content}{close_fences(content)}\n\n<span class='reply-stats'>{line}</span>"
    if content or parts is None:  # a reply cut inside its thought has no answer to show
        out.append({"role": "assistant", "content": content})
    return out


def close_fences(markdown: str) -> str:
    """The fence that closes a code block left open at the end of `markdown` ("" when none is open)."""
    open_fence = ""
    for line in markdown.splitlines():
        stripped = line.strip()
        fence = stripped[:3] if stripped[:3] in ("```", "~~~") else ""
        if fence and not open_fence:
            open_fence = stripped[: len(stripped) - len(stripped.lstrip(fence[0]))]
        elif fence and stripped.startswith(open_fence) and set(stripped) == {open_fence[0]}:
            open_fence = ""
    return f"\n{open_fence}" if open_fence else ""


def conversation_choices(session: Session, query: str = "") -> list[tuple[str, int]]:
    if query.strip():
        convs = [hit.conversation for hit in session.store.chats.search(query)]
    else:
        convs = session.store.chats.list()
    return [(c.title or "Untitled", c.id) for c in convs]


def warning(sentence: str) -> str:
    """An inline notice in the chat (never a red error pill over the components). The sentence is shown as text: it
    may name a model folder, quote an exception or a stored value."""
    return f"⚠️ {literal(sentence)}"
