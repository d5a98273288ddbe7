"""Every open page follows the running download: a page reloaded (or opened) while a model downloads shows its
progress and then its end, with "Your models" refreshed — it used to show nothing and Download said only "already
running"; a page's own lines (a refusal) are left alone when no download runs."""

from __future__ import annotations

from pathlib import Path

from ui.downloads import DownloadStatus
from ui.model_downloads import follow_download, progress_html, refusal_html


class _Download:
    repo_id = "acme/tiny-moe"
    dest = Path("/models/acme--tiny-moe")

    def __init__(self) -> None:
        self.now = DownloadStatus("downloading", 1_000_000_000, 4_000_000_000)

    def status(self) -> DownloadStatus:
        return self.now

    def cancel(self) -> None:  # the session cancels a running download when it closes
        self.now = DownloadStatus("cancelled", 0, 0, "cancelled")


class _Session:
    download = None


def test_a_reloaded_page_follows_the_running_download_to_its_end():
    session, d = _Session(), _Download()
    assert follow_download(session, "") == (None, False)  # nothing runs: the line is left as it is
    session.download = d
    line, ended = follow_download(session, "")  # a fresh page: its line was empty
    assert "Downloading acme/tiny-moe: 1.00 of 4.00 GB" in line and not ended
    assert follow_download(session, line) == (None, False)  # unchanged: nothing sent
    d.now = DownloadStatus("done", 4_000_000_000, 4_000_000_000, "Downloaded acme/tiny-moe (4.0 GB).")
    line, ended = follow_download(session, line)
    assert line == progress_html(1.0, "Downloaded acme/tiny-moe (4.0 GB).") and ended  # "Your models" refreshed
    assert follow_download(session, line) == (None, False)  # said once


def test_a_page_s_own_line_is_left_alone_once_the_download_ended():
    session, d = _Session(), _Download()
    d.now = DownloadStatus("cancelled", 0, 4_000_000_000, "Download cancelled; finished files are kept.")
    session.download = d
    refused = refusal_html("A download is already running. Cancel it or wait for it to finish.")
    assert follow_download(session, refused) == (None, False)


def test_the_models_tab_follows_the_download_on_a_timer(ui_session):
    from ui import build

    follow = next(f for f in build(ui_session).fns.values() if f.name == "follow_line").fn
    ui_session.download = _Download()
    line, downloaded = follow("")
    assert "Downloading acme/tiny-moe" in line
