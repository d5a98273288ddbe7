"""Models tab: the download wizard (curated list with each expert format's size and fit verdict for this machine,
one recommended, or any HF repo id), downloaded models (load in a chosen expert format, with progress; delete) and
loading a model folder from disk.

Scope: components and events. Fit arithmetic is fmoe_local.hardware, the facts fmoe_local.catalog, the format texts
ui.model_formats, its download steps and line ui.model_downloads, the download itself ui.downloads. It does NOT touch the runtime beyond Session.start_load/unload.
A refusal or a failure is a sentence in the status line under the buttons (a gr.Error's red pill covers the page);
the scripts' endpoints (gr.api) raise instead, so a client sees an error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from fmoe_local.catalog import CATALOG
from fmoe_local.hardware import format_fits
from fmoe_local.quant_cache import remove_copies
from fmoe_local.units import size, size_auto, unit_for
from ui import model_formats, page_header, sizes
from ui.downloads import check_deletable, delete_downloaded, list_downloaded, list_incomplete
from ui.load_job import ModelLoadError
from ui.model_downloads import (
    DownloadRefused,
    download_steps,
    downloading_dir,
    follow_download,
    progress_html,
    refusal_html,
)
from ui.render import literal
from ui.session import DEMO_LABEL, Session, demo_dir

POLL_S = 0.5  # how often Load's progress bar is redrawn
DOWNLOAD_REFRESH_S = 2.0  # how often every open page's progress line follows the running download
HEADERS = ["Model", "Repo id", "Params (total / active)", "Experts × layers", "Download", *model_formats.FORMAT_HEADERS]


@dataclass
class ModelsTab:
    machine: gr.Markdown
    refresh_machine: gr.Button
    catalog: gr.Dataframe
    fit_detail: gr.Markdown
    repo_id: gr.Textbox
    token: gr.Textbox
    download: gr.Button
    cancel: gr.Button
    progress: gr.HTML
    downloaded: gr.Dropdown
    expert_format: gr.Radio
    format_note: gr.Markdown
    load: gr.Button
    delete: gr.Button
    folder: gr.Textbox
    load_folder: gr.Button
    status: gr.Markdown
    load_progress: gr.HTML
    format_target: gr.State  # the folder the format choice and its note are for: the model picked or typed last
    stop_load: gr.Button
    copies: gr.Markdown
    delete_copies: gr.Button


def catalog_rows(session: Session) -> list[list[str]]:
    machine = session.machine()
    have = {m.repo_id for m in list_downloaded(session.models_dir)}
    rows = []
    for e in CATALOG:
        fits = format_fits(e, machine, downloaded=e.repo_id in have)
        rows.append(
            [
                e.name,
                e.repo_id,
                f"{e.total_params_b:g}B / {e.active_params_b:g}B",
                f"{e.num_experts} × {e.num_layers} (top-{e.top_k})",
                sizes.table_gb(e.download_bytes),
                *model_formats.format_cells(fits),
            ]
        )
    return rows


def downloaded_choices(session: Session) -> list[tuple[str, str]]:
    """Downloaded models, then the ones whose download did not finish (they take disk: Download resumes them, Delete
    removes them), then the built-in demo, so it can be chosen again after another model was loaded."""
    demo = demo_dir()
    finished, incomplete = list_downloaded(session.models_dir), list_incomplete(session.models_dir)
    unit = unit_for(max((m.size_bytes for m in finished + incomplete), default=0))  # one unit for the whole list

    def gb(n: int) -> str:
        return size(n, unit)

    done = [(f"{m.repo_id} ({gb(m.size_bytes)})", str(m.path)) for m in finished]
    running = downloading_dir(session)
    unfinished = [
        (
            f"{m.repo_id} (downloading, {gb(m.size_bytes)} so far)"
            if running == m.path.resolve()
            else f"{m.repo_id} (incomplete download, {gb(m.size_bytes)}: Download resumes it)",
            str(m.path),
        )
        for m in incomplete
    ]
    return done + unfinished + ([(DEMO_LABEL, str(demo))] if demo is not None else [])


def build(session: Session) -> ModelsTab:
    with gr.Row():
        machine = gr.Markdown("", elem_id="machine")
        refresh_machine = gr.Button("Re-check this computer", size="sm", scale=0)
    gr.Markdown("### Download a model\nPick one from the list (click a row) or type any Hugging Face repo id.")
    catalog = gr.Dataframe(
        headers=HEADERS,
        value=[],
        interactive=False,
        wrap=True,
        elem_id="catalog",
        column_widths=["13%", "19%", "10%", "11%", "7%", "13%", "13%", "14%"],
    )
    fit_detail = gr.Markdown("", elem_id="fit-detail")
    with gr.Row():
        repo_id = gr.Textbox(label="Repo id", placeholder="owner/name", scale=3, elem_id="repo-id")
        token = gr.Textbox(label="Access token (only for gated or private models)", type="password", scale=2)
    with gr.Row():
        download = gr.Button("Download", variant="primary", elem_id="download")
        cancel = gr.Button("Cancel download", variant="stop", elem_id="cancel-download")
    progress = gr.HTML("", elem_id="download-progress")
    gr.Markdown("### Your models")
    with gr.Row():
        # Custom values allowed because the list changes while the page is open (a download finishes, an API
        # client loads by folder); load and delete check the folder themselves.
        downloaded = gr.Dropdown(
            choices=[], label="Downloaded models", scale=3, elem_id="downloaded", allow_custom_value=True
        )
        load = gr.Button("Load", variant="primary", scale=0, elem_id="load-model")
        delete = gr.Button("Delete", variant="stop", scale=0, elem_id="delete-model")
    with gr.Row():
        folder = gr.Textbox(label="…or load a model folder from disk", placeholder="/path/to/checkpoint", scale=3)
        load_folder = gr.Button("Load folder", scale=0, elem_id="load-folder")
    with gr.Row():
        copies = gr.Markdown("", elem_id="quant-copies")
        delete_copies = gr.Button("Delete copies", size="sm", scale=0, visible=False, elem_id="delete-copies")
    expert_format = gr.Radio(
        model_formats.choices(),
        value=session.store.settings.load().expert_format,
        label="Expert format of the model picked above (used by Load; each model keeps its own)",
        info=f"Smaller formats hold more experts in RAM and on the GPU, and answer slightly differently. {model_formats.AUTO_HELP}",
        elem_id="load-format",
    )
    format_note = gr.Markdown("", elem_id="format-note")
    status = gr.Markdown("", elem_id="models-status")
    load_progress = gr.HTML("", elem_id="load-progress")
    stop_load = gr.Button("Stop loading", variant="stop", size="sm", elem_id="stop-load")
    return ModelsTab(
        machine, refresh_machine, catalog, fit_detail, repo_id, token, download, cancel, progress, downloaded,
        expert_format, format_note, load, delete, folder, load_folder, status, load_progress, gr.State(None),
        stop_load, copies, delete_copies,
    )  # fmt: skip


def load_steps(session: Session, path: str | None, fmt: str | None) -> Iterator[tuple[str, str]]:
    """The Load button: saves the chosen expert format as the model's own, loads on a thread and yields (status, progress bar) until
    it is done — the bar says how far a first int8/nf4 load's copy got, else how long it has been loading."""
    if not path:
        yield "⚠️ Pick a downloaded model or type a folder first.", ""
        return
    try:
        session.choose_format(path, fmt or model_formats.format_for(session, path))
    except ValueError as exc:
        yield f"⚠️ {literal(exc)}", ""
        return
    job = session.start_load(path)
    yield "", progress_html(*model_formats.load_progress(job, time.monotonic()))  # at once: the header says it too
    while not job.finished.wait(POLL_S):
        yield "", progress_html(*model_formats.load_progress(job, time.monotonic()))
    # Both name the folder and may quote an exception: shown as text.
    yield (f"⚠️ {literal(job.error)}" if job.error else literal(job.message)), ""


