"""The Models tab's downloads: starting one (the repo id and the disk checked first), its progress line, and every
open page following the one that runs.

Scope: the steps the Download button's event and the scripts' endpoint walk through, and the line they show. It
does NOT run the download (ui.downloads: a child process) or build components (ui.models).
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterator
from pathlib import Path

from fmoe_local.catalog import DEFAULT_ALLOW, DEFAULT_IGNORE, find, local_name
from fmoe_local.units import in_one_unit, number, size, unit_for
from ui.downloads import Download, folder_bytes
from ui.session import Session

POLL_S = 0.5
RUNNING = ("planning", "downloading")  # DownloadStatus states of a download still under way


def progress_html(fraction: float, text: str) -> str:
    pct = max(0.0, min(1.0, fraction)) * 100
    return (
        f"<div class='progress-outer'><div class='progress-inner' style='width:{pct:.1f}%'></div></div>"
        f"<div id='download-text'>{html.escape(text)}</div>"
    )


def downloading_dir(session: Session) -> Path | None:
    """The folder a download still running writes into, resolved; None when none runs."""
    d = session.download
    if d is None or d.status().state not in RUNNING:
        return None
    return Path(d.dest).resolve()


def refusal_html(sentence: str) -> str:
    """A download that cannot start: the sentence where the progress would be, no bar."""
    return f"<div id='download-text'>⚠️ {html.escape(sentence)}</div>"


class DownloadRefused(ValueError):
    """A download that cannot start; the message is a sentence that says what to do instead."""


def download_steps(session: Session, repo_id: str, token: str) -> Iterator[tuple[float, str, Path | None]]:
    """Start a download and yield (fraction, sentence, folder once done) until it ends. Raises DownloadRefused before
    anything starts when the repo id is not one, a download is running or the disk cannot hold the model."""
    repo_id = (repo_id or "").strip()
    if repo_id.count("/") != 1 or " " in repo_id:
        raise DownloadRefused("Type a Hugging Face repo id like owner/name, or click a model in the list.")
    if downloading_dir(session) is not None:
        raise DownloadRefused("A download is already running. Cancel it or wait for it to finish.")
    entry = find(repo_id)
    allow = list(entry.allow_patterns if entry else DEFAULT_ALLOW)
    ignore = list(entry.ignore_patterns if entry else DEFAULT_IGNORE)
    if entry is not None:
        # An interrupted download resumes: the files it finished are kept, so only the rest needs room.
        dest = session.models_dir / local_name(repo_id)
        have = folder_bytes(dest) if dest.is_dir() else 0
        needed = max(0, entry.download_bytes - have)
        free = session.machine(refresh=True).disk_free
        if needed > free:
            needed_text, have_text, free_text = in_one_unit(needed, have, free, decimals=1)
            more = f" more ({have_text} is already downloaded)" if have else ""
            raise DownloadRefused(
                f"Not enough disk space: {entry.name} needs {needed_text}{more} and "
                f"{free_text} is free. Free up space or choose a smaller model."
            )
    d = Download(repo_id, session.models_dir, allow, ignore, token=token or None, endpoint=session.endpoint)
    session.download = d
    yield 0.0, f"Looking up {repo_id}…", None
    while True:
        fraction, text, state = download_progress(d)
        if state in RUNNING:
            yield fraction, text, None
            time.sleep(POLL_S)
            continue
        yield fraction, text, (d.dest if state == "done" else None)
        return


def download_progress(d: Download) -> tuple[float, str, str]:
    """(fraction, sentence, state) of a download, from one status read."""
    s = d.status()
    if s.state in RUNNING:
        text = "Planning…"
        if s.total_bytes:
            unit = unit_for(s.total_bytes)  # a tiny model's download in MB, not "0.00 of 0.01 GB"
            text = f"{number(s.done_bytes / unit.bytes, 2)} of {size(s.total_bytes, unit, 2)}"
        return s.fraction, f"Downloading {d.repo_id}: {text}", s.state
    return (1.0 if s.state == "done" else s.fraction), s.message, s.state


def follow_download(session: Session, shown: str) -> tuple[str | None, bool]:
    """What a page's progress line should show now (None: leave it), and whether "Your models" changed. Every open
    page follows the running download, a reloaded one included (its Download button's loop is gone with the old
    page); a page that showed it running gets its end once, then its own lines (refusals) are left alone."""
    d = session.download
    if d is None:
        return None, False
    fraction, text, state = download_progress(d)
    line = progress_html(fraction, text)
    if state in RUNNING:
        return (None if line == shown else line), False
    if f"Downloading {html.escape(d.repo_id)}:" in (shown or ""):  # it ended since this page last looked
        return line, True
    return None, False
