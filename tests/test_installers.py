"""The per-OS launchers (installers/): which Python they pick, what they say when there is none, and the end-to-end
double-click path on Linux (`fmoe-local.sh --smoke` in a fresh HOME, twice: the second run must skip the install;
the first one leaves the menu entry and the `fmoe-local` command)."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINUX = REPO / "installers/linux/fmoe-local.sh"
MACOS = REPO / "installers/macos/fmoe-local.command"
WINDOWS = REPO / "installers/windows/fmoe-local.bat"
BASH = shutil.which("bash")
sys.path.insert(0, str(REPO / "installers"))
PYTHON_HELP = importlib.import_module("install_plan").PYTHON_HELP


def fake_bin(tmp_path: Path, pythons: dict[str, bool]) -> Path:
    """A PATH holding only `dirname` and fake interpreters; each records its arguments and passes the version check
    or not. They stand in for real Pythons so that the scripts' choice is observable."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    for name, new_enough in pythons.items():
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/calls"\nexit {0 if new_enough else 1}\n')
        script.chmod(0o755)
    return bin_dir


def run_launcher(launcher: Path, bin_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": str(bin_dir), "HOME": str(bin_dir.parent)}
    return subprocess.run([BASH, str(launcher), *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("launcher, system", [(LINUX, "Linux"), (MACOS, "Darwin")])
def test_no_python_says_exactly_what_to_install(tmp_path: Path, launcher: Path, system: str):
    result = run_launcher(launcher, fake_bin(tmp_path, {}))
    assert result.returncode == 1
    assert "needs Python 3.10 or newer, and none was found" in result.stdout
    assert PYTHON_HELP[system] in result.stdout  # the same sentence the bootstrap prints


@pytest.mark.parametrize("launcher", [LINUX, MACOS])
def test_too_old_pythons_are_passed_over(tmp_path: Path, launcher: Path):
    result = run_launcher(launcher, fake_bin(tmp_path, {"python3": False, "python3.9": False}))
    assert result.returncode == 1 and "none was found" in result.stdout
    # python3 was asked for its version and never handed the bootstrap.
    assert "bootstrap.py" not in (tmp_path / "calls").read_text()


@pytest.mark.parametrize("launcher", [LINUX, MACOS])
def test_prefers_python_3_11_and_passes_arguments_through(tmp_path: Path, launcher: Path):
    result = run_launcher(launcher, fake_bin(tmp_path, {"python3": True, "python3.11": True}), "--smoke", "--port", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    bootstrap = str(launcher.parent / "../bootstrap.py")
    assert calls[-1] == f"python3.11 {bootstrap} --smoke --port 1"
    assert not any(call.startswith("python3 ") for call in calls)


def test_windows_launcher_uses_py_launcher_keeps_crlf_and_the_same_message():
    raw = WINDOWS.read_bytes()
    assert raw.count(b"\r\n") == raw.count(b"\n")  # cmd.exe misparses LF-only batch files
    text = raw.decode()
    assert "py -%%V" in text and "(3.11 3.12 3.13 3.10)" in text
    # then any newer Python the py launcher knows (python.org's installer leaves "Add to PATH" unticked)
    assert text.index('set "PY=python"') < text.index('set "PY=py -3"') < text.index("goto :nopython")
    assert '"BOOTSTRAP=%~dp0..\\bootstrap.py"' in text and '%PY% "%BOOTSTRAP%" %*' in text
    assert PYTHON_HELP["Windows"] in text


def test_launchers_are_executable_and_the_desktop_file_is_a_template():
    for launcher in (LINUX, MACOS):
        assert os.access(launcher, os.X_OK), f"{launcher} must be executable to be double-clicked"
    desktop = (REPO / "installers/linux/fmoe-local.desktop").read_text().splitlines()
    assert desktop[0] == "[Desktop Entry]" and 'Exec="@LAUNCHER@"' in desktop and "Terminal=true" in desktop


# ---- end to end: the real install, then the fast path ----


def smoke_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "VIRTUAL_ENV", "PYTHONPATH"))}
    # The real user's pip cache keeps the fresh-HOME install from downloading everything again.
    env["PIP_CACHE_DIR"] = os.environ.get("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))
    env["HOME"] = str(home)
    return env


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two full installs into a fresh environment
@pytest.mark.installer
def test_linux_launcher_smoke_installs_once_then_starts_fast(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    data = home / ".local/share/fmoe-local"
    timings = []
    for _ in range(2):
        started = time.monotonic()
        result = subprocess.run(
            [str(LINUX), "--smoke"], env=smoke_env(home), capture_output=True, text=True, timeout=1500, cwd=tmp_path
        )
        timings.append(time.monotonic() - started)
        log = (data / "logs/launcher.log").read_text()
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:] + log[-4000:]
        assert "Smoke test passed" in result.stdout
        if len(timings) == 1:
            assert "Install needed: first run" in log and "Installing PyTorch" in log
            stamp = data / "venv/fmoe-local-install.json"
            stamp_written = stamp.stat().st_mtime_ns
            torch_version = subprocess.run(
                [str(data / "venv/bin/python"), "-c", "import torch; print(torch.__version__)"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            pin = next(line for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("torch"))
            assert torch_version.split("+")[0] == pin.split("==")[1]
            if shutil.which("nvidia-smi") is None:
                assert torch_version.endswith("+cpu"), "no GPU here: the CPU build must be installed"
            # The first successful start made the menu entry and the command on PATH, pointing at this checkout.
            entry = home / ".local/share/applications/fmoe-local.desktop"
            assert f'Exec="{LINUX}"' in entry.read_text() and "Added fmoe-local to your applications menu" in log
            command = home / ".local/bin/fmoe-local"
            assert os.access(command, os.X_OK) and "Added the fmoe-local command" in log
    # The command runs the launcher from anywhere, arguments passed through (here: the plan, fast and headless).
    planned = subprocess.run(
        ["fmoe-local", "--plan"],
        env=dict(smoke_env(home), PATH=f"{command.parent}{os.pathsep}{os.environ['PATH']}"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=home,
    )
    assert planned.returncode == 0 and "Environment up to date" in planned.stdout, planned.stdout + planned.stderr
    # The second start found the stamp, installed nothing and left the stamp untouched (and made no entry again).
    assert "Environment up to date" in log and "Installing" not in log and "Added fmoe-local" not in log
    assert stamp.stat().st_mtime_ns == stamp_written
    print(f"\nlauncher --smoke: first run (install + start) {timings[0]:.0f} s, second run {timings[1]:.0f} s")
    shutil.rmtree(home, ignore_errors=True)  # ~2 GB of venv; pytest would keep it in its last three tmp dirs
