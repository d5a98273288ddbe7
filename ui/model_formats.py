"""What the Models tab says about expert formats: each catalog model's per-format cells and detail table, the
format choice with its honest label, the sentence under that choice, the progress line of a loading model, and the
quantised copies on disk (how much they take; deleting those the loaded model does not read).

Scope: text. Sizes, verdicts and the recommended format are fmoe_local.hardware's (`format_fits`, `instead`); the
labels are fmoe_local.expert_formats'. It does NOT compute a size, decide a verdict or load anything.
"""

from __future__ import annotations

from pathlib import Path

from fmoe_local.catalog import CatalogEntry, find
from fmoe_local.config import EXPERT_FORMATS, RuntimeConfig
from fmoe_local.expert_formats import LABELS
from fmoe_local.hardware import FormatFit, format_fits, instead
from fmoe_local.quant_cache import copies_bytes, remove_other_copies
from fmoe_local.units import size_auto
from ui.downloads import list_downloaded
from ui.load_job import LoadJob
from ui.render import literal
from ui.session import Session, format_name, model_label
from ui.sizes import table_gb

FORMAT_HEADERS = ["bf16 experts", "8-bit experts", "4-bit experts"]


# Auto's label says what it keeps in brackets, too long for a choice (the Settings dropdown cut it off): the choice
# says the short part and the control's help line the rest.
AUTO_SHORT, _, _kept = LABELS["auto"].partition(" (")
AUTO_HELP = f"Auto keeps the checkpoint's own form: {_kept.rstrip(')')}."


def label(fmt: str) -> str:
    """A format's label in a choice: what it costs in answers (Auto: the short half, AUTO_HELP the rest)."""
    return AUTO_SHORT if fmt == "auto" else LABELS[fmt]


def choices() -> list[tuple[str, str]]:
    """The Radio's and the Dropdown's choices: every format a user can pick, each with what it costs in answers."""
    return [(label(f), f) for f in EXPERT_FORMATS]


def answers(fmt: str) -> str:
    """The part of a format's label that says what happens to the answers ("~4× smaller, slightly different...")."""
    return LABELS[fmt].split(": ", 1)[-1]


def _gb(n: int) -> str:
    return table_gb(n)


def cell(f: FormatFit) -> str:
    own = "MXFP4 (as released): " if f.fmt == "mxfp4" else ""
    return f"{own}{f.verdict.label} · {_gb(f.ram_bytes)}" + (" · recommended" if f.recommended else "")


def format_cells(fits: list[FormatFit]) -> list[str]:
    """The catalog row's cells under FORMAT_HEADERS; a download that is already 4-bit shows its own 4-bit form, else
    the 4-bit cell is the recommended one of int4 and nf4, or int4 (the same size, faster on a CPU)."""
    by = {f.fmt: f for f in fits}
    four = [by[f] for f in ("mxfp4", "int4", "nf4") if f in by]
    return [cell(by["bf16"]), cell(by["int8"]), cell(next((f for f in four if f.recommended), four[0]))]


def detail(entry: CatalogEntry, fits: list[FormatFit]) -> str:
    """The picked model's table: per format what the answers are, disk, RAM, GPU and the verdict's reasons."""
    best = next((f for f in fits if f.recommended), None)
    headline = (
        f"recommended here: **{format_name(best.fmt)}** ({answers(best.fmt)})."
        if best is not None
        else f"no expert format fits on this computer. {fits[0].verdict.reasons[0]}"
    )
    rows = [
        f"**{entry.name}** — {headline}",
        "",
        "| Expert format | Answers | Disk | RAM | GPU | On this computer |",
        "|---|---|---|---|---|---|",
    ]
    for f in fits:
        name = f"**{format_name(f.fmt)}** (recommended)" if f.recommended else format_name(f.fmt)
        gpu = _gb(f.gpu_bytes) if f.gpu_bytes else "—"
        reasons = " ".join(f.verdict.reasons)
        rows.append(f"| {name} | {answers(f.fmt)} | {_gb(f.disk_bytes)} | {_gb(f.ram_bytes)} | {gpu} | {reasons} |")
    rows.append("")
    if entry.native_format == "bf16":
        rows.append(
            "Disk is the download plus, for 8-bit and 4-bit, the copy made from it on the first load (its progress "
            "is shown; it is kept and reused). The catalog lists no ready-made 8-bit or 4-bit download of this model."
        )
    else:
        rows.append(f"The download is already {format_name(entry.native_format)}: Auto keeps it as released.")
    if entry.note:
        rows.append(f"_{entry.note}_")
    return "\n".join(rows)


