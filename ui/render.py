"""Text made safe to render: what a message, a model reply, a name or a path may do in the browser.

Scope: `safe_markdown(text)`, applied to every message the chat shows (user and assistant, stored and streaming),
and `literal(text)`, for every name, path and sentence put into the page's other Markdown (the header, the
Settings, Models and Stats tabs, the chat's notices): a model folder's name, an exception's text or a stored value
is shown as exactly those characters, with no Markdown or HTML of its own. Markdown keeps working — emphasis, lists, tables, links, code — but:
- images are shown as links (`![alt](url)` → `[image: alt](url)`), so nothing is fetched by merely showing a message:
  an image URL carrying the chat in its query string is the usual way LLM apps leak conversations;
- raw HTML is shown as text (`<` → `&lt;`), so no tag, style, form or overlay from a message reaches the page
  (Gradio's own sanitiser lets `<img src=…>` and `style=` through; scripts it already blocks).
It does NOT touch the stats line the chat appends (our own markup, added after this).

Why code is re-written rather than left alone: leaving "code" untouched would make the browser's Markdown parser,
not us, the judge of where code is, and every place the two disagree is a hole (an escaped backtick, a code span
across a paragraph break or a table cell, a fence closed by a longer one, an indented "fence"). So we decide, and
emit code in a form no parser can read otherwise: an inline span becomes `<code>` with its text escaped, and a
fenced block is re-fenced between blank lines with a fence longer than any backtick run inside it. Where we see
code the browser would not, the text is still shown as text; where the browser would see code we do not, it
shows escaped text. Either way no tag from a message is ever live.
"""

from __future__ import annotations

import re

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")
_INFO = re.compile(r"[\w.+#-]*")  # a language name: anything else in an info string is dropped
_SPAN = re.compile(r"(?<!\\)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)  # never across a blank line
_IMAGE = re.compile(r"!(\[)")
_PUNCT = re.compile(r"([!-%'-/:;=>-@\[-`{-~])")  # ASCII punctuation but '&' and '<', which become entities
_TICKS = re.compile(r"`+")
# What makes inline Markdown of a name: emphasis, code, links and images (brackets), tables, strikethrough, escapes.
_INLINE = re.compile(r"([\\`*_\[\]|~])")
# What makes a block of a line's first characters: a heading, a list item, a setext underline or a thematic break
# ("# ", "- ", "1. ", "==", "--"), a quote (">").
_LEADING = re.compile(r"^(\s*)(?:(\d+)([.)])(?=[ \t]|$)|([#+=-])(?=[ \t]|$|\4)|(>))")
_BREAK = re.compile(r"\r\n?|\n|\u2028|\u2029")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;")  # '>' alone opens no tag (and quotes need it)


def literal(text: object) -> str:
    """`text` (any value: a folder name, a path, a sentence with an exception's text) as inline Markdown showing
    exactly its characters: no tag, image, link, emphasis or code of its own, and on one line (a line break could
    start a heading or a block of HTML after it)."""
    flat = _BREAK.sub(" ", str(text))
    return _LEADING.sub(_escape_leading, _escape(_INLINE.sub(r"\\\1", flat)))


def _escape_leading(m: re.Match) -> str:
    space, digits, after_digits, mark, quote = m.groups()
    return f"{space}{digits}\\{after_digits}" if digits else f"{space}\\{mark or quote}"


def code_literal(text: object) -> str:
    """`literal(text)` in a monospace span (a path, a URL): `<code>` rather than backticks, since a backtick in
    the text would end a Markdown code span early."""
    return f"<code>{literal(text)}</code>"


def _prose(text: str) -> str:
    out, last = [], 0
    for m in _SPAN.finditer(text):
        out.append(_IMAGE.sub(r"\1image: ", _escape(text[last : m.start()])))
        code = _escape(_PUNCT.sub(r"\\\1", m.group(2).replace("\n", " ")))  # no emphasis, link or cell split
        out.append(f"<code>{code}</code>")
        last = m.end()
    out.append(_IMAGE.sub(r"\1image: ", _escape(text[last:])))
    return "".join(out)


def _fenced(indent: str, info: str, body: list[str]) -> str:
    longest = max((len(run) for line in body for run in _TICKS.findall(line)), default=0)
    fence = "`" * max(3, longest + 1)
    lang = _INFO.match(info.strip()).group(0)
    return "\n".join(["", f"{indent}{fence}{lang}", *body, f"{indent}{fence}", ""])


def safe_markdown(text: str) -> str:
    lines = text.split("\n")
    out, prose, i = [], [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None or (m.group(2)[0] == "`" and "`" in m.group(3)):  # a backtick fence's info has no backtick
            prose.append(lines[i])
            i += 1
            continue
        indent, mark, info = m.groups()
        close = re.compile(rf"^ {{0,3}}{re.escape(mark[0])}{{{len(mark)},}}[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), len(lines))
        if prose:
            out.append(_prose("\n".join(prose)))
        out.append(_fenced(indent, info, lines[i + 1 : end]))
        prose, i = [], end + 1
    if prose or not out:
        out.append(_prose("\n".join(prose)))
    return "\n".join(out)
