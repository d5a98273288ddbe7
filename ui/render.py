"""Message text made safe to render: what a message or a model reply may do in the browser.

Scope: one function, `safe_markdown(text)`, applied to every message the chat shows (user and assistant, stored
and streaming). Markdown keeps working — emphasis, lists, tables, links, code — but outside code:
- images are shown as links (`![alt](url)` → `[image: alt](url)`), so nothing is fetched by merely showing a message:
  an image URL carrying the chat in its query string is the usual way LLM apps leak conversations;
- raw HTML is shown as text (`<` → `&lt;`), so no tag, style, form or overlay from a message reaches the page
  (Gradio's own sanitiser lets `<img src=…>` and `style=` through; scripts it already blocks).
Code spans and fenced blocks are left exactly as written: there `<` is already text. It does NOT touch the stats
line the chat appends (our own markup, added after this).
"""

from __future__ import annotations

import re

# A fenced block (``` or ~~~, to its closing fence or the end) or an inline code span (matching backtick runs).
_CODE = re.compile(r"(?ms)^[ \t]*(`{3,}|~{3,})[^\n]*\n.*?(?:^[ \t]*\1[ \t]*$|\Z)|(`+)(?!`).+?(?<!`)\2(?!`)")
_IMAGE = re.compile(r"!(\[)")


def _outside_code(text: str) -> str:
    text = text.replace("&", "&amp;").replace("<", "&lt;")  # '>' alone opens no tag (and quotes need it)
    return _IMAGE.sub(r"\1image: ", text)


def safe_markdown(text: str) -> str:
    out, last = [], 0
    for m in _CODE.finditer(text):
        out.append(_outside_code(text[last : m.start()]))
        out.append(m.group(0))
        last = m.end()
    out.append(_outside_code(text[last:]))
    return "".join(out)
