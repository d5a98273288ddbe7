"""A load can be stopped: choosing another model stops the one still loading (it used to run to its end, out of
sight, and be thrown away), and the Models tab's Stop loading ends it; a first int8/nf4 load stops at its next
expert and keeps the copy's finished layers; a load that reports nothing (plain weights) ends without a model."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fmoe_local.quant_cache import QuantCache
from ui import model_formats
from ui.load_job import LoadCancelled, LoadJob
from ui.models import load_steps
from ui.render import literal


def test_a_cancelled_job_raises_at_its_next_report_and_a_finished_one_cannot_be_cancelled():
    job = LoadJob(Path("m"), "nf4")
    job.report(3, 32)
    assert job.cancel() and job.cancelled.is_set()
    with pytest.raises(LoadCancelled):
        job.report(4, 32)
    assert (job.done, job.total) == (3, 32)  # the last progress it made stays on show
    done = LoadJob(Path("m"), "bf16")
    done.finished.set()
    assert not done.cancel()


@pytest.fixture()
def held_copy(monkeypatch):
    """QuantCache._write waits for `release` at its first layer (the copy in progress: minutes on a real model)."""
    real_write, release, holding = QuantCache._write, threading.Event(), threading.Event()

    def held(self, layer, tensors):
        holding.set()
        assert release.wait(60)
        real_write(self, layer, tensors)

    monkeypatch.setattr(QuantCache, "_write", held)
    return holding, release


def test_choosing_another_model_stops_the_load_still_making_its_copy(ui_session, tiny_model_dir, held_copy):
    holding, release = held_copy
    a, b = tiny_model_dir("mixtral"), tiny_model_dir("qwen2_moe")
    ui_session.store.settings.set(**ui_session.store.settings.format_choice(str(a), "nf4"))
    job_a = ui_session.start_load(a)  # as app.py's start-up load of the last model
    assert holding.wait(30)
    steps = load_steps(ui_session, str(b), "bf16")  # the user picks B and presses Load
    _, bar = next(steps)
    assert f"Waiting for the load of {a.name}" in bar  # was: "Loading qwen2_moe… 0 s" while A went on unseen
    release.set()
    *_, (status, _) = steps
    assert job_a.finished.is_set() and job_a.message == ""  # was: A loaded in full, then thrown away
    assert job_a.error.startswith(f"Stopped loading {a.name}. The part of its 4-bit (nf4) copy made so far is kept")
    assert status.startswith(f"Loaded {literal(b.name)}") and ui_session.model_dir == b  # the page shows names as text
    copy = next(p for p in Path(ui_session.config.quant_cache_dir).iterdir() if "-nf4-" in p.name)
    assert sorted(f.name for f in copy.iterdir()) == ["layer-0000.safetensors"]  # the finished layer is kept


def test_stop_loading_ends_a_load_making_its_copy(ui_session, tiny_model_dir, held_copy):
    holding, release = held_copy
    a = tiny_model_dir("mixtral")
    ui_session.store.settings.set(**ui_session.store.settings.format_choice(str(a), "nf4"))
    job = ui_session.start_load(a)
    assert holding.wait(30)
    assert ui_session.cancel_load() == f"Stopping the load of {a.name}…"
    release.set()
    assert job.finished.wait(60)
    assert job.error.startswith(f"Stopped loading {a.name}.") and ui_session.runtime is None
    assert ui_session.load_error == ""  # not a failure to explain in the header: the user stopped it
    assert ui_session.cancel_load() == "No model is loading."


def test_a_load_stopped_while_reading_plain_weights_ends_without_a_model(ui_session, tiny_model_dir, monkeypatch):
    from fmoe_local import runtime as runtime_module

    started, release = threading.Event(), threading.Event()
    real_load = runtime_module.Runtime.load.__func__

    def slow_load(cls, *args, **kwargs):
        started.set()
        assert release.wait(60)
        return real_load(cls, *args, **kwargs)

    monkeypatch.setattr(runtime_module.Runtime, "load", classmethod(slow_load))
    a = tiny_model_dir("mixtral")
    job = ui_session.start_load(a)
    assert started.wait(30)
    ui_session.cancel_load()  # bf16 reports no progress: the load cannot stop until its weights are read
    release.set()
    assert job.finished.wait(60)
    assert job.error == f"Stopped loading {a.name}." and ui_session.runtime is None  # was: loaded anyway


def test_the_bar_names_the_load_it_waits_for_until_that_one_has_stopped():
    earlier = LoadJob(Path("/models/first"), "nf4")
    job = LoadJob(Path("/models/second"), "bf16", started=0.0, after=earlier)
    assert model_formats.load_progress(job, 3.0)[1] == "Waiting for the load of first to stop… 3 s"
    earlier.finished.set()
    assert model_formats.load_progress(job, time.monotonic())[1].startswith("Loading second")
