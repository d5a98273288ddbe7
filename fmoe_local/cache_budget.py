"""How many expert slots a cache budget buys, and the refusal of a cache with none.

Scope: the arithmetic between a size in GB and a slot count, for whoever sizes an expert cache (engine.py, `bench
live`) and for the cache itself (cache.py checks its own capacity). It does NOT allocate anything.
"""

from __future__ import annotations

from fmoe_local.hardware import GIB


def slots_for_budget(cache_gb: float, expert_bytes: int) -> int:
    return int(cache_gb * GIB // expert_bytes)


def check_capacity(capacity: int, expert_bytes: int) -> None:
    """Refuse a cache with no slot, in a sentence that gives the size of one expert."""
    if capacity < 1:
        unit, scale = next(
            (u, f) for u, f in (("GB", GIB), ("MB", 1024**2), ("KB", 1024), ("bytes", 1)) if expert_bytes >= f
        )
        size = f"{expert_bytes / scale:.3g} {unit}"
        raise ValueError(f"The expert cache must hold at least one expert ({size} for this model). Give it more room.")
