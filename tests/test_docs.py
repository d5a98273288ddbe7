"""The documents name files that exist: every source, script or document file DESIGN.md names (a path from the
repository root, or a module name found in one of the packages), and every relative link of the README and docs/.
A moved or deleted module then fails here, not in a reader's hands."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where a bare module name in DESIGN.md ("cache.py", "policies/base.py") may live.
PLACES = ("", *"fmoe_local fmoe_local/policies fmoe_bench ui store installers tools tools/gpu_check tests docs".split())
FILE = re.compile(r"(?<![\w/.<-])((?:[\w-]+/)*[\w-]+\.(?:py|md|sh))\b")
LINK = re.compile(r"\]\(([^)#\s]+)\)")


def named_files(text: str) -> set[str]:
    return set(FILE.findall(text))


def missing_files(text: str) -> list[str]:
    return sorted(n for n in named_files(text) if not any((ROOT / place / n).exists() for place in PLACES))


def broken_links(doc: Path) -> list[str]:
    links = [u for u in LINK.findall(doc.read_text(encoding="utf-8")) if ":" not in u and not u.startswith("…")]
    return sorted(u for u in links if not (doc.parent / u).exists())


def test_every_file_design_md_names_exists():
    text = (ROOT / "DESIGN.md").read_text(encoding="utf-8")
    assert len(named_files(text)) > 50  # the pattern finds the names, so an empty result means something
    assert missing_files(text) == []


def test_the_check_sees_a_name_that_is_gone():
    assert missing_files("the owner is offload.py, the rule in fmoe_local/no_such_module.py and gone.md") == [
        "fmoe_local/no_such_module.py",
        "gone.md",
    ]


def test_every_relative_link_of_the_readme_and_docs_resolves():
    docs = [ROOT / "README.md", ROOT / "data" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert {str(d.relative_to(ROOT)): broken_links(d) for d in docs} == {str(d.relative_to(ROOT)): [] for d in docs}
