"""What the launcher tests share: the installers' two modules imported as the launchers run them, a faked machine
(`probes`, nvidia-smi's header) and a project folder with a pinned torch."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "installers"))
plan = importlib.import_module("install_plan")
bootstrap = importlib.import_module("bootstrap")

# The header nvidia-smi prints (trimmed), as on a real H100 machine; only the CUDA version varies between tests.
SMI = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 560.35.03              Driver Version: 560.35.03      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|=========================================+========================+======================|
|   0  NVIDIA H100 80GB HBM3          On  |   00000000:18:00.0 Off |                    0 |
+-----------------------------------------+------------------------+----------------------+
"""
GB = 1_000_000_000


def probes(**changes) -> plan.Probes:
    base = dict(system="Linux", machine="x86_64", python=(3, 11, 7), nvidia_smi=None, free_bytes=100 * GB)
    base.update(changes)
    return plan.Probes(**base)


def make_project(folder: Path) -> plan.Project:
    (folder / "pyproject.toml").write_text('[project]\nname = "fmoe-local"\nversion = "0.3.1"\n')
    (folder / "constraints.txt").write_text("# tested pin\ntorch==2.13.0\n")
    return plan.read_project(folder)
