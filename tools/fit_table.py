"""The README's "Which model fits your machine" table, computed from the catalog and its fit rules.

Each cell is what the Models tab would recommend on that machine: the expert format hardware.format_fits marks
(the most faithful that fits; without a CUDA GPU, where every model runs slowly, the smallest), ", from disk" when
the experts do not all fit in RAM and are read from the disk as needed, "—" when nothing fits; for a machine with
the given RAM and VRAM free, the download not yet on disk and 2 TB free. `python tools/fit_table.py` prints the table; `--write README.md` replaces the block between
the markers; tests/test_fit_table.py fails when the README's table differs from what the rules give now (after a
change to the catalog or to hardware.py, rerun with --write).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fmoe_local.catalog import CATALOG, GB  # noqa: E402
from fmoe_local.hardware import Machine, format_fits  # noqa: E402

START, END = "<!-- fit-table:start (tools/fit_table.py --write README.md) -->", "<!-- fit-table:end -->"
# (label, VRAM GB, RAM GB): laptops and desktops people have, without a GPU and with the common NVIDIA sizes.
MACHINES = (
    ("CPU only, 16 GB RAM", 0, 16),
    ("CPU only, 32 GB RAM", 0, 32),
    ("CPU only, 64 GB RAM", 0, 64),
    ("CPU only, 128 GB RAM", 0, 128),
    ("8 GB GPU, 32 GB RAM", 8, 32),
    ("12 GB GPU, 32 GB RAM", 12, 32),
    ("16 GB GPU, 64 GB RAM", 16, 64),
    ("24 GB GPU, 64 GB RAM", 24, 64),
    ("24 GB GPU, 128 GB RAM", 24, 128),
)
SHORT = {"bf16": "bf16", "int8": "8-bit", "nf4": "4-bit", "mxfp4": "MXFP4"}


def machine(vram_gb: int, ram_gb: int) -> Machine:
    vram = vram_gb * GB
    return Machine(
        device="cuda" if vram_gb else "cpu",
        gpu_name="NVIDIA GPU" if vram_gb else "",
        vram_total=vram,
        vram_free=vram,
        ram_total=ram_gb * GB,
        ram_available=ram_gb * GB,
        disk_free=2000 * GB,
        os_name="Linux",
    )


def cell(entry, m: Machine) -> str:
    fits = format_fits(entry, m)
    best = next((f for f in fits if f.recommended), None)
    if best is None:
        return "—"
    spills = any(w in best.verdict.reasons[0] for w in ("read from disk", "spill to disk"))
    return SHORT[best.fmt] + (", from disk" if spills else "")


def table() -> str:
    names = [e.name for e in CATALOG]
    rows = ["| machine (RAM and VRAM free) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, vram, ram in MACHINES:
        m = machine(vram, ram)
        rows.append(f"| {label} | " + " | ".join(cell(e, m) for e in CATALOG) + " |")
    return "\n".join(rows)


def block() -> str:
    return f"{START}\n{table()}\n{END}"


def replace_block(text: str) -> str:
    head, found, rest = text.partition(START)
    if not found or END not in rest:
        raise SystemExit(f"The markers {START} … {END} are not in the file: put them where the table goes.")
    return head + block() + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, metavar="README", help="replace the table between the markers")
    args = parser.parse_args(argv)
    if args.write is None:
        print(block())
        return 0
    args.write.write_text(replace_block(args.write.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"table written to {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
