"""The one bootstrap behind the double-click launchers (windows/, macos/, linux/): install once, then start the app.

Scope: probe the machine, let install_plan.py decide (Python, disk space, PyTorch build and why, stamp), create the
venv in the per-user data dir, install the project into it, record a stamp so later runs start in seconds, then run
app.py. `--repair` rebuilds the venv; `--smoke` starts the app headless on a free port, waits until it answers on
127.0.0.1, stops it and exits 0 (tests and CI). Standard library only: it runs before any venv exists, and it parses
on old Pythons so that it can say "too old" instead of crashing.
It does NOT: download models, configure the app (unknown arguments are passed through to app.py), open the browser
(the app does), or change anything outside the data dir but the menu entry and the `fmoe-local` command that
shortcuts.py makes on the first start whose environment is ready.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections import deque
from contextlib import contextmanager
from pathlib import Path

# Run as a script (the launchers) or imported by tests: either way its sibling module must be importable.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import shortcuts  # noqa: E402
from install_plan import (  # noqa: E402
    APP_NAME,
    BootstrapError,
    Decision,
    Probes,
    Project,
    cpu_instead_of_cuda,
    data_dir,
    decide,
    read_project,
    torch_install_args,
)

REPO = Path(__file__).resolve().parent.parent
STAMP_NAME = "fmoe-local-install.json"


def probe(where: Path) -> Probes:
    smi = shutil.which("nvidia-smi")
    out = None
    if smi:
        try:
            out = subprocess.run([smi], capture_output=True, text=True, timeout=20).stdout or None
        except (OSError, subprocess.SubprocessError):
            out = None
    existing = where
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    has_venv = all(importlib.util.find_spec(m) is not None for m in ("venv", "ensurepip"))
    free = shutil.disk_usage(str(existing)).free
    return Probes(platform.system(), platform.machine(), tuple(sys.version_info[:3]), out, free, has_venv)


def reachable(url: str, timeout: float = 3.0) -> bool:
    """Can we open a TCP connection to the index host? Avoids pip's slow retries against an unreachable index.
    Behind a proxy (HTTPS_PROXY and the like) a direct connection fails although pip, which uses the proxy, gets
    through: then the index is taken as reachable rather than silently swapped for a CPU-only PyTorch."""
    if urllib.request.getproxies().get("https"):
        return True
    host = re.sub(r"^https?://", "", url).split("/", 1)[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


class Log:
    """Progress lines on the console, everything (pip and app output included) in the log file."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            try:
                path.replace(path.with_name(path.stem + ".previous.log"))
            except OSError:
                # Windows refuses to rename a file another launcher still has open (a second double-click while
                # the app runs): this launcher writes a log of its own instead of stopping with a traceback.
                path = path.with_name(f"{path.stem}.{os.getpid()}.log")
        self.path = path
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the launcher

    def say(self, message: str) -> None:
        print(f"[{APP_NAME}] {message}", flush=True)
        self.write(message)

    def write(self, message: str) -> None:
        self.file.write(f"{time.strftime('%H:%M:%S')} {message}\n")
        self.file.flush()

    def run(self, cmd: list, progress=None) -> None:
        """Run a command with its output in the log; `progress(line)` picks what the console sees."""
        self.write("$ " + " ".join(str(c) for c in cmd))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        tail = deque(maxlen=12)
        for line in proc.stdout:
            self.file.write(line)
            tail.append(line.rstrip())
            shown = progress(line.strip()) if progress else None
            if shown:
                print("    " + shown, flush=True)
        self.file.flush()
        if proc.wait() != 0:
            print("\n".join("    | " + t for t in tail), flush=True)
            raise BootstrapError(f"This step failed: {' '.join(str(c) for c in cmd[:6])} ...")


def pip_progress(line: str) -> str | None:
    """The few pip lines worth showing: direct dependencies, big downloads, the long unpack, the end."""
    if line.startswith("Collecting") and "->" not in line:
        return line.split(" (from")[0]
    if line.startswith("Downloading") and re.search(r"\(\d[\d.]* [MG]B\)", line):
        return "Downloading " + line[len("Downloading ") :].rsplit("/", 1)[-1]
    if line.startswith("Installing collected packages:"):
        count = len(line.split(":", 1)[1].split(","))
        return f"Unpacking {count} packages (the slowest part; the window may look idle)..."
    if line.startswith("Successfully installed"):
        return f"Done: {len(line.split()) - 2} packages installed."
    return None


