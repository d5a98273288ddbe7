"""One chat as a Markdown file (the chat's "Export as Markdown"): a transcript any Markdown viewer shows safely.

Scope: stored conversation and messages → Markdown text. It does NOT write the file (ui/chat.py) or export JSON
(store/chats.py: data, not a rendering).

The file is opened later in viewers we do not control (an editor's preview, a notes app, a Git host), which fetch
images and render raw HTML. So the text of every message goes through render.safe_markdown, as in the page: images
become links (`![x](http://…?c=secret)` would fetch the URL, the chat in its query string, when the file is
opened) and HTML is text. And the transcript's structure is ours alone: each message is quoted (every line of it
starts with "> "), so nothing a user or a model writes can leave its quote. A "### Assistant" line in a message is
a heading inside that message's quote, never a turn of the transcript; the turn headings are the only headings
outside a quote. A reasoning model's thinking is a section of its own before the answer (chat_view.thought_of). Names (the title, the model) are shown as text with render.literal.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone

from ui.chat_view import thought_of
from ui.render import literal, safe_markdown

_LINE_END = re.compile(r"\r\n?|\n")  # CommonMark's line endings: a lone "\r" ends a line too


def chat_markdown(chats, conversation_id: int) -> str:  # noqa: ANN001 - a store ChatStore
    """The conversation as Markdown: its title, when and with which model it was held, then each message under its
    role's heading, quoted, with its stats line."""
    conv = chats.get(conversation_id)
    meta = [f"Exported from fmoe-local · started {_iso(conv.created)}"]
    if conv.model:
        meta.append(f"model: {literal(conv.model)}")
    lines = [f"# {literal(conv.title) or 'Untitled'}", "", "*" + " · ".join(meta) + "*", ""]
    for m in chats.messages(conversation_id):
        parts = thought_of(m.content) if m.role == "assistant" else None
        if parts is not None:  # a reasoning model's thinking: its own section, never part of the answer
            lines += ["### Assistant (thinking)", "", _quoted_text(parts[0]), ""]
        text = parts[1] if parts is not None else m.content
        lines += [f"### {m.role.capitalize()}", "", _quoted_text(text), ""]
        if m.stats:
            lines += [f"*{literal(_stats_line(m.stats))}*", ""]
    return "\n".join(lines).rstrip() + "\n"


def _quoted_text(text: str) -> str:
    text = _LINE_END.sub("\n", text)  # else a "\r" would start a line of its own outside the quote
    return quoted(safe_markdown(text).strip("\n"))


def quoted(markdown: str) -> str:
    """`markdown` as one block quote: every line starts with ">", so a heading, a fence left open or an HTML block in
    it ends with the quote, and a line of its own can never be read outside it."""
    return "\n".join(f"> {line}" if line.strip() else ">" for line in _LINE_END.split(markdown))


def _stats_line(stats: dict) -> str:
    parts = []
    try:
        if "tokens" in stats:
            parts.append(f"{int(stats['tokens'])} tokens")
        if stats.get("tokens_per_s"):
            parts.append(f"{float(stats['tokens_per_s']):.1f} tok/s")
        if stats.get("ttft_s"):
            parts.append(f"first token {float(stats['ttft_s']):.2f} s")
        if "hit_rate" in stats:
            parts.append(f"expert hit rate {100 * float(stats['hit_rate']):.0f}%")
    except (TypeError, ValueError):  # written by another version: shown as it is stored
        parts = []
    return " · ".join(parts) or json.dumps(stats)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
