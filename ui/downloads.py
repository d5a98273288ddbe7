"""Model downloads for the wizard: a child process runs huggingface_hub, the app watches and can cancel it.

Scope: fetching the files a model needs into `<models_dir>/<owner>--<name>/`, progress, cancel, resume, and
turning Hub failures into sentences. It does NOT judge whether a model fits (fmoe_local.hardware) or load it.

Why a child process: the app runs with HF_HUB_OFFLINE=1 so that nothing talks to the Hub unless the user asked
for a download; the child is the one place where that is lifted. Killing it is a clean cancel.
Resume: within a run, huggingface_hub retries a dropped connection with an HTTP Range request; across runs
(cancel, crash, reboot) finished files are kept and only the missing ones are fetched — huggingface_hub 2.x
deletes a half-written file, so the unit of resume is one file (checkpoint shards are ≤ 5 GB).
Progress is the size of the destination folder against the plan's total, so the child needs no progress pipe.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fmoe_local.units import in_one_unit

COMPLETE_MARKER = ".fmoe-download.json"  # written last: a folder without it is an interrupted download
# Written when the download starts (after its plan succeeded): the folder is the app's own from then on, so an
# interrupted download is listed (as incomplete) and Delete may remove it, while a folder with neither marker is not.
STARTED_MARKER = ".fmoe-download-started.json"
DISK_MARGIN_BYTES = 2_000_000_000


@dataclass(frozen=True)
class LocalModel:
    path: Path
    repo_id: str
    size_bytes: int


@dataclass(frozen=True)
class DownloadStatus:
    state: str  # "planning", "downloading", "done", "error", "cancelled"
    done_bytes: int = 0
    total_bytes: int = 0
    message: str = ""

    @property
    def fraction(self) -> float:
        return min(1.0, self.done_bytes / self.total_bytes) if self.total_bytes else 0.0


def folder_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass  # a file renamed from .incomplete between listing and stat
    return total


def _read_marker(marker: Path) -> dict | None:
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None  # missing or damaged (a damaged completion marker: an interrupted download, which resumes)
    return info if isinstance(info, dict) else None


def _listed(models_dir: Path, complete: bool) -> list[LocalModel]:
    out = []
    if not models_dir.is_dir():
        return out
    for child in models_dir.iterdir():
        done = _read_marker(child / COMPLETE_MARKER)
        marker = child / COMPLETE_MARKER if complete else child / STARTED_MARKER
        info = done if complete else (None if done is not None else _read_marker(marker))
        if info is not None:
            model = LocalModel(child, str(info.get("repo_id", child.name)), folder_bytes(child))
            out.append((marker.stat().st_mtime, model))
    return [m for _, m in sorted(out, key=lambda t: -t[0])]


def list_downloaded(models_dir: Path) -> list[LocalModel]:
    """Completed downloads, newest first. Interrupted ones are left out (list_incomplete)."""
    return _listed(models_dir, complete=True)


def list_incomplete(models_dir: Path) -> list[LocalModel]:
    """Downloads the app started and did not finish (cancelled, failed, or cut by a crash), newest first: they take
    disk, Download resumes them and Delete may remove them."""
    return _listed(models_dir, complete=False)


def check_deletable(models_dir: Path, path: Path) -> Path:
    """The folder to delete, resolved; a sentence (ValueError) for one the app did not download: only our own
    downloads are ours to delete (a folder of the user's that happens to sit in the models folder is not)."""
    path = Path(path).resolve()
    if path.parent != Path(models_dir).resolve():
        raise ValueError("Only models inside the app's models folder can be deleted here.")
    if not ((path / COMPLETE_MARKER).is_file() or (path / STARTED_MARKER).is_file()):
        raise ValueError(
            f"{path.name} was not downloaded by this app, so it is not deleted here. Delete it in your file manager "
            "if you no longer want it."
        )
    return path


def delete_downloaded(models_dir: Path, path: Path) -> None:
    """Remove a model folder the app downloaded; refuses any other folder with a sentence (check_deletable)."""
    shutil.rmtree(check_deletable(models_dir, path))


def _causes(error: BaseException) -> list[BaseException]:
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def explain(error: BaseException) -> tuple[str, str]:
    """(kind, sentence) for a Hub failure: offline, gated, auth, not_found, busy (429 or 5xx), or other.

    huggingface_hub often wraps the real cause (a dry run turns a 403 into DryRunError), so the whole
    cause chain is searched, most specific first.
    """
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    chain = _causes(error)
    if any(isinstance(e, GatedRepoError) for e in chain):
        return "gated", (
            "This model needs its licence accepted on huggingface.co first. Open the model's page, accept the "
            "terms, then paste an access token (huggingface.co/settings/tokens) and try again."
        )
    if any(isinstance(e, RepositoryNotFoundError) for e in chain):
        return "not_found", (
            "No such model on huggingface.co (or it is private). Check the repo id (owner/name); for a private "
            "model, paste an access token."
        )
    for e in chain:
        if isinstance(e, HfHubHTTPError) and e.response is not None and e.response.status_code == 401:
            return "auth", "huggingface.co refused the request. Paste a valid access token and try again."
    # It answered, so the computer is online (a dry run wraps any answer in DryRunError, the offline case's type).
    for e in chain:
        code = e.response.status_code if isinstance(e, HfHubHTTPError) and e.response is not None else 0
        if code == 429:
            return "busy", (
                "huggingface.co is limiting downloads from this computer just now (HTTP 429). Wait a few minutes, "
                "or paste an access token (signed-in downloads get more), and press Download again; finished "
                "files are kept."
            )
        if code >= 500:
            return "busy", (
                f"huggingface.co answered with a server error (HTTP {code}): it may be busy or down. Wait a few "
                "minutes and press Download again; finished files are kept."
            )
    if any(any(w in type(e).__name__ for w in ("Connect", "Timeout", "DryRun", "LocalEntry")) for e in chain):
        return "offline", (
            "Cannot reach huggingface.co: this computer looks offline. Connect to the internet and press "
            "Download again; finished files are kept and the download resumes."
        )
    detail = str(error).strip().rstrip(".") or type(error).__name__
    return "other", f"The download failed: {detail}. Press Download to retry; finished files are kept."


def disk_full(error: BaseException, dest: Path, total: int) -> str | None:
    """The sentence for a download the disk filled up under (another program took the space after the pre-check),
    with how much to free; None for any other failure. What is left is the plan's total less what is on disk:
    huggingface_hub deletes the half-written file, so what stays is whole files."""
    if not any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _causes(error)):
        return None
    left = max(0, total - (folder_bytes(dest) if dest.is_dir() else 0))
    try:
        free = shutil.disk_usage(dest.parent).free
    except OSError:
        free = 0  # the models folder could not be made: a full disk has none to give
    need = left + DISK_MARGIN_BYTES - free
    left_text, free_text, need_text = in_one_unit(left, free, need, decimals=1)
    free_up = f"Free up at least {need_text}" if need > 0 else "Free up some space"
    return (
        f"The disk is full: about {left_text} of this model is still to download and {free_text} is "
        f"free. {free_up}, then press Download to resume; finished files are kept."
    )