@contextmanager
def install_lock(path: Path):
    """Held while installing, so a second double-click cannot delete the venv under a running install. An OS lock:
    the system releases it when the holder dies, so a crashed install never leaves a stale lock behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")  # noqa: SIM115 - closed in finally, which also releases the lock
    try:
        if os.name == "nt":
            import msvcrt

            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        else:
            import fcntl

            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise BootstrapError(
            "Another fmoe-local launcher is installing right now. Let it finish (it starts the app when done); "
            "this window can be closed."
        ) from None
    try:
        yield
    finally:
        handle.close()


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def install(venv: Path, decision: Decision, project: Project, log: Log) -> None:
    started = time.monotonic()
    if venv.exists():
        log.say(f"Removing the old environment at {venv}")
        shutil.rmtree(venv)
    log.say(f"Creating the Python environment in {venv}")
    log.run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv_python(venv))
    pip = [python, "-m", "pip", "install", "--progress-bar", "off", "--disable-pip-version-check"]
    plan = decision.torch
    index_ok = plan.index_url is None or reachable(plan.index_url)
    if not index_ok:
        log.say(f"Cannot reach {plan.index_url}; trying the default package index and local wheels for PyTorch.")
        if plan.build != "cpu":
            log.say("If that gives you a CPU-only PyTorch, run the launcher with --repair once you are online.")
    log.say(f"Installing PyTorch ({project.torch_pin or 'torch'}, {plan.build} build). This can take several minutes.")
    try:
        log.run(pip + torch_install_args(plan, project, index_ok), progress=pip_progress)
    except BootstrapError as err:
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        raise BootstrapError(
            f"{err} PyTorch ({project.torch_pin or 'torch'}) could not be installed: either the download failed "
            f"(check the internet connection) or there is no such build for Python {version} on this machine (then "
            "install Python 3.11 and run the launcher again with --repair)."
        ) from err
    log.say("Installing fmoe-local and its libraries.")
    constraints = ["-c", str(project.root / "constraints.txt")] if (project.root / "constraints.txt").is_file() else []
    log.run(pip + ["-e", str(project.root)] + constraints, progress=pip_progress)
    write_stamp(venv, decision, log)
    log.say(f"Installed in {time.monotonic() - started:.0f} s.")


def installed_torch_cuda(venv: Path) -> str | None:
    """The CUDA version the environment's PyTorch was built for ("" for a CPU-only build; None if it cannot say)."""
    code = "import sys, torch; sys.stdout.write(torch.version.cuda or '')"
    try:
        done = subprocess.run([str(venv_python(venv)), "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def write_stamp(venv: Path, decision: Decision, log: Log) -> None:
    """Record the install, with the PyTorch build pip really installed: where the CUDA index could not be reached
    pip may fall back to a CPU-only wheel, and the next start must know to try the CUDA build again."""
    stamp = dict(decision.stamp, torch_cuda=installed_torch_cuda(venv))
    if cpu_instead_of_cuda(decision.torch, stamp):
        log.say(
            f"PyTorch was installed without GPU support (the {decision.torch.build} build could not be downloaded): "
            "fmoe-local runs on the CPU for now, and the next start tries the GPU build again."
        )
    (venv / STAMP_NAME).write_text(json.dumps(stamp, indent=2), encoding="utf-8")


def retry_cuda(venv: Path, decision: Decision, project: Project, log: Log) -> None:
    """Swap a CPU-only PyTorch for the planned CUDA build when its index answers; on any failure keep the working
    CPU environment (pip restores what it uninstalled) and say so."""
    plan = decision.torch
    if not (plan.index_url and project.torch_pin and "==" in project.torch_pin and reachable(plan.index_url)):
        log.say(
            f"Starting on the CPU: {plan.index_url or 'the PyTorch index'} cannot be reached for the GPU build. The "
            "next start tries again, or run the launcher with --repair when online."
        )
        return
    log.say(f"Installing the {plan.build} build of PyTorch so that the NVIDIA GPU is used. This can take minutes.")
    cmd = [str(venv_python(venv)), "-m", "pip", "install", "--progress-bar", "off", "--disable-pip-version-check"]
    cmd += [f"{project.torch_pin}+{plan.build}", "--extra-index-url", plan.index_url]
    try:
        log.run(cmd, progress=pip_progress)
    except BootstrapError as err:
        log.say(f"{err} Starting on the CPU build; the next start tries again.")
        return
    write_stamp(venv, decision, log)


def app_env() -> dict:
    env = dict(os.environ)
    env.update(GRADIO_ANALYTICS_ENABLED="False", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def smoke(venv: Path, project: Project, log: Log, timeout: float) -> None:
    """Start the app headless, wait for an HTTP answer on 127.0.0.1, stop it."""
    port = free_port()
    home = tempfile.mkdtemp(prefix="fmoe-local-smoke-")
    cmd = [
        str(venv_python(venv)),
        str(project.root / "app.py"),
        "--no-browser",
        "--port",
        str(port),
        "--data-dir",
        home,
    ]
    log.say(f"Smoke test: starting the app on http://127.0.0.1:{port} (data in {home})")
    log.write("$ " + " ".join(cmd))
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(project.root), env=app_env(), stdout=log.file, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise BootstrapError(f"The app exited with code {proc.returncode} before it answered.")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as reply:
                    status = reply.status
                break
            except urllib.error.HTTPError as err:  # an HTTP error page still proves the server is up
                status = err.code
                break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - started > timeout:
                raise BootstrapError(f"The app did not answer on port {port} within {timeout:.0f} s.")
            time.sleep(0.5)
        log.say(f"Smoke test passed: HTTP {status} after {time.monotonic() - started:.1f} s.")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(home, ignore_errors=True)


def add_shortcuts(system: str, where: Path, log: Log) -> None:
    """The menu entry and the `fmoe-local` command, on the first start whose environment is ready (shortcuts.py).
    A failure here is said and the start goes on: the app runs without them."""
    try:
        for line in shortcuts.install(system, REPO, Path.home(), where, dict(os.environ)):
            log.say(line)
    except OSError as err:
        log.say(f"Could not add the menu entry or the fmoe-local command ({err}); the app starts anyway.")


def parse_args(argv: list) -> tuple:
    parser = argparse.ArgumentParser(
        prog=APP_NAME, description="Install fmoe-local on first use, then start it. Other arguments go to app.py."
    )
    parser.add_argument("--repair", action="store_true", help="delete and rebuild the Python environment")
    parser.add_argument("--smoke", action="store_true", help="install or reuse, start headless, check it answers, stop")
    parser.add_argument("--smoke-timeout", type=float, default=300.0, help="seconds to wait for the app to answer")
    parser.add_argument("--plan", action="store_true", help="print what would be installed and why, then exit")
    return parser.parse_known_args(argv)


def main(argv: list | None = None) -> int:
    args, app_args = parse_args(sys.argv[1:] if argv is None else argv)
    # A Windows console or a pipe may not be UTF-8: a path with odd characters must not crash the launcher.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    where = data_dir(platform.system(), dict(os.environ), Path.home())
    log = Log(where / "logs" / "launcher.log")
    venv = where / "venv"
    try:
        probes = probe(where)
        project = read_project(REPO)
        stamp_file = venv / STAMP_NAME
        stamp = json.loads(stamp_file.read_text(encoding="utf-8")) if stamp_file.is_file() else None
        decision = decide(probes, project, stamp, venv_python(venv).exists(), args.repair, where)
        log.say(f"PyTorch: {decision.torch.reason}")
        log.say(("Install needed: " if decision.install else "Environment ") + decision.why)
        if args.plan:
            return 0
        if decision.install:
            with install_lock(where / "install.lock"):
                install(venv, decision, project, log)
        elif decision.retry_cuda:
            with install_lock(where / "install.lock"):
                retry_cuda(venv, decision, project, log)
        if args.smoke:
            smoke(venv, project, log, args.smoke_timeout)
            add_shortcuts(probes.system, where, log)
            return 0
        add_shortcuts(probes.system, where, log)
        if app_args[:1] in (["run"], ["bench"]):  # the command line's tools (`fmoe-local run ...`): no browser
            log.write(f"Running app.py {' '.join(app_args[:1])}")
        else:
            log.say("Starting fmoe-local; your browser opens when it is ready. Close this window to stop it.")
        proc = subprocess.Popen([str(venv_python(venv)), str(REPO / "app.py")] + app_args, cwd=str(REPO), env=app_env())
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            code = proc.wait()
        if code not in (0, -2, 130):
            log.say(f"fmoe-local stopped with exit code {code}; its messages are above. Launcher log: {log.path}")
        return code
    except BootstrapError as err:
        log.say(str(err))
        print(f"[{APP_NAME}] The full log is at {log.path}", flush=True)
        return 1
    except KeyboardInterrupt:
        log.say("Interrupted. The next run finishes whatever was left undone.")
        return 130
    except Exception as err:  # anything unexpected: still point at the log instead of a bare traceback
        log.write(traceback.format_exc())
        print(f"[{APP_NAME}] Something went wrong: {err}. The full log is at {log.path}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
