"""Settings tab: sizes in the unit that fits, one line of help on every field, impossible values refused."""

from __future__ import annotations

import gradio as gr
import pytest

from fmoe_local.config import RuntimeConfig
from fmoe_local.demo import demo_model_dir
from store import open_store
from ui import build, settings
from ui.session import Session


@pytest.fixture
def session(tmp_path):
    store = open_store(tmp_path)
    s = Session(store=store, config=RuntimeConfig(device="cpu"))
    s.load(demo_model_dir())
    yield s
    s.close()
    store.close()


def test_a_tiny_cache_is_shown_in_mb_and_the_slider_value_is_rounded_to_its_step(session):
    slider = settings.refresh(session)[1]
    step = slider.step
    assert abs(slider.value / step - round(slider.value / step)) < 1e-6  # not 0.0098876953125
    assert "Now 27.00 MB = 48 experts of 589.8 KB each." in slider.info  # the demo model's default cache


def test_every_field_has_one_line_of_help(session):
    with gr.Blocks():
        tab = settings.build(session)
    for field in (tab.cache_gb, tab.prefetch_distance, tab.policy, tab.store_capacity):
        assert field.info and "\n" not in field.info


@pytest.mark.parametrize(
    "cache, capacity, sentence",
    [(-1, 10, "more than 0 GB"), (999_999, 10, "has room for at most"), (None, 0, "at least one expert map")],
)
def test_impossible_values_are_refused_with_a_sentence_and_nothing_changes(session, cache, capacity, sentence):
    cache = session.runtime.info.cache_gb if cache is None else cache
    before = (session.runtime.info.cache_gb, session.store.settings.load())
    demo = build(session)
    apply = next(f for f in demo.fns.values() if f.api_name == "apply_settings")
    with pytest.raises(gr.Error, match=sentence):
        apply.fn(cache, 1, "fmoe", capacity)
    assert (session.runtime.info.cache_gb, session.store.settings.load()) == before
