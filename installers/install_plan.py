"""What the launcher should do, decided from probed facts: the pure half of the bootstrap (see bootstrap.py).

Scope: the data dir per OS, the Python version check, which PyTorch build (CUDA tag / MPS / CPU) and why, the disk
space check, the install stamp and whether it is stale, and the pip arguments for torch. Inputs are plain values
(`Probes`), so every decision is testable with faked probes. Standard library only, and it parses on old Pythons.
It does NOT: run commands, touch the network or write files (`read_project` only reads two files).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

APP_NAME = "fmoe-local"
MIN_PYTHON = (3, 10)
PYTORCH_INDEX = "https://download.pytorch.org/whl"
# Newest CUDA build first; a build runs when the driver supports at least its CUDA version. These are the CUDA
# builds PyTorch has published since 2.9 (cu126, cu128, cu130); revisit when the torch pin in constraints.txt moves.
CUDA_BUILDS = (((13, 0), "cu130"), ((12, 8), "cu128"), ((12, 6), "cu126"))
# Disk needed by one install (venv + pip's download cache), in GB: the CUDA wheels bring ~4 GB of NVIDIA libraries.
NEEDED_GB = {"cuda": 10.0, "cpu": 4.0, "mps": 4.0}
PYTHON_HELP = {
    "Windows": 'Install Python 3.11 from https://www.python.org/downloads/windows/ (tick "Add python.exe to PATH"), '
    "then double-click fmoe-local.bat again.",
    "Darwin": "Install Python 3.11 from https://www.python.org/downloads/macos/ (or run: brew install python@3.11), "
    "then double-click fmoe-local.command again.",
    "Linux": "Install Python 3.11 with your package manager (Debian/Ubuntu: sudo apt install python3.11 python3.11-venv; "
    "Fedora: sudo dnf install python3.11), then run fmoe-local.sh again.",
}


class BootstrapError(Exception):
    """A problem the user can fix; the message says how."""


@dataclass(frozen=True)
class Probes:
    """What the decisions depend on, gathered once by `probe()` and faked in tests."""

    system: str  # platform.system(): Linux, Darwin, Windows
    machine: str  # platform.machine(): x86_64, arm64, AMD64
    python: tuple  # (major, minor, micro) of the interpreter that will create the venv
    nvidia_smi: str | None  # stdout of `nvidia-smi`; None when it is missing or fails
    free_bytes: int  # free space where the venv goes
    has_venv: bool = True  # `venv` + `ensurepip` importable (Debian splits them into python3.x-venv)


@dataclass(frozen=True)
class TorchPlan:
    build: str  # "cpu", "mps" or a CUDA tag such as "cu128"
    index_url: str | None  # extra index holding that build; None = the default index (PyPI)
    reason: str  # one sentence for the user


@dataclass(frozen=True)
class Project:
    root: Path
    version: str
    fingerprint: str  # sha256 of pyproject.toml + constraints.txt: a dependency change means reinstall
    torch_pin: str | None  # e.g. "torch==2.13.0" from constraints.txt


@dataclass(frozen=True)
class Decision:
    install: bool
    why: str
    torch: TorchPlan
    stamp: dict
    # The environment is up to date but holds a CPU-only PyTorch where a CUDA build was planned (its index could not
    # be reached when it was installed): the launcher tries the CUDA build again when the index answers.
    retry_cuda: bool = False


# ---- decisions (pure: probes in, verdict out) ----


def data_dir(system: str, env: dict, home: Path) -> Path:
    """Where per-user data lives, as platformdirs would put it (the venv and logs go inside)."""
    if system == "Windows":
        base = env.get("LOCALAPPDATA") or str(home / "AppData" / "Local")
        return Path(base) / APP_NAME
    if system == "Darwin":
        return home / "Library" / "Application Support" / APP_NAME
    xdg = env.get("XDG_DATA_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else home / ".local" / "share") / APP_NAME


def python_problem(version: tuple, system: str) -> str | None:
    if tuple(version[:2]) >= MIN_PYTHON:
        return None
    found = ".".join(str(v) for v in version[:3])
    return f"fmoe-local needs Python 3.10 or newer, but this is Python {found}. " + PYTHON_HELP.get(
        system, PYTHON_HELP["Linux"]
    )


def driver_cuda_version(nvidia_smi: str | None) -> tuple | None:
    """The newest CUDA version the installed driver supports, from nvidia-smi's header."""
    match = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", nvidia_smi or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def choose_torch(system: str, machine: str, nvidia_smi: str | None) -> TorchPlan:
    if system == "Darwin":
        if machine not in ("arm64", "aarch64"):
            raise BootstrapError(
                "This Mac (or this Python, if it runs under Rosetta) is Intel x86_64; PyTorch stopped publishing "
                "builds for Intel Macs after 2.2, so fmoe-local needs an Apple Silicon Mac (M1 or newer) and the "
                "Apple Silicon or universal2 Python from https://www.python.org/downloads/macos/."
            )
        return TorchPlan(
            "mps",
            None,
            (
                "Apple Silicon Mac: the standard PyTorch build; fmoe-local runs models on the CPU there (its GPU path is "
                "CUDA only for now)."
            ),
        )
    if nvidia_smi is None:
        return TorchPlan(
            "cpu", f"{PYTORCH_INDEX}/cpu", "No NVIDIA GPU found (no nvidia-smi): the CPU build of PyTorch."
        )
    cuda = driver_cuda_version(nvidia_smi)
    gpu = re.search(r"\|\s+\d+\s+(NVIDIA [^|]*?|Tesla [^|]*?|Quadro [^|]*?)\s{2,}", nvidia_smi)
    name = gpu.group(1).strip() if gpu else "an NVIDIA GPU"
    if cuda is None:
        return TorchPlan(
            "cpu", f"{PYTORCH_INDEX}/cpu", f"Found {name} but nvidia-smi reports no CUDA version: CPU build."
        )
    for needed, tag in CUDA_BUILDS:
        if cuda >= needed:
            return TorchPlan(
                tag,
                f"{PYTORCH_INDEX}/{tag}",
                f"Found {name}; its driver supports CUDA {cuda[0]}.{cuda[1]}, so the {tag} build of PyTorch.",
            )
    oldest = CUDA_BUILDS[-1][0]
    return TorchPlan(
        "cpu",
        f"{PYTORCH_INDEX}/cpu",
        f"Found {name}, but its driver only supports CUDA {cuda[0]}.{cuda[1]} and PyTorch needs {oldest[0]}.{oldest[1]}: "
        "the CPU build for now. Update the NVIDIA driver and run the launcher with --repair to use the GPU.",
    )


