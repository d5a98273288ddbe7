"""The unit each view of the page writes its sizes in, through fmoe_local/units.py (the one size formatter).

Scope: the expert cache's unit — BINARY, as RuntimeConfig.cache_gb, and the largest in which all of the loaded
model's experts are at least 1 (GB for real models, MB for the demo, KB for test models) — which the header, the
Settings tab and the Stats tab share for every cache, expert and copy figure; and the decimal units of the Models
tab's tables (downloads, disk, RAM). It does NOT choose what a view shows, only the unit it is written in.
"""

from __future__ import annotations

from fmoe_local.runtime_types import ModelInfo
from fmoe_local.units import BINARY, DECIMAL, Unit, size, unit_for

GB = DECIMAL[0]  # the Models tab's tables: catalog models are gigabytes, one decimal in every column


def cache_unit(info: ModelInfo | None) -> Unit:
    """The cache field's unit for this model (GB before one is loaded)."""
    if info is None:
        return BINARY[0]
    return unit_for(info.expert_bytes * info.num_layers * info.num_experts, BINARY)


def cache_size(info: ModelInfo | None, n_bytes: float, toward: str = "nearest") -> str:
    """A cache, expert or copied-bytes figure in the model's cache unit: "27 MB", "0.562 MB" (`toward` "up" or
    "down" for a minimum or maximum the user may type back)."""
    return size(n_bytes, cache_unit(info), toward=toward)


def cache_gib(info: ModelInfo | None, gib: float) -> str:
    """A cache size held in GiB (RuntimeConfig.cache_gb, ModelInfo.cache_gb) in the model's cache unit."""
    return cache_size(info, gib * BINARY[0].bytes)


def table_gb(n_bytes: float) -> str:
    """A Models-tab table cell: decimal GB with one place ("93.4 GB"), as the download sizes on the Hub."""
    return size(n_bytes, GB, 1)
