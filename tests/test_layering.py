"""The house rules on imports, checked on the source: the runtime (fmoe_local) never imports the UI, the store or
SQLite, nor bitsandbytes (a test-only dependency: the app does not install it), nor the benchmarks and the demo's
trainer (fmoe_bench), nor the tests; the benchmarks never import the tests."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "fmoe_local"
FORBIDDEN = ("gradio", "sqlite3", "sqlite_utils", "store", "ui", "bitsandbytes", "fmoe_bench", "tests")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _modules(root: Path = ROOT) -> list[Path]:
    return sorted(root.rglob("*.py"))


def _offenders(root: Path, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {
        str(p.relative_to(root)): sorted(m for m in _imports(p) if m.split(".")[0] in forbidden) for p in _modules(root)
    }
    return {k: v for k, v in found.items() if v}


def test_the_runtime_never_imports_the_ui_the_store_sqlite_bitsandbytes_the_benchmarks_or_the_tests():
    assert len(_modules()) > 30  # the walk finds the runtime's modules, so an empty result means something
    assert _offenders(ROOT, FORBIDDEN) == {}


def test_the_benchmarks_never_import_the_ui_the_store_or_the_tests():
    """Tests take their fixtures from tests/ or fmoe_bench (tiny_families.py), never the reverse."""
    assert len(_modules(REPO / "fmoe_bench")) > 10
    assert _offenders(REPO / "fmoe_bench", ("gradio", "store", "ui", "tests")) == {}


def test_the_walk_sees_a_forbidden_import_however_it_is_written(tmp_path: Path):
    (tmp_path / "m.py").write_text("import fmoe_bench.cli\n\ndef f():\n    from fmoe_bench.replay import replay\n")
    assert _offenders(tmp_path, FORBIDDEN) == {
        "m.py": ["fmoe_bench.cli", "fmoe_bench.replay", "fmoe_bench.replay.replay"]
    }


def test_the_offload_state_has_one_owner():
    """The cache, the prefetcher, the miss planner and the host experts are wired together in offload.py only; the
    forward pass's experts implementation reaches them through the Offload (DESIGN.md, "One owner")."""
    owned = {
        "fmoe_local.prefetcher.Prefetcher",
        "fmoe_local.miss_cost.MissPlanner",
        "fmoe_local.cpu_experts.HostExperts",
    }
    runtime = [p for p in _modules() if p.name != "offload.py"]
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