def disk_problem(free_bytes: int, plan: TorchPlan, where: Path) -> str | None:
    kind = "cuda" if plan.build.startswith("cu") else plan.build
    needed = NEEDED_GB[kind]
    if free_bytes >= needed * 1e9:
        return None
    return (
        f"Not enough disk space to install: {free_bytes / 1e9:.1f} GB free on the drive of {where}, and installing "
        f"needs about {needed:.0f} GB. Free some space and run the launcher again."
    )


def wanted_stamp(project: Project, plan: TorchPlan, python: tuple) -> dict:
    return {
        "project_version": project.version,
        "fingerprint": project.fingerprint,
        "torch_build": plan.build,
        "python": f"{python[0]}.{python[1]}",
        "repo": str(project.root),
    }


def cpu_instead_of_cuda(plan: TorchPlan, stamp: dict) -> bool:
    """A CUDA build was planned but the install recorded PyTorch without CUDA (`torch_cuda` "": pip fell back to a
    CPU wheel). Stamps from before this key existed say nothing, and are taken as they are."""
    return plan.build.startswith("cu") and stamp.get("torch_cuda") == ""


def decide(probes: Probes, project: Project, stamp: dict | None, venv_ok: bool, repair: bool, where: Path) -> Decision:
    """Whether to (re)install and why; raises BootstrapError when it cannot go on."""
    problem = python_problem(probes.python, probes.system)
    if problem:
        raise BootstrapError(problem)
    if not probes.has_venv:
        v = f"{probes.python[0]}.{probes.python[1]}"
        raise BootstrapError(
            f"This Python cannot create virtual environments (its venv/ensurepip part is missing). On Debian/Ubuntu "
            f"run: sudo apt install python{v}-venv, then run the launcher again."
        )
    plan = choose_torch(probes.system, probes.machine, probes.nvidia_smi)
    wanted = wanted_stamp(project, plan, probes.python)
    if repair:
        why = "--repair: rebuilding the environment from scratch."
    elif not venv_ok:
        why = "first run: creating the environment."
    elif stamp is None:
        why = "the last install did not finish: installing again."
    elif any(stamp.get(k) != wanted[k] for k in wanted):
        changed = sorted(k for k in wanted if stamp.get(k) != wanted[k])
        why = (
            "installed copy is out of date (" + ", ".join(f"{k}: {stamp.get(k)} -> {wanted[k]}" for k in changed) + ")."
        )
    elif cpu_instead_of_cuda(plan, stamp):
        return Decision(
            False,
            f"up to date (version {project.version}), but PyTorch is the CPU build: the {plan.build} build could not "
            "be downloaded when it was installed, so the NVIDIA GPU is not used yet.",
            plan,
            stamp,
            retry_cuda=True,
        )
    else:
        return Decision(False, f"up to date (version {project.version}, torch build {plan.build}).", plan, stamp)
    problem = disk_problem(probes.free_bytes, plan, where)
    if problem:
        raise BootstrapError(problem)
    return Decision(True, why, plan, wanted)


def torch_install_args(plan: TorchPlan, project: Project, index_reachable: bool) -> list:
    """pip arguments for the torch step. The version comes from the project's constraints file only, so that the pin
    lives in one place."""
    args = ["torch"]
    if (project.root / "constraints.txt").is_file():
        args += ["-c", str(project.root / "constraints.txt")]
    # An extra index (not --index-url) keeps the user's own mirror and PIP_FIND_LINKS in play; pip prefers the
    # build-tagged wheel (2.13.0+cpu > 2.13.0) so the plain PyPI wheel (CUDA on Linux, GBs) is not picked.
    if plan.index_url and index_reachable:
        args += ["--extra-index-url", plan.index_url]
    return args


def read_project(root: Path) -> Project:
    pyproject = (root / "pyproject.toml").read_bytes()
    constraints = root / "constraints.txt"
    pins = constraints.read_bytes() if constraints.is_file() else b""
    text = pyproject.decode("utf-8")
    section = text.split("[project]", 1)[-1]
    match = re.search(r'^version\s*=\s*"([^"]+)"', section, re.MULTILINE)
    torch_pin = re.search(r"^(torch\s*[=<>!~][^\s#]*)", pins.decode("utf-8"), re.MULTILINE)
    return Project(
        root=root,
        version=match.group(1) if match else "unknown",
        fingerprint=hashlib.sha256(pyproject + b"\0" + pins).hexdigest(),
        torch_pin=torch_pin.group(1).replace(" ", "") if torch_pin else None,
    )
