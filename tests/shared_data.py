"""Where the read-only recordings and prompts live: the repository's data/ (fmoe_bench/repo_data.py).

FMOE_SHARED_DATA overrides it for other layouts.
"""

from __future__ import annotations

from fmoe_bench.repo_data import data_dir

SHARED_DATA = data_dir()
