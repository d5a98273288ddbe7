"""Settings tab: sizes in the unit that fits, one line of help on every field, impossible values refused, the expert
format saved for the next load with its label."""

from __future__ import annotations

import threading

import gradio as gr
import pytest

from fmoe_local.config import RuntimeConfig
from fmoe_local.demo import demo_model_dir
from fmoe_local.runtime import Runtime
from store import open_store
from ui import build, settings
from ui.session import DEMO_LABEL, Session


@pytest.fixture
def session(tmp_path):
    store = open_store(tmp_path)
    s = Session(store=store, config=RuntimeConfig(device="cpu"))
    s.load(demo_model_dir())
    yield s
    s.close()
    store.close()


def test_the_demo_cache_is_shown_in_mb_and_in_experts(session):
    _, size, experts, *_ = settings.refresh(session)
    assert (size.label, size.value) == ("Expert cache (MB)", 27.0)  # not 0.0263671875 GB
    assert experts == "27 MB = 48 experts of 0.562 MB each"
    assert "at least one expert (0.563 MB)" in size.info  # rounded up: typed back, it holds one expert
    # Every size of the tab in the field's unit: before, "one expert 589.8 KB" stood beside "0.562 MB".
    line = settings.describe(session)
    assert "one expert 0.562 MB" in line and "cache 27 MB" in line and " KB" not in line and " GB" not in line


def test_every_field_has_one_line_of_help(session):
    with gr.Blocks():
        tab = settings.build(session)
    fields = (
        tab.cache_size,
        tab.prefetch_distance,
        tab.policy,
        tab.store_capacity,
        tab.miss_handling,
        tab.expert_format,
        tab.dense_format,
    )
    for field in fields:
        assert field.info and "\n" not in field.info


@pytest.mark.parametrize(
    "cache, capacity, distance, sentence",
    [
        (-1, 10, 1, "-1 MB is too small: the expert cache must hold at least one expert (0.563 MB)"),
        (0.5, 10, 1, "0.5 MB is too small"),  # less than one expert: the old slider's minimum allowed this
        (999_999, 10, 1, "999999 MB is more than this machine has free"),
        (999, 10, 1, "999 MB is more than all of this model's experts take (27 MB)"),
        (float("nan"), 10, 1, "Type the expert cache size as a number of MB."),
        (None, 0, 1, "at least one expert map"),
        (None, float("nan"), 1, "at least one expert map"),
        # was Gradio's bare "Error" (MemoryError), and every later reply failed in the map store
        (None, 10**12, 1, "1,000,000,000,000 expert maps do not fit in memory: one takes 1.3 KB for this model"),
        (None, 10, 99, "the prefetch distance can be 1 to"),
    ],
)
def test_impossible_values_are_refused_with_a_sentence_and_nothing_changes(
    session, cache, capacity, distance, sentence
):
    cache = 27.0 if cache is None else cache
    demo = build(session)  # the page probes the machine once, saving its dtype verdicts: before the apply
    before = (session.runtime.info.cache_gb, session.store.settings.load())
    apply = next(f for f in demo.fns.values() if f.api_name == "apply_settings")
    info, status = apply.fn(cache, distance, "fmoe", capacity)  # said in the status line, not raised
    assert sentence in status and status.startswith("⚠️")
    assert info == gr.skip()
    assert (session.runtime.info.cache_gb, session.store.settings.load()) == before


def test_one_expert_is_the_smallest_cache_and_is_applied(session):
    demo = build(session)
    apply = next(f for f in demo.fns.values() if f.api_name == "apply_settings")
    one_mb = session.runtime.info.expert_bytes / 1024**2
    _, status = apply.fn(one_mb, 1, "fmoe", 10)
    assert "Applied without reloading" in status and "(1 experts)" in status
    _, status = apply.fn(0.563, 1, "fmoe", 10)  # the minimum as the refusal and the help write it
    assert "Applied without reloading" in status and "(1 experts)" in status


def test_the_most_this_machine_has_is_written_without_an_exponent_and_can_be_typed_back(session):
    demo = build(session)
    apply = next(f for f in demo.fns.values() if f.api_name == "apply_settings")
    _, status = apply.fn(999_999, 1, "fmoe", 10)
    most = status.split("room for at most ")[1].split(" MB")[0]
    assert "e+" not in status and most.replace(",", "").isdigit()  # was "1.94e+04 MB"
    top_mb = settings.cache_bounds(session)[0] * 1024
    assert float(most.replace(",", "")) <= top_mb < float(most.replace(",", "")) + 1