def _plan(repo_id: str, dest: Path, allow: list[str], ignore: list[str]) -> tuple[int, int]:
    from huggingface_hub import snapshot_download

    infos = snapshot_download(repo_id, local_dir=dest, allow_patterns=allow, ignore_patterns=ignore, dry_run=True)
    total = sum(i.file_size or 0 for i in infos)
    remaining = sum(i.file_size or 0 for i in infos if i.will_download)
    return total, remaining


def write_marker(dest: Path, info: dict, name: str = COMPLETE_MARKER) -> None:
    """Write-then-rename: a crash leaves the old marker or the new one, never half of one."""
    tmp = dest / f"{name}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(info))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest / name)


def exit_with_parent() -> None:
    """Child side: end this process when the app that started it is gone, even after a kill -9. The app holds the
    write end of our stdin; the OS closes it when the app dies, and the read below returns."""

    # The raw descriptor, not sys.stdin: a daemon thread blocked inside the buffered reader holds its lock, and at a
    # normal exit the interpreter's shutdown then aborts on that lock (SIGABRT, "could not acquire lock for
    # <stdin> at interpreter shutdown"; a crash report on macOS) instead of ending with the worker's exit code.
    fd = sys.stdin.fileno()

    def watch() -> None:
        try:
            while os.read(fd, 4096):
                pass
        finally:
            os._exit(3)

    threading.Thread(target=watch, name="fmoe-parent-watch", daemon=True).start()


def _nothing() -> None:
    pass


def _plan_leftovers(dest: Path) -> Callable[[], None]:
    """A callable removing what a plan made under `dest` that was not there before: the whole folder when it did
    not exist, else only a `.cache` it did not have (a folder that is already ours keeps its own, which a resumed
    download reads)."""
    if not dest.exists():
        return lambda: shutil.rmtree(dest, ignore_errors=True)
    cache = dest / ".cache"
    if cache.exists() or (dest / STARTED_MARKER).exists() or (dest / COMPLETE_MARKER).exists():
        return _nothing
    return lambda: shutil.rmtree(cache, ignore_errors=True)