def entry_of(session: Session, folder: str | None) -> tuple[CatalogEntry | None, bool]:
    """(the catalog model in this folder, whether it is a finished download): (None, False) for any other folder."""
    downloaded = {str(m.path): m.repo_id for m in list_downloaded(session.models_dir)}
    entry = find(downloaded[folder]) if folder in downloaded else None
    return entry, entry is not None


def own_format(session: Session, folder: str) -> str | None:
    """The format the model in `folder` brings: the user's own choice for it, else the one recommended for a catalog
    model on this machine; None for a folder with neither."""
    chosen = session.store.settings.model_format(folder)
    if chosen is not None:
        return chosen
    entry, downloaded = entry_of(session, folder)
    if entry is not None:
        return next((f.choice for f in format_fits(entry, session.machine(), downloaded) if f.recommended), None)
    return None


def format_for(session: Session, folder: str | None) -> str:
    """The format Load offers for the model in `folder`: its own (`own_format`), else the app's default. Load
    settings belong to the model, not the last load."""
    if not folder:
        return session.store.settings.load().expert_format
    return own_format(session, folder) or RuntimeConfig.expert_format


def choice_note(session: Session, choice: str, folder: str | None) -> str:
    """The sentence under the format choice, naming the model it is for (the one picked under "Your models"): the
    format that works instead when this one does not fit, or what the first load costs when it makes a copy."""
    if not folder:
        return "Pick a model under Your models: each model keeps its own expert format."
    if choice not in EXPERT_FORMATS:
        return ""
    entry, downloaded = entry_of(session, folder)
    if entry is None:
        return f"For {literal(model_label(Path(folder)))}: Load uses {format_name(choice)}."
    fits = format_fits(entry, session.machine(), downloaded)
    sentence = instead(fits, choice)
    if sentence:
        return f"⚠️ {entry.name}: {sentence}"
    chosen = next((f for f in fits if f.choice == choice), fits[0])
    copy = chosen.disk_bytes - entry.download_bytes
    if copy:
        return (
            f"The first load of {entry.name} in {format_name(chosen.fmt)} makes a copy of its experts "
            f"({_gb(copy)} on disk; minutes, with progress shown); later loads reuse it."
        )
    return f"For {entry.name}: Load uses {format_name(chosen.fmt)}" + (
        " (recommended here)." if chosen.recommended else "."
    )


def load_progress(job: LoadJob, now: float) -> tuple[float, str]:
    """(fraction, sentence) of a loading model, for the bar under Load: never a silent wait."""
    name = model_label(job.model_dir)
    if (earlier := job.waiting) is not None:  # a load the user replaced stops at its next expert, then this starts
        return 0.0, f"Waiting for the load of {model_label(earlier.model_dir)} to stop… {now - job.started:.0f} s"
    if job.total and job.done == job.total:
        # The last layer is written and the rest of the load (miss costs) follows: tens of seconds, so it still moves.
        return 1.0, (
            f"Made the {format_name(job.expert_format)} copy of {name}'s experts ({job.total} experts); finishing the "
            f"load… {now - job.started:.0f} s"
        )
    if job.total:
        return job.done / job.total, (
            f"Making the {format_name(job.expert_format)} copy of {name}'s experts: {job.done} of {job.total} experts. "
            "Only the first load in this format does this; the copy is kept for the next."
        )
    return 0.0, f"Loading {name} with expert format {format_name(job.expert_format)}… {now - job.started:.0f} s"


def copies_line(session: Session) -> str:
    """How much disk the 8-bit and 4-bit copies of experts take ("" when there are none)."""
    size = copies_bytes(session.config.quant_cache_dir)
    if not size:
        return ""
    return (
        f"**Quantised copies:** {size_auto(size)} of 8-bit and 4-bit experts, made at each model's first load in "
        "that format. Deleting them frees the space; a model makes its copy again at its next load in that format."
    )


def delete_copies(session: Session) -> str:
    """The Delete copies button: every copy but the loaded model's (it reads its own), refused while a load runs."""
    if session.still_loading:
        return "⚠️ A model is loading (it may be making its copy): wait for it to finish, then delete the copies."
    freed = remove_other_copies(session.config.quant_cache_dir, session.model_dir)
    kept = " The loaded model's own copy is kept." if copies_bytes(session.config.quant_cache_dir) else ""
    return f"Deleted the quantised copies: {size_auto(freed)} freed.{kept}"
