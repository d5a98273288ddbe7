"""Where the routing traces and prompt files shipped with the repository live: data/ at its root.

Scope: the one answer to "where is data/" for the benchmarks' defaults, the demo's analysis and the tests;
FMOE_SHARED_DATA points elsewhere (a copy on a lent machine, another layout). It does NOT read the files (bench/
prompts.py and traces.py do). What the files are and where they come from: data/README.md.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_DATA = Path(__file__).resolve().parents[1] / "data"


def data_dir() -> Path:
    """data/ of this checkout, or FMOE_SHARED_DATA when set."""
    return Path(os.environ.get("FMOE_SHARED_DATA") or REPO_DATA)
