"""ui.loaded_runtime.LoadedRuntime: the real Runtime and every fake the UI's tests use have each of its members, with
the same parameters, and ui/ reads nothing of a runtime that is not one of them."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from fmoe_local.runtime import Runtime
from tests import test_ui_chat, test_ui_openai_api, test_ui_page_api  # noqa: F401 - the fakes they define
from tests.fake_runtime import FakeRuntime
from ui.loaded_runtime import LoadedRuntime

REPO = Path(__file__).resolve().parent.parent
MEMBERS = sorted(name for name in vars(LoadedRuntime) if not name.startswith("_"))


def _parameters(fn: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def drift(cls: type) -> list[str]:
    """What `cls` lacks of LoadedRuntime, or takes differently: one line each (none: it implements the interface)."""
    wrong = []
    if LoadedRuntime in cls.__mro__:
        wrong.append("subclasses LoadedRuntime, whose members do nothing: implement each one")
    for name in MEMBERS:
        wanted = vars(LoadedRuntime)[name]
        if not hasattr(cls, name):
            wrong.append(f"has no {name}")
        elif not isinstance(wanted, property) and _parameters(getattr(cls, name)) != _parameters(wanted):
            wrong.append(f"{name}{inspect.signature(getattr(cls, name))} is not {name}{inspect.signature(wanted)}")
    return wrong


def _fakes() -> list[type]:
    found, todo = [], [FakeRuntime]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_the_runtime_and_every_fake_implement_what_the_ui_uses():
    assert len(_fakes()) >= 5  # FakeRuntime and the tests' own (ScriptedRuntime, SlowRuntime, HiRuntime, ...)
    offenders = {cls.__qualname__: drift(cls) for cls in [Runtime, *_fakes()]}
    assert {name: wrong for name, wrong in offenders.items() if wrong} == {}


def test_the_check_names_a_missing_member_and_a_changed_parameter():
    # Built apart from FakeRuntime (not subclasses): the test above checks every subclass it can find.
    fake = {name: getattr(FakeRuntime, name) for name in MEMBERS}
    no_close = type("NoClose", (), {name: member for name, member in fake.items() if name != "close"})
    assert drift(no_close) == ["has no close"]

    def submit(self, prompt, sampling=None):  # noqa: ANN001, ANN202 - no tools: the API's tool requests would fail
        return None

    assert [w.split("(")[0] for w in drift(type("OldSubmit", (), {**fake, "submit": submit}))] == ["submit"]
    assert drift(type("Bare", (), {})) == [f"has no {name}" for name in MEMBERS]
    assert drift(type("Lazy", (LoadedRuntime,), {}))[0].startswith("subclasses LoadedRuntime")


def _read_of_a_runtime(node: ast.AST) -> str | None:
    """`session.runtime.X`, `self.runtime.X` or `runtime.X`: the member X the UI reads of a runtime."""
    if not isinstance(node, ast.Attribute):
        return None
    of = node.value
    if (isinstance(of, ast.Attribute) and of.attr == "runtime") or (isinstance(of, ast.Name) and of.id == "runtime"):
        return node.attr
    return None


def test_the_ui_reads_exactly_the_members_of_loaded_runtime():
    used = set()
    for path in [*sorted((REPO / "ui").rglob("*.py")), REPO / "app.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            member = _read_of_a_runtime(node)
            if member is not None:
                used.add(member)
    assert sorted(used) == MEMBERS