class ModelsHandlers:
    """The Models tab's event handlers and its scripts' endpoints, one method per event, each taking the event's
    inputs in the order `wire` connects them."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def machine_md(self, remeasure: bool = False) -> str:
        return f"**This computer:** {literal(self.session.machine(remeasure=remeasure).summary())}"

    def on_load(self) -> tuple:
        """The page's load. The loaded model is preselected, so "Your models" shows what is running."""
        session = self.session
        loaded = session.model_dir.resolve() if session.model_dir is not None else None
        choices = downloaded_choices(session)
        value = next((path for _, path in choices if Path(path).resolve() == loaded), None)
        fmt = model_formats.format_for(session, value)
        return self.machine_md(), catalog_rows(session), gr.Dropdown(choices=choices, value=value), fmt, *self.copies()

    def copies(self) -> tuple:
        line = model_formats.copies_line(self.session)
        return line, gr.Button(visible=bool(line))

    def recheck(self) -> tuple:
        return self.machine_md(remeasure=True), catalog_rows(self.session)

    def pick(self, evt: gr.SelectData) -> tuple:
        """The wizard's row: its repo id and table per format. The format choice stays with the model picked for
        Load (a row is a model to download; it used to switch the choice another model's Load then took)."""
        row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        entry = CATALOG[row]
        have = {m.repo_id for m in list_downloaded(self.session.models_dir)}
        fits = format_fits(entry, self.session.machine(), downloaded=entry.repo_id in have)
        return entry.repo_id, model_formats.detail(entry, fits)

    def follow(self, folder) -> tuple:  # noqa: ANN001
        """The model picked for Load, in the list or typed as a folder, brings its own format (its last choice, else
        its recommendation), and the note names that model."""
        folder = (folder or "").strip() or None
        fmt = model_formats.format_for(self.session, folder)
        return fmt, model_formats.choice_note(self.session, fmt, folder), folder

    def follow_typed(self, typed, picked, current) -> tuple:  # noqa: ANN001
        typed = (typed or "").strip()
        if not typed:
            return self.follow(picked)  # an emptied box hands the choice back to the model picked in the list
        # A folder with no format of its own keeps the one chosen now: the user may have picked it for this folder.
        fmt = model_formats.own_format(self.session, typed) or current
        return fmt, model_formats.choice_note(self.session, fmt, typed), typed

    def note(self, choice, folder) -> str:  # noqa: ANN001
        return model_formats.choice_note(self.session, choice, folder)

    def start(self, repo_id, token):  # noqa: ANN001, ANN201 - a generator of (progress line, "Your models")
        """The Download button: a refusal is a sentence in the progress line under it, like every other problem on
        the page."""
        session = self.session
        try:
            for fraction, text, dest in download_steps(session, repo_id, token):
                if dest is None:
                    yield progress_html(fraction, text), gr.skip()
                else:
                    yield (
                        progress_html(1.0, text + " Select it below, choose its expert format and press Load."),
                        gr.Dropdown(choices=downloaded_choices(session), value=str(dest)),
                    )
                    return
        except DownloadRefused as exc:
            yield refusal_html(str(exc)), gr.skip()
            return
        # Cancelled or failed: "Your models" now lists what it left on disk as incomplete.
        yield gr.skip(), gr.Dropdown(choices=downloaded_choices(session))

    def follow_line(self, shown) -> tuple:  # noqa: ANN001
        """The timer's tick: the download's progress line, and "Your models" once it ended."""
        line, ended = follow_download(self.session, shown)
        return (gr.skip() if line is None else line), (
            gr.Dropdown(choices=downloaded_choices(self.session)) if ended else gr.skip()
        )

    def cancel(self) -> str:
        if downloading_dir(self.session) is None:
            return "No download is running."
        self.session.download.cancel()
        return ""  # the progress line under the buttons says it (the download loop sees the cancel)

    def load_ui(self, path, fmt, target):  # noqa: ANN001, ANN201 - a generator of (status, bar, header)
        # The format shown is for the model its note names; the other button loads its model in that one's own.
        same = bool(path) and bool(target) and str(path).strip() == target
        for status, bar in load_steps(self.session, path, fmt if same else ""):
            yield status, bar, page_header.header(self.session)

    def stop_load(self) -> str:
        return literal(self.session.cancel_load())

    def delete_copies(self) -> tuple:
        return model_formats.delete_copies(self.session), *self.copies()

    def delete(self, path) -> tuple:  # noqa: ANN001
        session = self.session
        if not path:
            return "⚠️ Pick a downloaded model to delete.", gr.skip()
        if demo_dir() is not None and Path(path).resolve() == demo_dir():
            return "⚠️ The demo model is part of the app and cannot be deleted.", gr.skip()
        try:
            check_deletable(session.models_dir, Path(path))  # before unloading it: a refusal changes nothing
        except ValueError as exc:
            return f"⚠️ {literal(exc)}", gr.skip()
        job = session.loading
        if job is not None and not job.finished.is_set() and job.model_dir.resolve() == Path(path).resolve():
            # The load reads its files (and writes its quantised copy) for minutes: deleting them under it fails it.
            return (
                f"⚠️ {literal(Path(path).name)} is still loading (the page's header says how far). Wait for the load "
                "to finish, then delete it.",
                gr.skip(),
            )
        if downloading_dir(session) == Path(path).resolve():
            name = literal(Path(path).name)
            return f"⚠️ {name} is still downloading. Cancel the download first, then delete it.", gr.skip()
        if session.model_dir is not None and Path(path).resolve() == session.model_dir.resolve():
            session.unload()
        freed = remove_copies(session.config.quant_cache_dir, Path(path))  # named by its files: before they go
        delete_downloaded(session.models_dir, Path(path))
        also = f" and its quantised copy ({size_auto(freed)})" if freed else ""
        return f"Deleted {literal(Path(path).name)}{also}.", gr.Dropdown(
            choices=downloaded_choices(session), value=None
        )

    # --- endpoints for scripts and tests (gr.api: their signatures and docstrings are the API's) --------------

    def list_models(self) -> list[dict]:
        return [
            # Not "path": gradio_client would take a dict with a "path" key for a file to download.
            {"repo_id": m.repo_id, "folder": str(m.path), "size_bytes": m.size_bytes}
            for m in list_downloaded(self.session.models_dir)
        ]

    def download(self, repo_id: str, token: str = "") -> Iterator[str]:
        """Download a model: yields how far it got, then the outcome's sentence; raises with a sentence when the
        download cannot start (a bad repo id, another download running, not enough disk)."""
        try:
            for _, text, _ in download_steps(self.session, repo_id, token):
                yield text
        except DownloadRefused as exc:
            raise gr.Error(str(exc)) from exc

    def load_model(self, folder: str, expert_format: str = "") -> str:
        """Load a model folder (a downloaded one or any on disk); expert_format: auto, bf16, int8 or nf4 ("" keeps
        the saved one). Returns the sentence the app shows; raises with a sentence when it cannot."""
        if not folder:
            raise gr.Error("Name a downloaded model's folder or another model folder.")
        try:
            if expert_format:
                self.session.choose_format(folder, expert_format)
            return self.session.load(Path(folder))
        except (ModelLoadError, ValueError) as exc:
            raise gr.Error(str(exc)) from exc


