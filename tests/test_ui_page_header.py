"""The page header during a load: Load redraws it at once with the model loading (the previous one is already gone),
then names the model loaded; a failed load leaves it naming what is loaded (the previous model when the new one was
refused before the unload, else none with the failure's sentence). Every other open tab's header follows on its
timer."""

from __future__ import annotations

import threading

import gradio as gr

from fmoe_local.quant_cache import QuantCache
from ui import build


def test_load_says_which_model_is_loading_then_the_one_loaded_or_why_none(
    ui_session, tiny_model_dir, monkeypatch, tmp_path
):
    ui_session.load(tiny_model_dir("qwen3_moe"))
    demo = build(ui_session)
    load = next(f for f in demo.fns.values() if f.name == "load_ui").fn  # the Load button's handler
    assert "qwen3" in next(f for f in demo.fns.values() if f.name == "after_load").fn()[0]
    real_write, release = QuantCache._write, threading.Event()

    def held(self, layer, tensors):
        release.wait(120)  # holds the load mid-copy while the page shows it
        real_write(self, layer, tensors)

    monkeypatch.setattr(QuantCache, "_write", held)
    follow = next(f for f in demo.fns.values() if f.name == "follow_header").fn  # another tab's timer
    other_tab = follow("")[0]
    assert "qwen3" in other_tab and all(u == gr.skip() for u in follow(other_tab))  # unchanged: nothing is sent
    mixtral = str(tiny_model_dir("mixtral"))
    steps = load(mixtral, "nf4", mixtral)
    _, _, top = next(steps)
    assert "**Loading mixtral" in top and "4-bit (nf4)" in top and "qwen3" not in top
    assert follow(other_tab)[0] == top  # the other tab stops naming a model that is gone
    release.set()
    *_, (status, _, top) = steps
    assert follow(other_tab)[0] == top
    assert status.startswith("Loaded mixtral") and top.startswith("# fmoe-local\n**mixtral") and "Loading" not in top
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # a folder that looks like a model and is not one
    *_, (status, _, top) = load(str(broken), "auto", str(broken))
    assert status.startswith("⚠️ Could not load broken") and status.endswith("is still loaded.")
    assert ui_session.runtime is not None and top.startswith("# fmoe-local\n**mixtral")  # refused before unloading
    ui_session.unload()
    *_, (status, _, top) = load(str(broken), "auto", str(broken))
    assert status.startswith("⚠️ Could not load broken") and ui_session.runtime is None
    assert "**No model loaded.** ⚠️ Could not load broken" in top and "mixtral" not in top
