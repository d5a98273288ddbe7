"""Models tab: the built-in demo is listed under "Your models" (so it can be chosen again after another model was
loaded) under its people's name, and cannot be deleted; each catalog model shows its sizes and verdict per expert
format with one recommended; a format that does not fit names one that does; Load uses the chosen format, says how
far a first quantised load got, and says a failure as a sentence; a failed Load changes no other model's format."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import gradio as gr
import pytest

from fmoe_local.catalog import CATALOG, GB, find
from fmoe_local.demo import demo_model_dir
from fmoe_local.hardware import Machine, format_fits
from fmoe_local.quant_cache import QuantCache
from ui import build, model_formats
from ui.downloads import STARTED_MARKER, DownloadStatus, write_marker
from ui.load_job import LoadJob
from ui.models import HEADERS, catalog_rows, downloaded_choices, load_steps
from ui.session import DEMO_LABEL

DESKTOP = Machine("cuda", "RTX 4070", 12 * GB, 11 * GB, 64 * GB, 60 * GB, 500 * GB)
SMALL_GPU = Machine("cuda", "RTX 3050", 6 * GB, int(5.5 * GB), 64 * GB, 60 * GB, 500 * GB)
MIXTRAL = find("mistralai/Mixtral-8x7B-Instruct-v0.1")


def test_your_models_lists_the_demo_after_the_downloads(ui_session):
    folder = ui_session.models_dir / "acme--tiny"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    write_marker(folder, {"repo_id": "acme/tiny"})
    choices = downloaded_choices(ui_session)
    assert choices[0][1] == str(folder) and choices[-1] == (DEMO_LABEL, str(demo_model_dir().resolve()))


def test_deleting_the_demo_is_refused_with_a_sentence_and_leaves_it_loaded(ui_session):
    ui_session.load(demo_model_dir())
    demo = build(ui_session)
    delete = next(f for f in demo.fns.values() if f.api_name == "delete_model")
    status, _ = delete.fn(str(demo_model_dir()))
    assert status == "⚠️ The demo model is part of the app and cannot be deleted."
    assert ui_session.runtime is not None and (demo_model_dir() / "model.safetensors").is_file()


def test_delete_refuses_a_folder_the_app_did_not_download_and_unloads_nothing(ui_session, tiny_model_dir):
    mine = ui_session.models_dir / "my-llama"  # the user's own folder, which happens to sit in the models folder
    shutil.copytree(tiny_model_dir("mixtral"), mine)
    ui_session.load(mine)
    demo = build(ui_session)
    delete = next(f for f in demo.fns.values() if f.api_name == "delete_model")
    status, _ = delete.fn(str(mine))
    assert status == (
        "⚠️ my-llama was not downloaded by this app, so it is not deleted here. Delete it in your file manager if you "
        "no longer want it."
    )
    assert (mine / "config.json").is_file() and ui_session.runtime is not None  # still there, still loaded
    write_marker(mine, {"repo_id": "acme/my-llama"})  # one of ours: deleted, after unloading it
    status, _ = delete.fn(str(mine))
    assert status == "Deleted my-llama." and not mine.exists() and ui_session.runtime is None


def test_deleting_a_model_also_deletes_its_quantised_copies_and_no_other(ui_session, tiny_model_dir):
    import torch

    root = Path(ui_session.config.quant_cache_dir)
    mine, other = ui_session.models_dir / "acme--tiny", ui_session.models_dir / "acme--other"
    shutil.copytree(tiny_model_dir("mixtral"), mine)
    shutil.copytree(tiny_model_dir("qwen2_moe"), other)
    write_marker(mine, {"repo_id": "acme/tiny"})
    copies = [QuantCache(root, mine, fmt, torch.float32, 2).dir for fmt in ("int8", "nf4")]
    kept = QuantCache(root, other, "nf4", torch.float32, 2).dir
    for folder in (*copies, kept):
        folder.mkdir(parents=True)
        with open(folder / "layer-0000.safetensors", "wb") as f:
            f.truncate(300_000_000 if folder == copies[0] else 10)  # sparse: its size without writing it
    delete = next(f for f in build(ui_session).fns.values() if f.api_name == "delete_model")
    status, _ = delete.fn(str(mine))
    # before: gigabytes of copies stayed behind, and a model downloaded again (new file times) never reads them
    assert status == "Deleted acme--tiny and its quantised copy (300 MB)."  # was "0.3 GB"
    assert not any(c.exists() for c in copies) and kept.is_dir()


def test_each_catalog_row_shows_every_format_with_its_verdict_and_one_recommended(ui_session):
    ui_session._machine = DESKTOP
    rows = catalog_rows(ui_session)
    assert HEADERS[-3:] == ["bf16 experts", "8-bit experts", "4-bit experts"]
    assert all(len(row) == len(HEADERS) and sum("recommended" in c for c in row) == 1 for row in rows)
    mixtral = rows[[e.repo_id for e in CATALOG].index(MIXTRAL.repo_id)]
    # 90 GB of bf16 experts spill out of 57 GB of free RAM; 45 GB of int8 fit, and int8 is the most faithful that does.
    assert mixtral[-3:] == ["Runs, slowly · 90.2 GB", "Fits · 45.1 GB · recommended", "Fits · 25.4 GB"]
    gpt_oss = rows[[e.repo_id for e in CATALOG].index("openai/gpt-oss-20b")]
    assert gpt_oss[-1].startswith("MXFP4 (as released): Fits")  # its own 4-bit, not a re-quantised nf4


def test_the_picked_model_s_table_labels_each_format_and_says_no_ready_made_4_bit_is_listed():
    text = model_formats.detail(MIXTRAL, format_fits(MIXTRAL, DESKTOP))
    assert "recommended here: **8-bit (int8)** (~2× smaller, nearly the same answers)" in text
    assert "| 4-bit (nf4) | ~4× smaller, slightly different answers | 118.8 GB | 25.4 GB |" in text  # 93.4 + 25.4
    assert "| bf16 | full size, the model's exact answers | 93.4 GB | 90.2 GB |" in text
    assert "no ready-made 8-bit or 4-bit download" in text
    full_disk = Machine("cuda", "RTX 4070", 12 * GB, 11 * GB, 64 * GB, 60 * GB, 20 * GB)
    nowhere = model_formats.detail(MIXTRAL, format_fits(MIXTRAL, full_disk))
    assert "no expert format fits on this computer. Not enough disk space" in nowhere and "recommended)" not in nowhere
    gpt_oss = find("openai/gpt-oss-20b")
    assert "already MXFP4: Auto keeps it" in model_formats.detail(gpt_oss, format_fits(gpt_oss, DESKTOP))


def _downloaded(ui_session, entry) -> str:
    """A finished download of a catalog model (its folder as "Your models" lists it)."""
    folder = ui_session.models_dir / entry.repo_id.replace("/", "--")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    write_marker(folder, {"repo_id": entry.repo_id})
    return str(folder)


def test_a_format_that_does_not_fit_is_said_under_the_choice_with_one_that_does(ui_session):
    ui_session._machine = SMALL_GPU
    mixtral = _downloaded(ui_session, MIXTRAL)
    note = model_formats.choice_note(ui_session, "bf16", mixtral)
    assert (
        note.startswith("⚠️ Mixtral 8x7B Instruct: bf16 does not fit here: Not enough GPU memory")
        and "Choose 8-bit instead" in note
    )
    int8 = model_formats.choice_note(ui_session, "int8", mixtral)
    assert int8 == (
        "The first load of Mixtral 8x7B Instruct in 8-bit (int8) makes a copy of its experts (45.1 GB on disk; "
        "minutes, with progress shown); later loads reuse it."
    )
    demo = model_formats.choice_note(ui_session, "nf4", str(demo_model_dir()))  # not a catalog model
    assert demo == f"For {DEMO_LABEL}: Load uses 4-bit (nf4)."


def test_the_format_choice_belongs_to_the_model_picked_for_load_not_to_a_catalog_row(
    ui_session, tiny_model_dir, monkeypatch
):
    monkeypatch.setattr("ui.session.probe", lambda _, verdicts=None: DESKTOP)  # probed again after each load
    olmoe = find("allenai/OLMoE-1B-7B-0924-Instruct")
    mixtral, other = _downloaded(ui_session, MIXTRAL), _downloaded(ui_session, olmoe)
    best = {e.repo_id: next(f.choice for f in format_fits(e, DESKTOP, True) if f.recommended) for e in (MIXTRAL, olmoe)}
    assert best[MIXTRAL.repo_id] == "int8" and best[olmoe.repo_id] != "int8"
    demo = build(ui_session)
    handler = {f.name: f for f in demo.fns.values()}
    # A catalog row shows that model's table; it no longer touches the choice another model's Load takes.
    pick = handler["pick"]
    assert pick.fn(gr.SelectData(None, {"index": [0, 0], "value": "x"}))[0] == CATALOG[0].repo_id
    assert "load-format" not in [demo.blocks[o._id].elem_id for o in pick.outputs]
    follow = handler["follow"].fn  # picking a model under "Your models"
    fmt, note, target = follow(mixtral)
    assert fmt == "int8" and "Mixtral 8x7B Instruct" in note and target == mixtral
    fmt, note, _ = follow(other)
    assert fmt == best[olmoe.repo_id] and note.startswith("For OLMoE 1B-7B Instruct: Load uses")
    # The user's own choice for a model is what that model brings back, whatever was loaded since.
    tiny = ui_session.models_dir / "acme--tiny"
    shutil.copytree(tiny_model_dir("mixtral"), tiny)
    write_marker(tiny, {"repo_id": "acme/tiny"})
    assert follow(str(tiny))[0] == "auto"  # not in the catalog and never chosen: the default
    *_, (status, _) = load_steps(ui_session, str(tiny), "int8")
    assert status.startswith("Loaded acme--tiny") and ui_session.runtime.info.expert_format == "int8"
    assert follow(mixtral)[0] == "int8" and follow(other)[0] == best[olmoe.repo_id]
    fmt, note, _ = follow(str(tiny))
    assert fmt == "int8" and note == "For acme--tiny: Load uses 8-bit (int8)."
    ui_session.store.settings.set(**ui_session.store.settings.format_choice(mixtral, "nf4"))
    assert follow(mixtral)[0] == "nf4" and follow(str(tiny))[0] == "int8"


def test_a_typed_folder_takes_the_format_choice_and_its_note_and_each_button_loads_its_own(
    ui_session, tiny_model_dir, monkeypatch
):
    monkeypatch.setattr("ui.session.probe", lambda _, verdicts=None: DESKTOP)
    mixtral = _downloaded(ui_session, MIXTRAL)
    typed = str(tiny_model_dir("mixtral"))
    name = Path(typed).name
    demo = build(ui_session)
    handler = {f.name: f for f in demo.fns.values()}
    follow, follow_typed = handler["follow"].fn, handler["follow_typed"].fn
    assert follow(mixtral)[:2] == ("int8", model_formats.choice_note(ui_session, "int8", mixtral))
    # Typing a folder: the note names it, not the model still picked in the list; a folder with no format of its
    # own keeps the one chosen (the user may have picked it for this folder first).
    fmt, note, target = follow_typed(f" {typed} ", mixtral, "nf4")
    assert (fmt, note, target) == ("nf4", f"For {name}: Load uses 4-bit (nf4).", typed)
    assert follow_typed("", mixtral, "nf4")[0::2] == ("int8", mixtral)  # an emptied box: back to the list's model
    # Each button loads its own model; the shown format goes with the model the note names. "Load" for the list's
    # model while the note names the typed folder loads Mixtral in its own format, not the folder's.
    load_ui = handler["load_ui"].fn
    *_, (status, _, header) = load_ui(typed, "nf4", typed)
    assert "experts in 4-bit (nf4)" in status and ui_session.runtime.info.expert_format == "nf4"
    other = tiny_model_dir("mixtral", seed=1)
    *_, (status, _, _) = load_ui(str(other), "nf4", typed)  # the note named `typed`, not this folder
    assert status.startswith(f"Loaded {other.name}") and "nf4" not in status
    assert ui_session.store.settings.model_format(str(other)) == "auto"


def test_load_uses_the_chosen_format_and_shows_how_far_the_copy_got(ui_session, tiny_model_dir, monkeypatch):
    real_write, release = QuantCache._write, threading.Event()

    def held(self, layer, tensors):
        release.wait(120)  # holds the first load mid-copy until the page has shown its progress
        real_write(self, layer, tensors)

    monkeypatch.setattr(QuantCache, "_write", held)
    steps = load_steps(ui_session, str(tiny_model_dir("mixtral")), "nf4")
    status, bar = next(steps)
    # The page polls: on a busy machine a poll can land while layer 0's experts are still being quantised (6 of
    # 32); the held write keeps the copy at layer 0's 8 until the page has shown them.
    while "experts: 8 of 32 experts" not in bar:
        status, bar = next(steps)
    assert status == "" and "Making the 4-bit (nf4) copy of" in bar and "kept for the next" in bar
    release.set()
    *_, (status, bar) = steps
    done = LoadJob(Path("m"), "int8", done=32, total=32, started=0.0)
    assert model_formats.load_progress(done, 75.4) == (
        1.0, "Made the 8-bit (int8) copy of m's experts (32 experts); finishing the load… 75 s"
    )  # fmt: skip
    assert status.startswith("Loaded mixtral") and "experts in 4-bit (nf4)" in status and bar == ""
    assert ui_session.runtime.info.expert_format == "nf4" and ui_session.store.settings.load().expert_format == "nf4"


def test_load_refusals_and_failures_are_sentences_and_load_nothing(ui_session, tmp_path):
    assert list(load_steps(ui_session, "", "nf4")) == [("⚠️ Pick a downloaded model or type a folder first.", "")]
    said = list(load_steps(ui_session, str(demo_model_dir()), "fp8"))
    assert said[-1][0].startswith("⚠️ Unknown expert format 'fp8'. Choose auto") and ui_session.runtime is None
    *_, (status, _) = load_steps(ui_session, str(tmp_path), "int8")
    assert status.startswith("⚠️") and "is not a model folder (no config.json)" in status and ui_session.runtime is None


def test_a_failed_load_leaves_the_format_the_next_start_up_loads_other_models_in(ui_session, tiny_model_dir, tmp_path):
    chosen, unchosen = tiny_model_dir("mixtral"), tiny_model_dir("mixtral", seed=1)  # the second has no own choice
    *_, (status, _) = load_steps(ui_session, str(chosen), "bf16")
    assert status.startswith("Loaded") and ui_session.store.settings.load().expert_format == "bf16"
    dense = tmp_path / "acme--not-moe"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 100}))
    *_, (status, _) = load_steps(ui_session, str(dense), "nf4")
    assert status.startswith("⚠️ Could not load acme--not-moe")
    saved = ui_session.store.settings.load()
    assert saved.expert_format == "bf16" and saved.last_model == str(chosen)
    assert ui_session.store.settings.model_format(str(dense)) == "nf4"  # kept for that folder's next Load
    for model in (chosen, unchosen):  # what the next start-up (or `fmoe-local --model`) does
        ui_session.unload()
        job = ui_session.start_load(model)
        assert job.finished.wait(120) and job.error == "" and job.expert_format == "bf16"
        assert ui_session.runtime.info.expert_format == "bf16"


def test_download_refusals_are_sentences_under_the_button_not_red_pills(ui_session, monkeypatch):
    demo = build(ui_session)
    start = next(f for f in demo.fns.values() if f.name == "start").fn  # the Download button's handler
    (progress, _), *more = list(start("not a repo", ""))
    assert not more and "⚠️ Type a Hugging Face repo id like owner/name" in progress and "progress-inner" not in progress
    full_disk = Machine("cuda", "RTX 4070", 12 * GB, 11 * GB, 64 * GB, 60 * GB, 20 * GB)
    monkeypatch.setattr("ui.session.probe", lambda _, verdicts=None: full_disk)  # the download re-checks the disk
    [(progress, _)] = list(start(MIXTRAL.repo_id, ""))
    assert "⚠️ Not enough disk space: Mixtral 8x7B Instruct needs 93.4 GB and 20.0 GB is free." in progress
    assert ui_session.download is None  # nothing started
    api = next(f for f in demo.fns.values() if f.api_name == "download").fn  # scripts still hear an error
    with pytest.raises(gr.Error, match="owner/name"):
        next(api("not a repo", ""))


class _StartedDownload:
    """Stands in for ui.downloads.Download: records that the download started, without a child process."""

    def __init__(self, repo_id, models_dir, allow, ignore, token=None, endpoint=None):
        from ui.downloads import DownloadStatus

        self.repo_id = repo_id
        self.dest = Path(models_dir) / repo_id.replace("/", "--")
        self._status = DownloadStatus("error", 0, 0, "stub")

    def status(self):
        return self._status

    def cancel(self):
        pass


def test_resuming_a_mostly_downloaded_model_needs_room_only_for_the_rest(ui_session, monkeypatch):
    dest = ui_session.models_dir / MIXTRAL.local_name
    dest.mkdir(parents=True)
    for i in range(1, 19):  # 18 of 19 shards finished before a cancel or a crash (sparse: sizes without writing)
        with open(dest / f"model-{i:05d}-of-00019.safetensors", "wb") as f:
            f.truncate(4_900_000_000)
    twenty_free = Machine("cuda", "RTX 4070", 12 * GB, 11 * GB, 64 * GB, 60 * GB, 20 * GB)
    monkeypatch.setattr("ui.session.probe", lambda _, verdicts=None: twenty_free)
    monkeypatch.setattr("ui.model_downloads.Download", _StartedDownload)
    start = next(f for f in build(ui_session).fns.values() if f.name == "start").fn
    progress = [p for p, _ in start(MIXTRAL.repo_id, "")]
    # before: refused, "needs 93.4 GB and 20.0 GB is free", though only the last 5 GB shard was left to fetch
    assert "Not enough disk space" not in progress[0] and isinstance(ui_session.download, _StartedDownload)
    for i in range(1, 19):
        (dest / f"model-{i:05d}-of-00019.safetensors").unlink()
    with open(dest / "model-00001-of-00019.safetensors", "wb") as f:
        f.truncate(4_900_000_000)
    ui_session.download = None
    [(progress, _)] = list(start(MIXTRAL.repo_id, ""))  # what is left still has to fit
    assert (
        "⚠️ Not enough disk space: Mixtral 8x7B Instruct needs 88.5 GB more (4.9 GB is already downloaded)" in progress
    )


def test_an_interrupted_download_is_listed_as_incomplete_and_delete_removes_it(ui_session, monkeypatch):
    left = ui_session.models_dir / "acme--tiny"
    left.mkdir(parents=True)
    with open(left / "model-00001-of-00002.safetensors", "wb") as f:
        f.truncate(300_000_000)  # a shard finished before the cancel or the crash
    write_marker(left, {"repo_id": "acme/tiny"}, STARTED_MARKER)  # what the download wrote when it started
    incomplete = ("acme/tiny (incomplete download, 300 MB: Download resumes it)", str(left))  # not "0.3 GB"
    assert downloaded_choices(ui_session)[0] == incomplete
    demo = build(ui_session)
    monkeypatch.setattr(
        "ui.model_downloads.Download", _StartedDownload
    )  # a download that ends at once without finishing
    *_, (_, listed) = next(f for f in demo.fns.values() if f.name == "start").fn("acme/tiny", "")
    assert incomplete in listed.choices  # the Download button's end refreshes "Your models"
    delete = next(f for f in demo.fns.values() if f.api_name == "delete_model").fn
    ui_session.download = _StartedDownload("acme/tiny", ui_session.models_dir, [], [])
    ui_session.download._status = DownloadStatus("downloading", 1, 2)  # while it still downloads: refused
    status, _ = delete(str(left))
    assert status == "⚠️ acme--tiny is still downloading. Cancel the download first, then delete it." and left.is_dir()
    ui_session.download._status = DownloadStatus("cancelled", 1, 2)
    status, _ = delete(str(left))
    # before: "acme--tiny was not downloaded by this app, so it is not deleted here."
    assert status == "Deleted acme--tiny." and not left.exists()


def test_delete_is_refused_while_that_model_is_loading(ui_session, tiny_model_dir, monkeypatch):
    mine = ui_session.models_dir / "acme--tiny"
    shutil.copytree(tiny_model_dir("mixtral"), mine)
    write_marker(mine, {"repo_id": "acme/tiny"})
    ui_session.store.settings.set(**ui_session.store.settings.format_choice(str(mine), "int8"))
    real_write, release, holding = QuantCache._write, threading.Event(), threading.Event()

    def held(self, layer, tensors):
        holding.set()
        release.wait(30)  # the first int8 load is making its copy (minutes on a real model)
        real_write(self, layer, tensors)

    monkeypatch.setattr(QuantCache, "_write", held)
    job = ui_session.start_load(mine)  # what app.py does at start-up with the last model
    try:
        assert holding.wait(30)
        delete = next(f for f in build(ui_session).fns.values() if f.api_name == "delete_model").fn
        status, _ = delete(str(mine))
    finally:
        release.set()
        assert job.finished.wait(60)
    # before: deleted under the load, which then failed with "Error while serializing: I/O error: …"
    assert status == (
        "⚠️ acme--tiny is still loading (the page's header says how far). Wait for the load to finish, then delete it."
    )
    assert (mine / "config.json").is_file() and not job.error and ui_session.runtime is not None
    status, _ = delete(str(mine))  # once loaded, Delete unloads and removes it as before
    assert status.startswith("Deleted acme--tiny") and not mine.exists() and ui_session.runtime is None


def test_cancel_with_no_download_running_says_so(ui_session):
    cancel = next(f for f in build(ui_session).fns.values() if f.api_name == "cancel_download").fn
    assert cancel() == "No download is running."
    ui_session.download = _StartedDownload("acme/tiny", ui_session.models_dir, [], [])
    ui_session.download._status = DownloadStatus("done", 2, 2, "Downloaded acme/tiny.")
    assert cancel() == "No download is running."  # before: "" (as if it had stopped one)


def test_the_models_tab_deletes_quantised_copies_but_the_loaded_model_s(ui_session, tiny_model_dir):
    from fmoe_local.quant_cache import copies

    root = ui_session.config.quant_cache_dir
    assert model_formats.copies_line(ui_session) == ""  # none yet: no line, no button
    for model in (tiny_model_dir("mixtral"), tiny_model_dir("olmoe")):
        ui_session.store.settings.set(**ui_session.store.settings.format_choice(str(model), "nf4"))
        ui_session.load(model)  # olmoe stays loaded
    assert model_formats.copies_line(ui_session).startswith("**Quantised copies:**") and len(copies(root)) == 2
    said = model_formats.delete_copies(ui_session)
    assert said.startswith("Deleted the quantised copies:") and said.endswith("The loaded model's own copy is kept.")
    assert len(copies(root)) == 1 and ui_session.runtime.generate([{"role": "user", "content": "hi"}]).reason != "error"
    ui_session.loading = LoadJob(tiny_model_dir("mixtral"), "nf4")  # a load under way may be writing a copy
    assert model_formats.delete_copies(ui_session).startswith("⚠️ A model is loading")
    ui_session.loading.finished.set()
