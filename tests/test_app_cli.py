"""app.py's command line: where it binds, which port, which model it loads, sub-command dispatch."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import app
from tests import machine_verdicts
from tests.ports import unused_port


def test_loopback_unless_listen():
    assert app.build_parser().parse_args([]).listen is False
    assert app.bind_host(False) == "127.0.0.1"
    assert app.bind_host(True) == "0.0.0.0"


def test_taken_port_moves_to_the_next_free_one():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert app.free_port("127.0.0.1", port) > port
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError, match="--port"):
            app.free_port("127.0.0.1", busy.getsockname()[1], tries=1)


@pytest.mark.parametrize("port", ["99999", "-1", "0", "65536", "http"])
def test_a_port_out_of_range_is_refused_in_one_line(port, capsys):
    """Before: --port 99999 and -1 were OverflowError tracebacks; --port 0 served on a random port and recorded
    http://127.0.0.1:0/ for the next start to open."""
    with pytest.raises(SystemExit) as refused:
        app.main(["--port", port, "--no-browser"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"Argument --port: give a whole number from 1 to 65535 (got {port if port != 'http' else repr(port)})" in err


def test_the_ports_tried_never_pass_65535():
    """From --port 65535 the next ports were 65536…: bind() raised OverflowError, a traceback, not "all taken"."""
    with socket.socket() as busy:
        try:
            busy.bind(("127.0.0.1", 65535))
            busy.listen()
        except OSError:
            pass  # taken by someone else: just as busy
        with pytest.raises(OSError, match="Ports 65535–65535 are all taken. Start with --port and another number"):
            app.free_port("127.0.0.1", 65535, tries=3)


def test_model_resolution_order(tmp_path):
    models = tmp_path / "models"
    (models / "acme--moe").mkdir(parents=True)
    folder = tmp_path / "mine"
    folder.mkdir()
    assert app.resolve_model(str(folder), models, "") == (folder, "")
    assert app.resolve_model("acme/moe", models, "") == (models / "acme--moe", "")
    missing, note = app.resolve_model("acme/other", models, "")
    assert missing is None and "Models tab" in note
    assert app.resolve_model(None, models, str(folder)) == (folder, "")  # the last used model


def test_run_subcommand_goes_to_the_runtime_cli_with_the_store(tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("mixtral")
    argv = ["run", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "3", "--greedy", "--json"]
    assert app.main(argv + ["--store", str(tmp_path) + "/"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 3
    from store import open_store

    with open_store(tmp_path) as store:
        assert store.models_with_maps()  # the maps of that run were persisted through app.py's factory


def test_second_instance_on_the_same_data_says_so(tmp_path):
    from store import open_store

    with open_store(tmp_path):
        with pytest.raises(SystemExit, match="already in use"):
            app.serve(app.build_parser().parse_args(["--no-browser", "--data-dir", str(tmp_path)]))


def test_data_dir_that_does_not_exist_yet_becomes_a_folder(tmp_path, monkeypatch):
    # Stop right where the store would open: the point is what app.py hands it.
    opened = []

    def fake_open_store(location):
        opened.append(location)
        raise SystemExit("stop here")

    monkeypatch.setattr("store.open_store", fake_open_store)
    target = tmp_path / "new" / "data"
    with pytest.raises(SystemExit):
        app.serve(app.build_parser().parse_args(["--no-browser", "--data-dir", str(target)]))
    assert opened == [target] and target.is_dir()


def test_a_data_dir_that_cannot_be_a_folder_is_a_sentence_not_a_traceback(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    with pytest.raises(
        SystemExit, match=r"cannot use .*a-file/data as the data folder \(.*\)\. Give --data-dir a folder"
    ):
        app.serve(app.build_parser().parse_args(["--no-browser", "--data-dir", str(taken / "data")]))
    assert taken.read_text() == "not a folder"


def test_without_a_last_model_the_demo_model_is_next(tmp_path):
    from fmoe_local import demo

    try:
        expected = demo.demo_model_dir()
    except FileNotFoundError:
        expected = None
    found, note = app.resolve_model(None, tmp_path, str(tmp_path / "deleted-since"))
    if expected is None:  # demo weights not built in this checkout: the app says so and opens the wizard
        assert found is None and "Models tab" in note
    else:
        assert found == expected and note == ""


def test_a_first_quantised_load_at_start_up_says_how_far_its_copy_got_every_tenth():
    lines = []
    report = app.console_progress("4-bit (nf4)", out=lambda line, flush: lines.append(line))
    for done in range(0, 257):
        report(done, 256)
    assert len(lines) == 11  # 0 %, each tenth, and the end: not one line per expert
    assert lines[0] == "fmoe-local: making the 4-bit (nf4) copy of the experts: 0 of 256 (first load only)"
    assert lines[-1].endswith(": 256 of 256 (first load only)")


def test_a_copy_given_up_at_start_up_says_the_experts_are_quantised_in_memory():
    lines = []
    report = app.console_progress("4-bit (nf4)", out=lambda line, flush: lines.append(line))
    report(8, 32)
    report(0, 0)  # the copy did not fit: packed_host falls back (its load notice says what to free)
    assert lines[-1] == "fmoe-local: the 4-bit (nf4) copy cannot be kept; quantising the experts in memory instead"


SIGNALS = [name for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]


@pytest.mark.parametrize(("signame", "after"), [(n, "serving on") for n in SIGNALS] + [("SIGTERM", "fmoe-local")])
def test_a_closed_terminal_or_a_shutdown_stops_the_app_through_its_cleanup(signame, after, tmp_path):
    """SIGHUP (the launcher's terminal closed) and SIGTERM end the app like Ctrl+C: saved and closed, exit 0, also
    when the signal comes during start-up (after its first line, while the model loads)."""
    root = Path(app.__file__).resolve().parent
    args = [
        sys.executable,
        str(root / "app.py"),
        "--no-browser",
        "--data-dir",
        str(tmp_path),
        "--port",
        str(unused_port()),
    ]
    machine_verdicts.seed(tmp_path)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if after in line:
                break
        assert any(after in line for line in lines), "".join(lines)
        proc.send_signal(getattr(signal, signame))
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out  # without the handler: -15 / -1, killed before any cleanup
    machine_verdicts.keep(tmp_path)
    assert "fmoe-local: stopped (chats and expert maps saved)." in out, "".join(lines) + out
    if after == "serving on":  # the address it served at goes with it: a later start must not send anyone there
        assert not (tmp_path / app.RUNNING_URL).exists()


def test_the_app_serves_while_its_start_up_model_loads_and_says_so(tmp_path, tiny_model_dir, monkeypatch):
    """The page opens at once: the model loads on a thread of its own, and a request meanwhile hears why it waits."""
    from fmoe_local.quant_cache import QuantCache
    from ui import chat_flow

    real_write, release = QuantCache._write, threading.Event()

    def held(self, layer, tensors):  # a first 4-bit load, held mid-copy: minutes on a real model
        release.wait(120)
        real_write(self, layer, tensors)

    monkeypatch.setattr(QuantCache, "_write", held)
    from store import open_store

    with open_store(tmp_path) as store:
        store.settings.set(expert_format="nf4")
    args = [
        "--no-browser",
        "--data-dir",
        str(tmp_path),
        "--port",
        str(unused_port()),
        "--model",
        str(tiny_model_dir("mixtral")),
    ]
    server, session, url = app.serve(app.build_parser().parse_args(args))
    try:
        assert url and session.runtime is None and not session.loading.finished.is_set()  # serving, still loading
        assert (tmp_path / app.RUNNING_URL).read_text() == url  # where a second start on this data sends the user
        with pytest.raises(chat_flow.Problem, match="is still loading \\(the page's header says how far\\)"):
            chat_flow.runtime_of(session)
        release.set()
        assert session.loading.finished.wait(120) and session.runtime is not None
        assert session.runtime.info.expert_format == "nf4" and session.still_loading == ""
    finally:
        release.set()
        server.close()
        session.close()
        session.store.close()


def test_a_second_start_on_data_in_use_opens_the_running_app_instead_of_failing(tmp_path, monkeypatch):
    from store import open_store

    opened = []
    monkeypatch.setattr("webbrowser.open", opened.append)
    args = app.build_parser().parse_args(["--data-dir", str(tmp_path)])
    with open_store(tmp_path):  # the first instance holds the data
        with pytest.raises(SystemExit, match="already in use"):  # it has not said where it serves: the sentence
            app.serve(args)
        with _answering_server() as url:
            (tmp_path / app.RUNNING_URL).write_text(url)
            with pytest.raises(SystemExit) as second:  # a second double-click while it runs
                app.serve(args)
        assert second.value.code == 0 and opened == [url]
        # Its address no longer answers (it is stopping, or the holder serves no page): said, not opened.
        with pytest.raises(SystemExit, match="already in use.*does not answer at .*wait a moment"):
            app.serve(args)
    assert opened == [url]


def test_a_second_start_with_no_browser_does_not_say_it_opens_one(tmp_path, monkeypatch, capsys):
    """Before: "fmoe-local is already running at …; opening it in your browser." under --no-browser too."""
    from store import open_store

    opened = []
    monkeypatch.setattr("webbrowser.open", opened.append)
    args = app.build_parser().parse_args(["--data-dir", str(tmp_path), "--no-browser"])
    with open_store(tmp_path), _answering_server() as url:
        (tmp_path / app.RUNNING_URL).write_text(url)
        with pytest.raises(SystemExit) as second:
            app.serve(args)
    out = capsys.readouterr().out
    assert second.value.code == 0 and opened == []
    assert f"fmoe-local is already running at {url}.\n" in out and "browser" not in out


@contextlib.contextmanager
def _answering_server():
    import http.server

    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_ctrl_c_during_start_up_is_acted_on_once_start_up_is_done_and_a_second_one_interrupts():
    """Ctrl+C sets the event main's wait looks at, as SIGTERM and SIGHUP do: a KeyboardInterrupt raised during
    start-up (outside main's `try`) was lost, and the app then served on. A second Ctrl+C interrupts as usual."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can only be set from the main thread")
    saved = {name: signal.getsignal(getattr(signal, name)) for name in ("SIGINT", "SIGTERM", "SIGHUP")}
    try:
        stopping = app.stop_on_signals()
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:  # was: raised here, wherever start-up had got to
            pytest.fail("The first Ctrl+C raised KeyboardInterrupt instead of asking main to stop.")
        assert stopping.is_set()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        for name, handler in saved.items():
            signal.signal(getattr(signal, name), handler)
