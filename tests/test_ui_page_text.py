"""Every name, path and sentence the page shows outside the chat's messages is text: a model folder's name, a load's
failure or a stored value cannot add a tag, an image, a link, emphasis or a heading to the header, the Settings,
Models or Stats tabs or the chat's notices (docs/security.md, rows 15e and 15f)."""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from ui.load_job import LoadJob, ModelLoadError

# A folder name may hold anything but "/" and NUL: an overlay, Markdown of every kind, a line that makes a heading.
HOSTILE = (
    '<div style="position:fixed;inset:0;z-index:99999;background:red">cover **bold** _em_ ~~gone~~ `code` '
    "[link](javascript:alert(1)) ![img](http:attacker.example?c=1) | cell | &lt;b&gt;\n# Heading\n1. item"
)
SHOWN = HOSTILE.replace("\n", " ")  # on one line: a line break could start a heading or an HTML block


def _rendered(markdown: str) -> tuple[str, str]:
    """(HTML, visible text) of `markdown` as a CommonMark parser with GFM tables and strikethrough renders it."""
    from markdown_it import MarkdownIt

    out = MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(markdown)
    return out, html.unescape(re.sub(r"<[^>]+>", "", out))


def shows_as_text(markdown: str, value: str = SHOWN) -> None:
    out, text = _rendered(markdown)
    live = [t for t in re.findall(r"<(\w+)", out) if t not in ("p", "strong", "code", "h1")]
    assert live == [], (live, markdown)  # no tag of the name's own: no div, img, a, em, s, table, h1 from a line…
    assert value in text, (value, text)  # …and every character of it shown as it is


@pytest.fixture
def hostile_model(ui_session, tiny_model_dir) -> Path:
    folder = ui_session.models_dir / HOSTILE  # in the models folder, not downloaded by the app (no marker)
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_model_dir("mixtral"), folder)
    return folder


def _fn(demo, name: str):
    return next(f for f in demo.fns.values() if f.name == name or f.api_name == name).fn


def test_a_loaded_model_s_folder_name_is_text_everywhere_the_page_names_it(ui_session, hostile_model):
    """Before: the header rendered the name as live HTML (an overlay over the whole page, back on every start)."""
    from ui import build, model_formats, settings, stats
    from ui.page_header import header

    demo = build(ui_session)
    *_, (status, _, top) = _fn(demo, "load_ui")(str(hostile_model), "auto", str(hostile_model))
    assert ui_session.runtime is not None, status
    for shown in (status, top, header(ui_session), settings.describe(ui_session)):
        shows_as_text(shown)
    shows_as_text(stats.summary(ui_session), "")  # it names the device, not the model
    shows_as_text(model_formats.choice_note(ui_session, "auto", str(hostile_model)))  # the note under the choice
    said, _ = _fn(demo, "delete_model")(str(hostile_model))  # refused: the app did not download it
    assert "was not downloaded by this app" in said
    shows_as_text(said)
    ui_session.api_base = "http://127.0.0.1:7860/v1`<img src=http:x>"
    shows_as_text(settings.describe(ui_session), ui_session.api_base)


def test_a_failed_or_running_load_s_sentence_is_text_in_the_header_tabs_and_chat(ui_session, tmp_path):
    from ui import build, settings, stats
    from ui.page_header import header

    broken = tmp_path / HOSTILE
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # looks like a model, is not one: the failure names the folder
    with pytest.raises(ModelLoadError):
        ui_session.load(broken)
    assert HOSTILE in ui_session.load_error
    demo = build(ui_session)
    for shown in (header(ui_session), settings.describe(ui_session), stats.summary(ui_session)):
        shows_as_text(shown)
    generation = ("", 0.7, 0.9, 0, 16, 1.0, 0.0, 0.0, 0)
    *_, notice = next(_fn(demo, "send")("Hello", None, *generation))  # no model: the chat says why
    shows_as_text(notice.value)
    *_, (status, _, _) = _fn(demo, "load_ui")(str(broken), "auto", str(broken))
    shows_as_text(status)
    job = LoadJob(broken, "auto")  # a load under way: the header and Settings name it
    ui_session.loading = job
    try:
        shows_as_text(header(ui_session))
        shows_as_text(settings.describe(ui_session))
        _, said = _fn(demo, "apply_settings")(4.0, 3, "fmoe", 100)
        shows_as_text(said)
    finally:
        job.finished.set()


def test_the_header_shows_a_damaged_database_s_new_path_as_text():
    from ui.page_header import header

    moved = Path("/data") / (HOSTILE + ".corrupt-1.db")
    recovery = SimpleNamespace(moved_to=moved, what_came_back=lambda: "all 2 chats were recovered from it")
    session = SimpleNamespace(
        store=SimpleNamespace(recovery=recovery), loading=None, runtime=None, load_error="", settings_notice=""
    )
    shows_as_text(header(session), str(moved).replace("\n", " "))
