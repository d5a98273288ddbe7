"""Shared pytest fixtures: tiny MoE checkpoints built once per session.

Scope: caching of tests/tiny.py builds. It does NOT load models (each test loads what it needs, through the path
it tests).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# One torch thread, here and in the apps and commands the tests start (they inherit the environment): the tiny
# models gain nothing from a second one, and on a busy 2-core machine two OpenMP threads spin-wait on each other,
# which made CPU-bound tests two to three times slower (docs/bench.md, "Test suite"). OMP_NUM_THREADS=2 undoes it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import ui  # noqa: E402, F401 - before a test module imports gradio: it then skips its type stubs (ui/gradio_import.py)
from tests.tiny import FAMILIES, build_tiny_model  # noqa: E402


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """What `-n auto` (pyproject's addopts) means: a worker per CPU, at most 2, for the suite or a folder; none when
    only files or tests are named. Each worker imports torch, transformers and gradio and collects its tests before
    the first one runs (about 10 s of CPU), more than most single files take. PYTEST_XDIST_AUTO_NUM_WORKERS (read by
    xdist itself) or an explicit `-n N` still decides."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    named = [arg.split("::", 1)[0] for arg in config.args]
    if named and all(Path(arg).is_file() for arg in named):
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # 2 is what was measured (a 2-core machine); more workers also mean more memory (~2 GB each at their peak).
    return min(cpus, 2) if cpus > 1 else 0


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `tiny_model_dir(family, dtype=torch.float32, sharded=False, seed=0, tied=False) -> Path`.

    Each distinct build is made once per session; treat the directory as read-only.
    """
    built: dict[tuple, Path] = {}

    def get(
        family: str, *, dtype: torch.dtype = torch.float32, sharded: bool = False, seed: int = 0, tied: bool = False
    ) -> Path:
        if family not in FAMILIES:
            raise ValueError(f"Unknown tiny family '{family}'. Choose one of: {', '.join(FAMILIES)}.")
        key = (family, dtype, sharded, seed, tied)
        if key not in built:
            name = f"{family}-{str(dtype).removeprefix('torch.')}-{'sharded' if sharded else 'single'}-{seed}"
            name += "-tied" if tied else ""
            out = tmp_path_factory.mktemp(name)
            built[key] = build_tiny_model(family, out, dtype=dtype, sharded=sharded, seed=seed, tied=tied)
        return built[key]

    return get


@pytest.fixture
def ui_session(tmp_path: Path):  # noqa: ANN201 - a generator of ui.session.Session, imported here only when used
    """A UI session on a fresh store with nothing loaded; its quantised copies go under tmp_path."""
    from fmoe_local.config import RuntimeConfig
    from store import open_store
    from ui.session import Session

    store = open_store(tmp_path)
    s = Session(store=store, config=RuntimeConfig(device="cpu", quant_cache_dir=str(tmp_path / "quantized")))
    yield s
    s.close()
    store.close()
