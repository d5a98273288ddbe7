"""The launcher bootstrap's effects that run without installing anything (installers/bootstrap.py): failing steps,
the smoke check, the stamp it writes and the CUDA build it retries, the menu entry."""

from __future__ import annotations

import json
import os
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


def test_desktop_entry_points_at_the_launcher(tmp_path: Path):
    template = REPO / "installers/linux/fmoe-local.desktop"
    launcher = REPO / "installers/linux/fmoe-local.sh"
    entry = bootstrap.install_desktop_entry(template, launcher, tmp_path / "applications")
    lines = entry.read_text().splitlines()
    assert f'Exec="{launcher}"' in lines and "Terminal=true" in lines
    assert "@LAUNCHER@" not in entry.read_text()


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
