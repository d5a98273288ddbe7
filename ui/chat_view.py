"""What the chat shows: stored messages → Chatbot bubbles, the stats line under a reply, the conversation list.

Scope: pure formatting of store records (no events, no store writes). What the model reads is always the stored
text; the stats line is display-only and kept outside the reply's Markdown.
"""

from __future__ import annotations

from ui.render import literal, safe_markdown
from ui.session import Session


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
    return " · ".join(parts)


def display(messages) -> list[dict]:
    """Stored messages → Chatbot messages, with the stats line under each reply."""
    out = []
    for m in messages:
        if m.role == "system":
            continue
        content = safe_markdown(m.content)
        line = stats_line(m.stats) if m.role == "assistant" else ""
        if line:
            # A reply cut inside a code block would swallow the stats line as code: close the block first.
            content = f"{content}{close_fences(content)}\n\n<span class='reply-stats'>{line}</span>"
        out.append({"role": m.role, "content": content})
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
