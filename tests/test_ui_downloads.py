"""Wizard downloads against a fake Hub on loopback (huggingface_hub mocked at its HTTP boundary: no network).

The fake serves the four routes snapshot_download uses (repo info, tree listing, HEAD and ranged GET on
resolve/) and records the requests, so the tests see what the real client asked for.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ui.downloads import COMPLETE_MARKER, Download, delete_downloaded, list_downloaded, list_incomplete

SHA = "0123456789abcdef0123456789abcdef01234567"
ALLOW = ["*.safetensors", "*.json"]
IGNORE = ["original/*"]
CHUNK = 10 * 1024 * 1024


class FakeHub:
    def __init__(self, files: dict[str, bytes], gated: bool = False) -> None:
        self.files = files
        self.gated = gated
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.stall: str | None = None  # a file whose body hangs forever (a dead link the user cancels)
        self.drop_after: int | None = None  # the next body is cut after this many bytes (a dropped connection)
        self.release = threading.Event()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()

    def _send_json(self, h: BaseHTTPRequestHandler, obj: object, status: int = 200, headers=None) -> None:
        data = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        self.requests.append((h.command, path, h.headers.get("Range")))
        if self.gated:
            self._send_json(h, {"error": "Access to this model is restricted."}, 403, {"X-Error-Code": "GatedRepo"})
            return
        if path.startswith("/api/models/") and "/revision/" in path:
            repo = path[len("/api/models/") :].split("/revision/")[0]
            siblings = [{"rfilename": n} for n in self.files]
            self._send_json(h, {"id": repo, "modelId": repo, "sha": SHA, "siblings": siblings, "private": False})
            return
        if path.startswith("/api/models/") and "/tree/" in path:
            tree = [
                {"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for n, b in self.files.items()
            ]
            self._send_json(h, tree)
            return
        if "/resolve/" in path:
            name = path.split("/resolve/")[1].split("/", 1)[1]
            data = self.files[name]
            etag = hashlib.sha1(data).hexdigest()
            start = 0
            rng = h.headers.get("Range")
            if rng:
                start = int(rng.split("=")[1].split("-")[0])
            h.send_response(206 if start else 200)
            h.send_header("ETag", f'"{etag}"')
            h.send_header("X-Repo-Commit", SHA)
            h.send_header("Content-Length", str(len(data) - start))
            if start:
                h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            h.end_headers()
            if not body:
                return
            chunk = data[start:]
            if name == self.stall:
                h.wfile.write(chunk[:1000])
                h.wfile.flush()
                self.release.wait(60)
                return
            if self.drop_after is not None and len(chunk) > self.drop_after:
                cut, self.drop_after = self.drop_after, None
                h.wfile.write(chunk[:cut])  # then the handler returns and the server closes the socket
                return
            h.wfile.write(chunk)
            return
        self._send_json(h, {"error": "not found"}, 404)


def _files() -> dict[str, bytes]:
    # Bigger than huggingface_hub's 10 MiB write chunk, so that an interrupted transfer leaves bytes on disk.
    big = bytes(range(256)) * 4096 * 11  # 11 MiB
    return {
        "config.json": b'{"model_type": "mixtral"}',
        "model-00001-of-00002.safetensors": big,
        "model-00002-of-00002.safetensors": big[::-1],
        "README.md": b"# skip me",
        "original/consolidated.safetensors": b"x" * 100,
    }


@pytest.fixture
def hub():
    h = FakeHub(_files())
    yield h
    h.close()


def _wait(download: Download, until, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = download.status()
        if until(status):
            return status
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting; last status {download.status()}")


@pytest.mark.slow
def test_download_fetches_only_needed_files_and_lists_it(hub, tmp_path):
    d = Download("acme/tiny-moe", tmp_path, ALLOW, IGNORE, endpoint=hub.url)
    status = d.wait(60)
    assert status.state == "done", status
    dest = tmp_path / "acme--tiny-moe"
    for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (dest / name).read_bytes() == _files()[name]
    assert not (dest / "README.md").exists()
    assert not (dest / "original").exists()
    assert status.total_bytes == sum(
        len(b) for n, b in _files().items() if n.endswith((".json", ".safetensors")) and "/" not in n
    )
    listed = list_downloaded(tmp_path)
    assert [m.repo_id for m in listed] == ["acme/tiny-moe"]
    delete_downloaded(tmp_path, listed[0].path)
    assert list_downloaded(tmp_path) == []
    with pytest.raises(ValueError, match="models folder"):
        delete_downloaded(tmp_path, tmp_path.parent)


@pytest.mark.slow
def test_cancel_after_the_download_finished_still_says_it_finished(hub, tmp_path):
    d = Download("acme/tiny-moe", tmp_path, ALLOW, IGNORE, endpoint=hub.url)
    assert d.wait(60).state == "done"
    d.cancel()  # pressed a moment too late
    status = d.status()
    assert (status.state, status.message) == ("done", "Downloaded acme/tiny-moe.")  # before: "Download cancelled."
    assert [m.repo_id for m in list_downloaded(tmp_path)] == ["acme/tiny-moe"]


@pytest.mark.slow
def test_dropped_connection_resumes_mid_file(hub, tmp_path):
    hub.drop_after = CHUNK + 1000
    status = Download("acme/tiny-moe", tmp_path, ALLOW, IGNORE, endpoint=hub.url).wait(60)
    assert status.state == "done", status
    ranges = [r for m, p, r in hub.requests if m == "GET" and "/resolve/" in p]
    assert f"bytes={CHUNK}-" in ranges  # the client asked for the rest, not the whole file again
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (tmp_path / "acme--tiny-moe" / name).read_bytes() == _files()[name]


@pytest.mark.slow
def test_cancel_then_download_again_keeps_finished_shards(hub, tmp_path):
    hub.stall = "model-00002-of-00002.safetensors"
    d = Download("acme/tiny-moe", tmp_path, ALLOW, IGNORE, endpoint=hub.url)
    partial = _wait(d, lambda s: s.done_bytes >= len(_files()["model-00001-of-00002.safetensors"]))
    assert partial.state == "downloading" and 0 < partial.fraction < 1
    d.cancel()
    assert d.status().state == "cancelled"
    assert list_downloaded(tmp_path) == []  # no marker: an interrupted download is not offered for loading
    hub.stall = None
    hub.requests.clear()
    assert Download("acme/tiny-moe", tmp_path, ALLOW, IGNORE, endpoint=hub.url).wait(60).state == "done"
    fetched = [p.rsplit("/", 1)[1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
    assert fetched == ["model-00002-of-00002.safetensors"]  # shard 1 and config.json were kept
    assert (tmp_path / "acme--tiny-moe" / COMPLETE_MARKER).is_file()


@pytest.mark.slow
def test_a_cancelled_download_is_listed_as_incomplete_and_can_be_deleted(hub, tmp_path):
    hub.stall = "model-00002-of-00002.safetensors"
    shard = len(_files()["model-00001-of-00002.safetensors"])
    d = Download("acme/tiny-moe", tmp_path, ALLOW, IGNORE, endpoint=hub.url)
    _wait(d, lambda s: s.done_bytes >= shard)
    d.cancel()
    # before: not listed anywhere, and Delete said it "was not downloaded by this app"
    assert list_downloaded(tmp_path) == []
    [left] = list_incomplete(tmp_path)
    assert left.repo_id == "acme/tiny-moe" and left.size_bytes >= shard
    delete_downloaded(tmp_path, left.path)
    assert not left.path.exists() and list_incomplete(tmp_path) == []


class NotFoundHub(FakeHub):
    """What huggingface.co answers an anonymous client for a repo that does not exist (or is private)."""

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        self.requests.append((h.command, h.path, None))
        headers = {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}
        self._send_json(h, {"error": "Repository not found"}, 401, headers)


@pytest.mark.slow
def test_a_mistyped_repo_id_leaves_no_folder_behind(tmp_path):
    hub = NotFoundHub({})
    try:
        status = Download("acme/does-not-exist", tmp_path, ALLOW, IGNORE, endpoint=hub.url).wait(60)
    finally:
        hub.close()
    assert status.state == "error" and "No such model" in status.message
    assert list(tmp_path.iterdir()) == []  # before: an empty acme--does-not-exist folder stayed


class BusyHub(FakeHub):
    """A Hub that answers every request with one HTTP error status (a rate limit, an outage)."""

    def __init__(self, status: int) -> None:
        super().__init__({})
        self.status = status

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        self.requests.append((h.command, h.path, None))
        self._send_json(h, {"error": "busy"}, self.status)


@pytest.mark.slow
@pytest.mark.parametrize("code, said", [(429, "limiting downloads"), (503, "server error (HTTP 503)")])
def test_a_hub_that_answers_with_an_error_is_not_called_offline(tmp_path, code, said):
    hub = BusyHub(code)
    try:
        status = Download("acme/tiny-moe", tmp_path, ALLOW, IGNORE, endpoint=hub.url).wait(60)
    finally:
        hub.close()
    assert status.state == "error" and said in status.message and "Wait a few minutes" in status.message
    assert "offline" not in status.message  # was: "this computer looks offline. Connect to the internet"


@pytest.mark.slow
def test_offline_message(tmp_path):
    with socket.socket() as s:  # a port nobody listens on: connection refused, like no network
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = Download("acme/tiny-moe", tmp_path, ALLOW, IGNORE, endpoint=f"http://127.0.0.1:{port}")
    status = d.wait(60)
    assert status.state == "error"
    assert "offline" in status.message and "resumes" in status.message


@pytest.mark.slow
def test_gated_model_message(tmp_path):
    hub = FakeHub(_files(), gated=True)
    try:
        status = Download("acme/gated", tmp_path, ALLOW, IGNORE, endpoint=hub.url).wait(60)
    finally:
        hub.close()
    assert status.state == "error"
    assert "licence" in status.message and "token" in status.message


def test_a_disk_that_fills_up_during_the_download_says_how_much_to_free(tmp_path, monkeypatch, capsys):
    import errno
    import shutil
    from types import SimpleNamespace

    import huggingface_hub

    from ui.downloads import worker

    def fake_hub(repo_id, local_dir, dry_run=False, **_):
        if dry_run:  # the plan: three 2 GB shards, none on disk yet
            return [SimpleNamespace(file_size=2_000_000_000, will_download=True) for _ in range(3)]
        (local_dir / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device")  # another program took the space meanwhile

    frees = iter([10_000_000_000, 500_000_000])  # free at the pre-check, then once the disk filled up
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_hub)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(free=next(frees)))
    assert worker("acme/tiny-moe", tmp_path / "acme--tiny-moe", ["*"], []) == 1
    said = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # before: "The download failed: [Errno 28] No space left on device. Press Download to retry; …"
    assert said[-1] == {
        "event": "error",
        "kind": "disk",
        "message": "The disk is full: about 6.0 GB of this model is still to download and 0.5 GB is free. Free up at "
        "least 7.5 GB, then press Download to resume; finished files are kept.",
    }


def test_a_truncated_marker_does_not_break_the_models_list(tmp_path):
    from ui.downloads import COMPLETE_MARKER, list_downloaded, write_marker

    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    write_marker(good, {"repo_id": "org/good", "total_bytes": 1})
    (bad / COMPLETE_MARKER).write_text('{"repo_id": "org/b')  # what a plain write_text cut by a kill leaves
    assert [m.repo_id for m in list_downloaded(tmp_path)] == ["org/good"]
    assert not (good / f"{COMPLETE_MARKER}.tmp").exists()


PARENT = """
import subprocess, sys, time
child = subprocess.Popen(
    [sys.executable, "-c", "import time; from ui.downloads import exit_with_parent; exit_with_parent(); time.sleep(120)"],
    stdin=subprocess.PIPE,
)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_the_download_child_ends_when_the_app_is_killed(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"  # a zombie has ended; only its exit status waits to be collected

    repo = Path(__file__).resolve().parents[1]
    app = subprocess.Popen([sys.executable, "-c", PARENT], cwd=repo, stdout=subprocess.PIPE, text=True)
    child = int(app.stdout.readline())
    assert alive(child)
    app.send_signal(signal.SIGKILL)
    app.wait()
    app.stdout.close()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the download child outlived the app"


def test_download_keeps_the_child_s_stdin_open_for_the_watch(tmp_path):
    from ui.downloads import Download

    d = Download("org/none", tmp_path, ["*.json"], [], endpoint="http://127.0.0.1:9")  # refused at once
    try:
        assert d._proc.stdin is not None
        d.wait(60)
    finally:
        d.cancel()


def test_a_refused_download_leaves_no_folder_behind(tmp_path, monkeypatch, capsys):
    """Before: the plan (huggingface_hub's dry run) wrote <owner>--<name>/.cache, and a download refused for lack
    of disk space left that folder: without a marker it was not listed, and Delete refused it as not the app's."""
    import shutil
    from types import SimpleNamespace

    import huggingface_hub

    from ui.downloads import STARTED_MARKER, worker

    def fake_hub(repo_id, local_dir, dry_run=False, **_):
        assert dry_run, "a refused download must not start"
        trees = local_dir / ".cache" / "huggingface" / "trees"  # what the real dry run writes
        trees.mkdir(parents=True)
        (trees / "0123.json").write_text("[]")
        return [SimpleNamespace(file_size=50_000_000_000, will_download=True)]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_hub)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(free=1_000_000_000))
    assert worker("acme/huge-moe", tmp_path / "acme--huge-moe", ["*"], []) == 2
    assert "Not enough disk space" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    # A folder that was there before keeps what it had; only the plan's own .cache goes.
    mine = tmp_path / "acme--huge-moe"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert worker("acme/huge-moe", mine, ["*"], []) == 2
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    # A download of ours (its started marker) keeps its .cache: a resumed download reads it.
    (mine / STARTED_MARKER).write_text('{"repo_id": "acme/huge-moe"}')
    assert worker("acme/huge-moe", mine, ["*"], []) == 2
    assert (mine / ".cache").is_dir()


