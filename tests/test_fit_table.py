"""tools/fit_table.py: the README's model-fit table is the catalog's fit rules' answer, so it cannot drift."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("fit_table", ROOT / "tools" / "fit_table.py")
fit_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fit_table)


def test_the_readme_table_is_what_the_fit_rules_give_now():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert fit_table.block() in readme, (
        "the catalog or hardware.py changed: run python tools/fit_table.py --write README.md"
    )


def test_a_cell_is_the_recommended_format_and_says_when_nothing_fits_or_experts_come_from_disk():
    from fmoe_local.catalog import find

    mixtral = find("mistralai/Mixtral-8x7B-Instruct-v0.1")
    assert fit_table.cell(mixtral, fit_table.machine(0, 4)) == "—"  # 4 GB of RAM: less than the headroom
    assert fit_table.cell(mixtral, fit_table.machine(8, 32)) == "4-bit"  # 25 GB of 4-bit experts in 29 GB free
    assert fit_table.cell(mixtral, fit_table.machine(8, 16)).endswith(", from disk")
    assert fit_table.cell(mixtral, fit_table.machine(80, 256)) == "bf16"


def test_write_replaces_only_the_block_and_refuses_a_file_without_markers(tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{fit_table.START}\nold table\n{fit_table.END}\nrest\n")
    assert fit_table.main(["--write", str(readme)]) == 0
    assert readme.read_text() == f"intro\n{fit_table.block()}\nrest\n"
    readme.write_text("no markers")
    with pytest.raises(SystemExit, match="markers"):
        fit_table.main(["--write", str(readme)])
