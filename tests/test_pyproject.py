"""pyproject.toml and constraints.txt say what the code needs and what CI tests: every package the code imports is a
declared dependency, every declared one is pinned, every pin lies inside the declared range and is what runs here."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Our packages and every module file of the repository (tests import siblings such as netguard's slow_tokens).
FIRST_PARTY = {"app", "fmoe_local", "fmoe_bench", "ui", "store", "tests", "installers"} | {
    p.stem for p in REPO.rglob("*.py") if not {".venv", ".git"} & set(p.parts)
}


def _requirements(extra: str | None = None) -> dict[str, Requirement]:
    lines = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return {canonicalize_name(r.name): r for r in map(Requirement, lines)}


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            assert canonicalize_name(name) not in pins, f"{name} is pinned twice"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _imported(paths: list[Path]) -> set[str]:
    """Top-level modules imported anywhere in these files (inside functions too), less the standard library's and
    ours."""
    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - FIRST_PARTY


def _distributions(modules: set[str]) -> dict[str, set[str]]:
    """Module → the distributions that provide it; one not installed here (the `train` extra's) by its own name."""
    provided = metadata.packages_distributions()
    return {m: {canonicalize_name(d) for d in provided.get(m, [m])} for m in modules}


def _undeclared(paths: list[Path], declared: set[str]) -> dict[str, set[str]]:
    return {m: ds for m, ds in _distributions(_imported(paths)).items() if not ds & declared}


def test_every_package_the_app_imports_is_a_dependency():
    app = [REPO / "app.py", *(REPO / "fmoe_local").rglob("*.py"), *(REPO / "ui").rglob("*.py")]
    app += [*(REPO / "store").rglob("*.py"), *(REPO / "fmoe_bench").rglob("*.py")]
    # The demo's trainer reads its corpus with the `train` extra; nothing else needs it.
    declared = set(_requirements()) | set(_requirements("train"))
    # `bench constrained` times xgrammar beside llguidance when someone installed it; nothing installs it for them.
    assert _undeclared(app, declared) == {"xgrammar": {"xgrammar"}}


def test_every_package_the_tests_import_is_a_dependency_or_a_dev_one():
    # tools/llamacpp/time_gguf.py runs in the Python that has llama-cpp-python (compare.py's --llama-python), never
    # in ours: llama.cpp is what we measure against, not something we install.
    other_python = {REPO / "tools" / "llamacpp" / "time_gguf.py"}
    tests = [*(REPO / "tests").rglob("*.py"), *(p for p in (REPO / "tools").rglob("*.py") if p not in other_python)]
    declared = set(_requirements()) | set(_requirements("dev")) | {"pytest"}
    # tools/kernel_candidates.py times ONNX Runtime's kernels beside torch's when someone installed them (its
    # docstring says how); nothing installs them for them, and the app never imports them.
    library_kernels = {"onnxruntime": {"onnxruntime"}, "onnx": {"onnx"}}
    assert _undeclared(tests, declared) == library_kernels


def test_the_import_walk_finds_an_undeclared_package(tmp_path: Path):
    (tmp_path / "m.py").write_text("import json\nfrom fmoe_local import cli\n\ndef f():\n    import numpy.linalg\n")
    assert _imported([tmp_path / "m.py"]) == {"numpy"}
    assert _undeclared([tmp_path / "m.py"], {"torch"}) == {"numpy": {"numpy"}}


def test_every_dependency_ci_installs_is_pinned_inside_its_declared_range():
    """CI installs the package with its dev extra under constraints.txt: each of those is pinned, nothing else is."""
    declared = _requirements() | _requirements("dev")
    pins = _pins()
    assert set(pins) == set(declared)
    outside = {n: f"{pins[n]} not in {r.specifier}" for n, r in declared.items() if pins[n] not in r.specifier}
    assert outside == {}


def test_the_gradio_range_holds_the_event_api_ui_uses():
    """ui/ passes api_visibility= to its events, which Gradio 6 added: the declared range must not let 5 in."""
    uses = [p.name for p in (REPO / "ui").rglob("*.py") if "api_visibility=" in p.read_text()]
    gradio = _requirements()["gradio"].specifier
    assert uses and not gradio.contains("5.50.0") and gradio.contains("6.0.0")


def test_the_pins_are_what_this_environment_runs():
    """The tests that just ran, ran on the pinned versions (CI installs with -c constraints.txt). A package whose
    marker leaves it out here (bitsandbytes on macOS) is not installed and not compared."""
    declared = _requirements() | _requirements("dev")
    differ = {}
    for name, pin in _pins().items():
        marker = declared[name].marker
        if marker is not None and not marker.evaluate():
            continue
        installed = Version(metadata.version(name))
        if Version(installed.public) != pin:  # torch 2.13.0+cpu is the 2.13.0 pin's CPU build
            differ[name] = f"pinned {pin}, installed {installed}"
    assert differ == {}