def test_miss_handling_applies_without_reloading_is_saved_and_explained(session):
    demo = build(session)
    apply = next(f for f in demo.fns.values() if f.api_name == "apply_settings")
    info = session.runtime.info
    size = settings.refresh(session)[1].value  # the cache as shown, in its unit
    _, said = apply.fn(size, info.prefetch_distance, info.policy, info.store_capacity, "copy")
    assert session.runtime.info.miss_handling == "copy" and session.store.settings.load().miss_handling == "copy"
    assert "No GPU: misses are copied within RAM because miss handling is set to copy" in said
    assert settings.refresh(session)[-3] == "copy"


def test_the_expert_format_is_saved_for_the_next_load_labelled_and_the_model_keeps_running(session):
    demo = build(session)
    apply = next(f for f in demo.fns.values() if f.api_name == "apply_settings")
    runtime, info = session.runtime, session.runtime.info
    # The demo's own form, what auto keeps: unquantised, in the CPU's float32 (not called bf16).
    assert "experts in float32 (full size)" in settings.describe(session)
    size = settings.refresh(session)[1].value
    _, said = apply.fn(size, info.prefetch_distance, info.policy, info.store_capacity, "auto", "nf4")
    assert session.runtime is runtime and runtime.info.expert_format == "bf16"  # no reload
    assert said.endswith(
        "Expert format 4-bit (nf4) is saved: the model runs in float32 (full size) until you load it again (Models tab, Load)."
    )
    assert session.store.settings.load().expert_format == "nf4" and settings.refresh(session)[-2] == "nf4"
    # …as the loaded model's own choice, which the Models tab brings back when that model is picked for Load.
    assert session.store.settings.model_format(str(session.model_dir)) == "nf4"
    with gr.Blocks():
        tab = settings.build(session)
    assert ("4-bit: ~4× smaller, slightly different answers", "nf4") in tab.expert_format.choices


def test_the_dense_format_is_saved_for_the_next_load_and_reaches_it(session):
    demo = build(session)
    apply = next(f for f in demo.fns.values() if f.api_name == "apply_settings")
    info = session.runtime.info
    assert info.dense_format == "bf16" and "output layer" not in settings.describe(session)
    size = settings.refresh(session)[1].value
    _, said = apply.fn(size, info.prefetch_distance, info.policy, info.store_capacity, "auto", "int8", "int8")
    assert not said.startswith("⚠️") and session.runtime.info.dense_format == "bf16"  # saved, not applied: no reload
    assert session.store.settings.load().dense_format == "int8" and settings.refresh(session)[-1] == "int8"
    session.load(demo_model_dir())  # the next load reads it
    assert session.runtime.info.dense_format == "int8"
    assert "attention and output layer in 8-bit" in settings.describe(session)


def test_an_unknown_dense_format_is_refused_before_anything_changes(session):
    demo = build(session)
    apply = next(f for f in demo.fns.values() if f.api_name == "apply_settings")
    before = session.store.settings.load()
    _, said = apply.fn(settings.refresh(session)[1].value, 1, "lru", 10, "copy", "auto", "fp8")
    assert said.startswith("⚠️ Unknown dense format 'fp8'")
    assert session.store.settings.load() == before and session.runtime.info.policy == "fmoe"


def test_an_unknown_expert_format_is_refused_before_anything_changes(session):
    demo = build(session)
    apply = next(f for f in demo.fns.values() if f.api_name == "apply_settings")
    before = session.store.settings.load()
    _, said = apply.fn(settings.refresh(session)[1].value, 1, "lru", 10, "copy", "fp8")
    assert said.startswith("⚠️ Unknown expert format 'fp8'")
    assert session.store.settings.load() == before and session.runtime.info.policy == "fmoe"


def test_too_many_maps_are_refused_with_no_model_loaded_and_not_saved(ui_session):
    # was "Saved. They apply when a model is loaded.", and every load then failed allocating 7 TB
    apply = next(f for f in build(ui_session).fns.values() if f.api_name == "apply_settings")
    before = ui_session.store.settings.load()
    info, status = apply.fn(4.0, 3, "fmoe", 10**12, "auto", "auto")
    assert info == gr.skip() and status.startswith("⚠️ 1,000,000,000,000 expert maps do not fit in memory")
    assert "even for the smallest model" in status and status.endswith("or fewer maps.")
    assert ui_session.store.settings.load() == before
    assert apply.fn(4.0, 3, "fmoe", 5000, "auto", "auto")[1] == "Saved. They apply when a model is loaded."