class HugeHub(FakeHub):
    """A real repo whose files are far larger than any disk: the download is refused after its plan."""

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        if "/tree/" in path:
            self.requests.append((h.command, path, None))
            tree = [{"type": "file", "path": n, "size": 10**15, "oid": "0" * 40} for n in self.files]
            self._send_json(h, tree)
        elif "/resolve/" in path and not body:  # the plan's HEAD: the size it counts
            self.requests.append((h.command, path, None))
            h.send_response(200)
            h.send_header("ETag", '"huge"')
            h.send_header("X-Repo-Commit", SHA)
            h.send_header("Content-Length", str(10**15))
            h.end_headers()
        else:
            super()._serve(h, body)


@pytest.mark.slow
def test_a_download_refused_for_disk_space_leaves_no_folder_behind(tmp_path):
    hub = HugeHub(_files())
    try:
        status = Download("acme/huge-moe", tmp_path, ALLOW, IGNORE, endpoint=hub.url).wait(120)
    finally:
        hub.close()
    assert status.state == "error" and "Not enough disk space" in status.message
    assert list(tmp_path.iterdir()) == []  # before: acme--huge-moe/.cache/huggingface/… stayed, unlisted


def test_the_download_child_ends_with_its_own_exit_code_not_an_abort(tmp_path):
    """Before: the parent watch, a daemon thread blocked in sys.stdin.buffer.read(), held stdin's lock when the
    child ended normally: "Fatal Python error: _enter_buffered_busy: could not acquire lock for <stdin> at
    interpreter shutdown", SIGABRT (on macOS a crash report for every finished download)."""
    import subprocess
    import sys
    from pathlib import Path

    downloads = Path(__file__).resolve().parents[1] / "ui" / "downloads.py"
    child = (  # the module alone: importing the ui package would load gradio, seconds for nothing here
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('fmoe_downloads', {str(downloads)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['fmoe_downloads'] = module\n"
        "spec.loader.exec_module(module)\n"
        "module.exit_with_parent()\n"
        "time.sleep(0.2)\n"  # the watch is blocked in its read, as during every download
        "sys.exit(2)\n"  # as worker() does for a refused download
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        err = proc.stderr.read()
        proc.wait(60)
    finally:
        proc.stdin.close()
    assert "could not acquire lock" not in err, err
    assert proc.returncode == 2, (proc.returncode, err)
