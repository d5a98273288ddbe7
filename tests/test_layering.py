"""The house rules on imports, checked on the source: the runtime (fmoe_local) never imports the UI, the store or
SQLite, nor bitsandbytes (a test-only dependency: the app does not install it), and nothing in it but the command
line's `bench` dispatch imports the benchmarks."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "fmoe_local"
FORBIDDEN = ("gradio", "sqlite3", "sqlite_utils", "store", "ui", "bitsandbytes")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def test_the_runtime_never_imports_the_ui_the_store_sqlite_or_bitsandbytes():
    offenders = {
        str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.split(".")[0] in FORBIDDEN) for p in _modules()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_nothing_in_the_runtime_imports_the_benchmarks():
    outside = [p for p in _modules() if p.relative_to(ROOT).parts[0] not in ("bench", "cli.py")]
    offenders = {
        str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.startswith("fmoe_local.bench")) for p in outside
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_offload_state_has_one_owner():
    """The cache, the prefetcher, the miss planner and the host experts are wired together in offload.py only; the
    forward pass's experts implementation reaches them through the Offload (DESIGN.md, "One owner")."""
    owned = {
        "fmoe_local.prefetcher.Prefetcher",
        "fmoe_local.miss_cost.MissPlanner",
        "fmoe_local.cpu_experts.HostExperts",
    }
    runtime = [p for p in _modules() if p.relative_to(ROOT).parts[0] != "bench" and p.name != "offload.py"]
    offenders = {str(p.relative_to(ROOT)): sorted(_imports(p) & owned) for p in runtime}
    assert {k: v for k, v in offenders.items() if v} == {}
    forward = _imports(ROOT / "experts.py")
    assert not {m for m in forward if m.split(".")[:2] in (["fmoe_local", "cache"], ["fmoe_local", "prefetcher"])}


def test_the_ui_never_reaches_into_the_runtime_s_engine():
    """`Runtime.engine` belongs to the runtime's worker thread; tests and benchmarks may inspect it, the UI uses what
    Runtime offers (submit, info, check, reconfigure, …): no `.engine` attribute anywhere in ui/ or app.py."""
    top = ROOT.parent
    sources = sorted((top / "ui").rglob("*.py")) + [top / "app.py"]
    offenders = {
        str(p.relative_to(top))
        for p in sources
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and node.attr in ("engine", "_engine")
    }
    assert offenders == set()