def wire(session: Session, tab: ModelsTab, demo: gr.Blocks, top: gr.Markdown) -> list:
    """Attach the events; returns the events after which a model was (un)loaded. `top`: the page's header, which
    Load redraws while it loads (it names the model loading, then the one loaded, or the failure)."""
    h, t = ModelsHandlers(session), tab
    private = dict(api_visibility="private")
    on_page = [t.machine, t.catalog, t.downloaded, t.expert_format, t.copies, t.delete_copies]
    demo.load(h.on_load, None, on_page, **private)
    t.refresh_machine.click(h.recheck, None, [t.machine, t.catalog], **private)
    t.catalog.select(h.pick, None, [t.repo_id, t.fit_detail], **private)
    followed = [t.expert_format, t.format_note, t.format_target]
    t.downloaded.change(h.follow, [t.downloaded], followed, queue=False, **private)
    t.folder.change(h.follow_typed, [t.folder, t.downloaded, t.expert_format], followed, queue=False, **private)
    t.expert_format.change(h.note, [t.expert_format, t.format_target], [t.format_note], queue=False, **private)
    t.download.click(h.start, [t.repo_id, t.token], [t.progress, t.downloaded], **private)
    t.cancel.click(h.cancel, None, [t.status], api_name="cancel_download", concurrency_limit=None)
    outputs, chosen = [t.status, t.load_progress, top], [t.expert_format, t.format_target]
    loaded = t.load.click(h.load_ui, [t.downloaded, *chosen], outputs, concurrency_id="runtime", **private)
    loaded_folder = t.load_folder.click(h.load_ui, [t.folder, *chosen], outputs, concurrency_id="runtime", **private)
    gr.Timer(DOWNLOAD_REFRESH_S).tick(
        h.follow_line, [t.progress], [t.progress, t.downloaded], queue=False, show_progress="hidden", **private
    )
    # Not under a Load making a copy.
    t.delete_copies.click(
        h.delete_copies, None, [t.status, t.copies, t.delete_copies], concurrency_id="runtime", **private
    )
    # Not in the "runtime" queue: it must reach a load that Load's own event is still running.
    t.stop_load.click(h.stop_load, None, [t.status], **private)
    deleted = t.delete.click(
        h.delete, [t.downloaded], [t.status, t.downloaded], api_name="delete_model", concurrency_id="runtime"
    )
    # Invisible endpoints for scripts and tests: the downloaded models as data, and loading one.
    gr.api(h.list_models, api_name="list_models")
    gr.api(h.download, api_name="download")
    gr.api(h.load_model, api_name="load_model", concurrency_id="runtime")
    gr.api(h.load_model, api_name="load_folder", concurrency_id="runtime")
    return [loaded, loaded_folder, deleted]
