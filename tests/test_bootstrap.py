"""The launcher bootstrap's effects that run without installing anything (installers/bootstrap.py): failing steps,
the smoke check, the stamp it writes and the CUDA build it retries, the menu entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher_fakes import REPO, SMI, bootstrap, make_project, plan, probes


@pytest.fixture
def project(tmp_path: Path) -> plan.Project:
    return make_project(tmp_path)


def _fake_venv(venv: Path, cuda: str) -> None:
    """A venv whose python answers the PyTorch build probe with `cuda` and records pip commands."""
    python = bootstrap.venv_python(venv)
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(
        f"#!/bin/sh\necho \"$*\" >> '{venv}/calls'\n"
        f'case "$*" in *torch.version.cuda*) printf "%s" "$(cat \'{venv}/cuda\')";; esac\n'
        f"case \"$*\" in *'pip install'*) [ -e '{venv}/offline' ] && exit 1;; esac\nexit 0\n"
    )
    python.chmod(0o755)
    (venv / "cuda").write_text(cuda)


@pytest.mark.skipif(os.name == "nt", reason="the fake interpreter is a shell script")
def test_the_stamp_records_the_build_pip_installed_and_a_later_start_swaps_in_cuda(
    project: plan.Project, home: Path, monkeypatch: pytest.MonkeyPatch
):
    gpu = probes(nvidia_smi=SMI.format(cuda="12.8"))
    venv = home / "venv"
    _fake_venv(venv, "")  # pip fell back to a CPU-only wheel
    log = bootstrap.Log(home / "logs/launcher.log")
    decision = plan.decide(gpu, project, None, False, False, home)
    bootstrap.write_stamp(venv, decision, log)
    stamp = json.loads((venv / bootstrap.STAMP_NAME).read_text())
    assert stamp["torch_cuda"] == "" and "without GPU support" in log.path.read_text()
    # The next start: the CUDA index still cannot be reached, so the CPU environment starts as it is.
    later = plan.decide(gpu, project, stamp, True, False, home)
    monkeypatch.setattr(bootstrap, "reachable", lambda url, timeout=3.0: False)
    bootstrap.retry_cuda(venv, later, project, log)
    assert "pip install" not in (venv / "calls").read_text() and "cannot be reached" in log.path.read_text()
    # It answers but the download fails: pip restores what it removed, the start goes on, on the CPU.
    monkeypatch.setattr(bootstrap, "reachable", lambda url, timeout=3.0: True)
    (venv / "offline").write_text("")
    bootstrap.retry_cuda(venv, later, project, log)
    assert "Starting on the CPU build; the next start tries again" in log.path.read_text()
    assert json.loads((venv / bootstrap.STAMP_NAME).read_text())["torch_cuda"] == ""
    # Once it downloads: only torch is swapped for the planned build, and the stamp says what is there now.
    (venv / "offline").unlink()
    (venv / "cuda").write_text("12.8")
    bootstrap.retry_cuda(venv, later, project, log)
    pip = [c for c in (venv / "calls").read_text().splitlines() if "pip install" in c]
    assert pip and "torch==2.13.0+cu128 --extra-index-url https://download.pytorch.org/whl/cu128" in pip[-1]
    stamp = json.loads((venv / bootstrap.STAMP_NAME).read_text())
    assert stamp["torch_cuda"] == "12.8" and not plan.decide(gpu, project, stamp, True, False, home).retry_cuda


# ---- bootstrap effects that need no install ----


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    return tmp_path / ".local/share/fmoe-local"


def test_plan_reports_stamp_state_from_disk(home: Path, capsys: pytest.CaptureFixture):
    assert bootstrap.main(["--plan"]) == 0
    assert "first run" in capsys.readouterr().out
    venv = home / "venv"
    bootstrap.venv_python(venv).parent.mkdir(parents=True)
    bootstrap.venv_python(venv).write_text("")
    wanted = plan.decide(bootstrap.probe(home), plan.read_project(REPO), None, False, False, home).stamp
    (venv / bootstrap.STAMP_NAME).write_text(json.dumps(wanted))
    assert bootstrap.main(["--plan"]) == 0
    assert "Environment up to date" in capsys.readouterr().out
    (venv / bootstrap.STAMP_NAME).write_text(json.dumps(dict(wanted, project_version="0.0.1")))
    assert bootstrap.main(["--plan"]) == 0
    assert "project_version: 0.0.1 ->" in capsys.readouterr().out
    assert "project_version: 0.0.1 ->" in (home / "logs/launcher.log").read_text()


def test_failed_step_shows_its_output_and_the_log_path(home: Path, capsys: pytest.CaptureFixture):
    log = bootstrap.Log(home / "logs/launcher.log")
    with pytest.raises(plan.BootstrapError, match="This step failed"):
        log.run([sys.executable, "-c", "print('no matching distribution for torch'); raise SystemExit(3)"])
    assert "no matching distribution for torch" in capsys.readouterr().out
    assert "no matching distribution for torch" in log.path.read_text()


def test_a_second_launcher_cannot_install_while_the_first_does(tmp_path: Path):
    lock = tmp_path / "install.lock"
    with bootstrap.install_lock(lock):
        with pytest.raises(plan.BootstrapError, match="Another fmoe-local launcher is installing"):
            with bootstrap.install_lock(lock):
                pass
    with bootstrap.install_lock(lock):  # released when the first one is done
        pass


def test_console_progress_keeps_direct_dependencies_big_downloads_and_the_end():
    shown = [
        bootstrap.pip_progress(line)
        for line in [
            "Collecting gradio>=5 (from fmoe-local==0.1.0)",
            "Collecting idna>=2.8 (from anyio<5.0,>=3.0->gradio>=5->fmoe-local==0.1.0)",
            "Downloading https://download.pytorch.org/whl/cu128/torch-2.13.0%2Bcu128-cp311-linux_x86_64.whl (888.1 MB)",
            "Downloading idna-3.11-py3-none-any.whl (71 kB)",
            "Installing collected packages: idna, gradio, torch",
            "Successfully installed gradio-6.31.0 idna-3.11 torch-2.13.0",
        ]
    ]
    assert shown == [
        "Collecting gradio>=5",
        None,
        "Downloading torch-2.13.0%2Bcu128-cp311-linux_x86_64.whl (888.1 MB)",
        None,
        "Unpacking 3 packages (the slowest part; the window may look idle)...",
        "Done: 3 packages installed.",
    ]


STUB_APP = """import argparse, http.server, socketserver, sys
p = argparse.ArgumentParser(); p.add_argument("--port", type=int); p.add_argument("--no-browser", action="store_true")
p.add_argument("--data-dir"); a = p.parse_args()
if {fail}: sys.exit(4)
socketserver.TCPServer(("127.0.0.1", a.port), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    bootstrap.venv_python(venv).parent.mkdir(parents=True)
    bootstrap.venv_python(venv).symlink_to(sys.executable)
    return venv


def test_smoke_waits_for_an_answer_then_stops_the_app(project: plan.Project, home: Path, tmp_path: Path):
    (project.root / "app.py").write_text(STUB_APP.format(fail=False))
    log = bootstrap.Log(home / "logs/launcher.log")
    bootstrap.smoke(fake_venv(tmp_path), project, log, timeout=60)
    assert "Smoke test passed: HTTP 200" in log.path.read_text()


def test_smoke_fails_when_the_app_exits(project: plan.Project, home: Path, tmp_path: Path):
    (project.root / "app.py").write_text(STUB_APP.format(fail=True))
    log = bootstrap.Log(home / "logs/launcher.log")
    with pytest.raises(plan.BootstrapError, match="exited with code 4"):
        bootstrap.smoke(fake_venv(tmp_path), project, log, timeout=60)


# ---- the menu entry and the command on PATH (installers/shortcuts.py) ----


def fake_repo(tmp_path: Path) -> Path:
    """A repository whose Linux launcher echoes its arguments, with the real .desktop template."""
    repo = tmp_path / "repo dir"  # a space: every path the shortcuts write must be quoted
    (repo / "installers/linux").mkdir(parents=True)
    (repo / "installers/linux/fmoe-local.desktop").write_text(
        (REPO / "installers/linux/fmoe-local.desktop").read_text()
    )
    sh = repo / "installers/linux/fmoe-local.sh"
    sh.write_text('#!/bin/sh\nfor a in "$@"; do echo "[$a]"; done\n')
    sh.chmod(0o755)
    return repo


@pytest.mark.skipif(os.name == "nt", reason="runs the POSIX command script")
def test_first_start_adds_the_menu_entry_and_a_command_that_runs_the_launcher(tmp_path: Path):
    repo, home = fake_repo(tmp_path), tmp_path / "home"
    data = home / ".local/share/fmoe-local"
    said = bootstrap.shortcuts.install("Linux", repo, home, data, {"PATH": f"/usr/bin:{home}/.local/bin"})
    entry = home / ".local/share/applications/fmoe-local.desktop"
    lines = entry.read_text().splitlines()
    assert f'Exec="{repo}/installers/linux/fmoe-local.sh"' in lines and "Terminal=true" in lines
    assert "@LAUNCHER@" not in entry.read_text()
    command = home / ".local/bin/fmoe-local"
    assert os.access(command, os.X_OK)
    ran = subprocess.run([str(command), "run", "--prompt", "it's two words"], capture_output=True, text=True)
    assert ran.stdout.splitlines() == ["[run]", "[--prompt]", "[it's two words]"]
    assert any(str(entry) in line for line in said) and any("type fmoe-local in a terminal" in s for s in said)
    # Made once: an entry the user removed is not made again at the next start.
    entry.unlink()
    assert bootstrap.shortcuts.install("Linux", repo, home, data, {}) == [] and not entry.exists()


@pytest.mark.skipif(os.name == "nt", reason="POSIX paths")
def test_a_file_that_is_not_ours_is_never_replaced(tmp_path: Path):
    repo, home = fake_repo(tmp_path), tmp_path / "home"
    theirs = home / ".local/bin/fmoe-local"
    theirs.parent.mkdir(parents=True)
    theirs.write_text("#!/bin/sh\necho the user's own fmoe-local\n")
    said = bootstrap.shortcuts.install("Linux", repo, home, home / ".local/share/fmoe-local", {"PATH": "/usr/bin"})
    assert theirs.read_text() == "#!/bin/sh\necho the user's own fmoe-local\n"
    assert any(f"Left {theirs} as it is" in s for s in said)
    assert (home / ".local/share/applications/fmoe-local.desktop").is_file()  # the rest is still made
    assert not any("not on your PATH" in s for s in said)  # no command was made, so nothing to say about PATH


def test_an_older_file_of_ours_is_replaced_and_a_missing_path_entry_is_explained(tmp_path: Path):
    repo, home = fake_repo(tmp_path), tmp_path / "home"
    ours = home / ".local/bin/fmoe-local"
    ours.parent.mkdir(parents=True)
    ours.write_text(f"#!/bin/sh\n# {bootstrap.shortcuts.MARKER}\nexec /old/checkout/fmoe-local.sh\n")
    said = bootstrap.shortcuts.install("Linux", repo, home, home / ".local/share/fmoe-local", {"PATH": "/usr/bin"})
    assert "/old/checkout" not in ours.read_text() and str(repo) in ours.read_text()
    assert any("is not on your PATH yet" in s and "~/.profile" in s for s in said)


def test_macos_bundle_opens_the_command_in_terminal_and_leaves_a_foreign_bundle_alone(tmp_path: Path):
    repo, home = tmp_path / "repo", tmp_path / "home"
    data = home / "Library/Application Support/fmoe-local"
    said = bootstrap.shortcuts.install("Darwin", repo, home, data, {"PATH": f"{home}/.local/bin"})
    app = home / "Applications/fmoe-local.app/Contents"
    assert "<key>CFBundleExecutable</key><string>fmoe-local</string>" in (app / "Info.plist").read_text()
    assert f"open -a Terminal '{repo}/installers/macos/fmoe-local.command'" in (app / "MacOS/fmoe-local").read_text()
    assert str(repo / "installers/macos/fmoe-local.command") in (home / ".local/bin/fmoe-local").read_text()
    assert any("Added fmoe-local to your Applications" in s for s in said)
    # Another app of that name: nothing is written into it.
    other = tmp_path / "other"
    (other / "Applications/fmoe-local.app/Contents").mkdir(parents=True)
    (other / "Applications/fmoe-local.app/Contents/Info.plist").write_text("<plist>someone else's</plist>")
    said = bootstrap.shortcuts.install("Darwin", repo, other, other / "data", {})
    assert not (other / "Applications/fmoe-local.app/Contents/MacOS").exists()
    assert any("is not one fmoe-local made" in s for s in said) and any("~/.zprofile" in s for s in said)


def test_windows_command_calls_the_batch_launcher_and_joins_the_user_path_once(tmp_path: Path):
    repo, data = tmp_path / "repo", tmp_path / "AppData/Local/fmoe-local"
    [cmd] = bootstrap.shortcuts.plan("Windows", repo, tmp_path, data, {})
    assert cmd.path == data / "bin/fmoe-local.cmd"
    assert cmd.text.endswith(f'call "{repo / "installers/windows/fmoe-local.bat"}" %*\r\n')
    assert bootstrap.shortcuts.MARKER in cmd.text and "\n" not in cmd.text.replace("\r\n", "")
    folder = data / "bin"
    assert bootstrap.shortcuts.windows_path_with(folder, "C:\\Tools;") == f"C:\\Tools;{folder}"
    assert bootstrap.shortcuts.windows_path_with(folder, f"C:\\Tools;{folder}") is None


@pytest.mark.skipif(os.name == "nt", reason="the fake interpreter is a symlink to this one")
def test_the_launcher_makes_them_after_a_successful_smoke_start_only(home: Path, tmp_path: Path, monkeypatch):
    venv = home / "venv"
    bootstrap.venv_python(venv).parent.mkdir(parents=True)
    bootstrap.venv_python(venv).symlink_to(sys.executable)
    wanted = plan.decide(bootstrap.probe(home), plan.read_project(REPO), None, False, False, home).stamp
    (venv / bootstrap.STAMP_NAME).write_text(json.dumps(dict(wanted, torch_cuda="")))
    entry = home.parent / "applications/fmoe-local.desktop"

    def fails(*args, **kwargs):
        raise plan.BootstrapError("The app exited with code 4 before it answered.")

    monkeypatch.setattr(bootstrap, "smoke", fails)
    assert bootstrap.main(["--smoke"]) == 1
    assert not entry.exists() and not (tmp_path / ".local/bin/fmoe-local").exists()
    monkeypatch.setattr(bootstrap, "smoke", lambda *args, **kwargs: None)
    assert bootstrap.main(["--smoke"]) == 0
    assert entry.is_file() and os.access(tmp_path / ".local/bin/fmoe-local", os.X_OK)
    assert "Added fmoe-local to your applications menu" in (home / "logs/launcher.log").read_text()


@pytest.mark.slow
def test_torch_that_cannot_be_installed_leaves_no_stamp_and_says_what_to_do(
    project: plan.Project, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # No index and an empty wheelhouse: pip fails the way it does offline or on a Python without torch builds.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    decision = plan.decide(probes(), project, None, False, False, tmp_path)
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib/left-over-from-a-broken-install").write_text("")
    log = bootstrap.Log(home / "logs/launcher.log")
    with pytest.raises(plan.BootstrapError) as err:
        bootstrap.install(venv, decision, project, log)
    assert "torch==2.13.0" in str(err.value) and "--repair" in str(err.value)
    assert "ERROR: " in log.path.read_text()  # pip's own explanation is kept for whoever reads the log
    assert bootstrap.venv_python(venv).exists() and not (venv / bootstrap.STAMP_NAME).exists()
    assert not (venv / "lib/left-over-from-a-broken-install").exists()  # an install (and --repair) starts clean
    # So the next start knows the install did not finish.
    assert plan.decide(probes(), project, None, True, False, tmp_path).why.startswith("the last install did not")


def test_a_second_launcher_logs_on_its_own_when_the_first_log_cannot_be_moved(home: Path, monkeypatch):
    first = bootstrap.Log(home / "logs/launcher.log")
    first.say("the first launcher runs the app")

    def held_open(self, target):  # Windows: renaming a file another process has open fails
        raise PermissionError(32, "The process cannot access the file because it is being used by another process")

    monkeypatch.setattr(Path, "replace", held_open)
    second = bootstrap.Log(home / "logs/launcher.log")  # before: PermissionError, a traceback, no launcher
    second.say("a second double-click")
    assert second.path.name == f"launcher.{os.getpid()}.log" and "a second double-click" in second.path.read_text()
    assert "the first launcher runs the app" in (home / "logs/launcher.log").read_text()


def test_behind_a_proxy_the_pytorch_index_counts_as_reachable(monkeypatch):
    def no_direct_route(*args, **kwargs):
        raise OSError(101, "Network is unreachable")  # a corporate network: only the proxy gets out

    monkeypatch.setattr(bootstrap.socket, "create_connection", no_direct_route)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert not bootstrap.reachable("https://download.pytorch.org/whl/cu128")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    # pip goes through the proxy: before, the CUDA index was dropped and an NVIDIA user got a CPU-only PyTorch
    assert bootstrap.reachable("https://download.pytorch.org/whl/cu128")
