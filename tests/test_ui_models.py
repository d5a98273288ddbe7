"""Models tab: the built-in demo is listed under "Your models" (so it can be chosen again after another model was
loaded) under its people's name, and cannot be deleted."""

from __future__ import annotations

import gradio as gr
import pytest

from fmoe_local.config import RuntimeConfig
from fmoe_local.demo import demo_model_dir
from store import open_store
from ui import build
from ui.downloads import write_marker
from ui.models import downloaded_choices
from ui.session import DEMO_LABEL, Session


@pytest.fixture
def session(tmp_path):
    store = open_store(tmp_path)
    s = Session(store=store, config=RuntimeConfig(device="cpu"))
    yield s
    s.close()
    store.close()


def test_your_models_lists_the_demo_after_the_downloads(session):
    folder = session.models_dir / "acme--tiny"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    write_marker(folder, {"repo_id": "acme/tiny"})
    choices = downloaded_choices(session)
    assert choices[0][1] == str(folder) and choices[-1] == (DEMO_LABEL, str(demo_model_dir().resolve()))


def test_deleting_the_demo_is_refused_and_leaves_it_loaded(session):
    session.load(demo_model_dir())
    demo = build(session)
    delete = next(f for f in demo.fns.values() if f.api_name == "delete_model")
    with pytest.raises(gr.Error, match="demo model is part of the app"):
        delete.fn(str(demo_model_dir()))
    assert session.runtime is not None and (demo_model_dir() / "model.safetensors").is_file()