def worker(repo_id: str, dest: Path, allow: list[str], ignore: list[str]) -> int:
    """Child-process body: plan, check disk, download, mark complete. Reports JSON lines on stdout."""
    total = 0

    def say(**event: object) -> None:
        print(json.dumps(event), flush=True)

    from huggingface_hub import snapshot_download

    # What the plan itself leaves (huggingface_hub's dry run writes its file listing under <dest>/.cache) is undone
    # when the download does not start: a folder without our marker is neither listed nor deletable in the app.
    undo = _plan_leftovers(dest)
    try:
        total, remaining = _plan(repo_id, dest, allow, ignore)
        say(event="plan", total=total, remaining=remaining)
        dest.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(dest.parent).free
        if remaining + DISK_MARGIN_BYTES > free:
            undo()
            remaining_text, free_text = in_one_unit(remaining, free, decimals=1)
            say(
                event="error",
                kind="disk",
                message=f"Not enough disk space: {remaining_text} still to download and "
                f"{free_text} free. Free up space and try again.",
            )
            return 2
        # Only now, with a plan for a real repo and room for it: a mistyped repo id leaves no folder behind.
        dest.mkdir(exist_ok=True)
        write_marker(dest, {"repo_id": repo_id, "total_bytes": total}, STARTED_MARKER)
        undo = _nothing  # from here the folder is a download of ours: listed, resumable, deletable
        snapshot_download(repo_id, local_dir=dest, allow_patterns=allow, ignore_patterns=ignore)
    except Exception as error:  # noqa: BLE001 - every failure becomes a sentence for the user
        undo()
        full = disk_full(error, dest, total)
        kind, message = ("disk", full) if full else explain(error)
        say(event="error", kind=kind, message=message)
        return 1
    write_marker(dest, {"repo_id": repo_id, "total_bytes": total})
    say(event="done", path=str(dest))
    return 0


class Download:
    """One download in a child process. `status()` is cheap enough to poll twice a second."""

    def __init__(
        self,
        repo_id: str,
        models_dir: Path,
        allow: list[str],
        ignore: list[str],
        token: str | None = None,
        endpoint: str | None = None,
    ) -> None:
        from fmoe_local.catalog import local_name

        self.repo_id = repo_id
        self.dest = Path(models_dir) / local_name(repo_id)
        env = dict(os.environ, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        if token:
            env["HF_TOKEN"] = token
        if endpoint:
            env["HF_ENDPOINT"] = endpoint
        args = [sys.executable, "-m", "ui.downloads", repo_id, str(self.dest)]
        args += [f"--allow={p}" for p in allow] + [f"--ignore={p}" for p in ignore]
        root = Path(__file__).resolve().parent.parent
        env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        # stdin stays open and unused: when this app dies the child sees it close and ends (exit_with_parent).
        self._proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True
        )
        self._lock = threading.Lock()
        self._total = 0
        self._error = ""
        self._done = False
        self._cancelled = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self._lock:
                if event.get("event") == "plan":
                    self._total = int(event["total"])
                elif event.get("event") == "error":
                    self._error = str(event["message"])
                elif event.get("event") == "done":
                    self._done = True
        self._proc.wait()
        if self._proc.stdin is not None:
            self._proc.stdin.close()  # the child is gone: nothing left to watch it

    def status(self) -> DownloadStatus:
        running = self._proc.poll() is None
        if not running:
            self._reader.join(timeout=2)
        with self._lock:
            total, error, done, cancelled = self._total, self._error, self._done, self._cancelled
        have = folder_bytes(self.dest) if self.dest.exists() else 0
        if done:  # first: a Cancel pressed after the download finished cancelled nothing
            return DownloadStatus("done", total, total, f"Downloaded {self.repo_id}.")
        if cancelled:
            return DownloadStatus("cancelled", have, total, "Download cancelled. Press Download to resume it.")
        if error:
            return DownloadStatus("error", have, total, error)
        if not running:
            return DownloadStatus("error", have, total, "The download stopped unexpectedly. Press Download to resume.")
        return DownloadStatus("downloading" if total else "planning", min(have, total), total)

    def wait(self, timeout: float | None = None) -> DownloadStatus:
        self._proc.wait(timeout)
        return self.status()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Download one model's files (run by the app, not by hand).")
    parser.add_argument("repo_id")
    parser.add_argument("dest", type=Path)
    parser.add_argument("--allow", action="append", default=[])
    parser.add_argument("--ignore", action="append", default=[])
    args = parser.parse_args(argv)
    exit_with_parent()
    return worker(args.repo_id, args.dest, args.allow or None, args.ignore or None)


if __name__ == "__main__":
    sys.exit(main())