def test_apply_during_a_load_is_refused_and_the_tab_says_a_model_is_loading(ui_session, monkeypatch):
    # was "Saved. They apply when a model is loaded.", and the model that finished loading ran the old values
    s = ui_session
    gate, entered = threading.Event(), threading.Event()
    real = Runtime.load.__func__

    def slow(cls, *args, **kwargs):
        entered.set()
        gate.wait(30)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(Runtime, "load", classmethod(slow))
    job = s.start_load(demo_model_dir())
    try:
        assert entered.wait(30)
        demo = build(s)
        apply = next(f for f in demo.fns.values() if f.api_name == "apply_settings")
        clear = next(f for f in demo.fns.values() if f.api_name == "clear_maps")
        before = s.store.settings.load()
        info, said = apply.fn(0.03, 2, "lru", 123, "auto", "nf4")
        assert info == gr.skip() and said == (
            f"⚠️ {DEMO_LABEL} is still loading (the page's header says how far); Apply when it has loaded."
        )
        assert s.store.settings.load() == before
        assert "is still loading; clear its maps when it has loaded" in clear.fn()
        shown = settings.describe(s)
        assert f"{DEMO_LABEL} is loading" in shown and "No model loaded" not in shown
    finally:
        gate.set()
    assert job.finished.wait(60) and job.error == ""
    assert s.runtime.info.policy == s.store.settings.load().policy
    assert "is loading" not in settings.describe(s)


@pytest.mark.parametrize(
    ("typed", "shown", "line"),
    [
        (2.9, 2.82, "2.82 MB = 5 experts of 0.562 MB each"),  # 2.8125 MB: was shown 2.81 = 4 experts, and applied so
        (0.5625, 0.57, "0.57 MB = 1 experts of 0.562 MB each"),  # was "0.56 MB = 0 experts", and Apply refused it
    ],
)
def test_applying_the_cache_size_shown_keeps_the_same_number_of_experts(session, typed, shown, line):
    apply = next(f for f in build(session).fns.values() if f.api_name == "apply_settings")
    apply.fn(typed, 3, "fmoe", 4000)
    experts = session.runtime.info.cache_experts
    for policy in ("lru", "fmoe", "lfu"):  # each visit: refresh, change only the policy, Apply
        fields = settings.refresh(session)
        assert (fields[1].value, fields[2]) == (shown, line)
        _, said = apply.fn(fields[1].value, fields[3].value, policy, fields[5], fields[6], fields[7])
        assert said.startswith("Applied without reloading") and session.runtime.info.cache_experts == experts
    assert settings.experts_in(session, 2.25) == "2.25 MB = 4 experts of 0.562 MB each"  # a typed size: what it buys


def test_the_saved_cache_size_is_kept_exactly_when_applied_unchanged_with_no_model_loaded(ui_session):
    ui_session.store.settings.set(cache_gb=0.984375)  # 3 Mixtral experts of 0.328125 GB
    fields = settings.refresh(ui_session)
    assert fields[1].value == 0.99
    apply = next(f for f in build(ui_session).fns.values() if f.api_name == "apply_settings")
    assert apply.fn(fields[1].value, 3, "lru", 4000)[1] == "Saved. They apply when a model is loaded."
    assert ui_session.store.settings.load().cache_gb == 0.984375  # was 0.98: 2 experts at the next load


def test_a_saved_distance_beyond_the_models_layers_is_capped_said_and_kept_saved(ui_session):
    # was: the demo ran d=7 with 6 MoE layers, silently; the tab showed 5 and Apply saved 5 for every model
    s = ui_session
    s.store.settings.set(prefetch_distance=7)  # chosen while a deeper model was loaded
    said = s.load(demo_model_dir())
    assert (
        "Your saved prefetch distance 7 is more than this model's 6 MoE layers allow: it runs at 5 with this model, "
        "and 7 stays saved for the others."
    ) in said
    assert s.runtime.info.prefetch_distance == 5 and s.store.settings.load().prefetch_distance == 7
    fields = settings.refresh(s)
    assert (fields[3].value, fields[3].maximum) == (5, 5)
    assert fields[3].info.endswith("7 is saved; this model has 6 MoE layers, so it runs at 5.")
    apply = next(f for f in build(s).fns.values() if f.api_name == "apply_settings")
    _, status = apply.fn(fields[1].value, fields[3].value, "lru", fields[5], fields[6], fields[7])  # only the policy
    assert "prefetch distance 5 (7 stays saved for models with more layers), policy lru" in status
    assert s.store.settings.load().prefetch_distance == 7 and s.runtime.info.prefetch_distance == 5
    apply.fn(fields[1].value, 4, "lru", fields[5], fields[6], fields[7])  # a distance the user chose is saved
    assert s.store.settings.load().prefetch_distance == 4 and s.runtime.info.prefetch_distance == 4


def test_the_api_line_names_the_key_to_send(tmp_path):
    """With --listen the API asks for the access token: Settings must not keep saying "any API key"."""
    store = open_store(tmp_path)
    try:
        s = Session(store=store, config=RuntimeConfig(device="cpu"), api_base="http://127.0.0.1:7860/v1")
        assert "<code>http://127.0.0.1:7860/v1</code>, any API key." in settings.describe(s)
        s.api_key_required = True
        shown = settings.describe(s)
        assert "the access token printed at start as the API key" in shown and "any API key" not in shown
    finally:
        store.close()
