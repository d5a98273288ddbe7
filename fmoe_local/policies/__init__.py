"""Policies: one module per prefetch/eviction policy behind the interface in base.py, and the registry.

Scope: name → class, and `make_policy`. It does NOT know the cache or the runtime; replay-only policies (the
oracle, which needs the future) live in fmoe_bench/ and are built there.
"""

from __future__ import annotations

from fmoe_local.config import RuntimeConfig
from fmoe_local.maps import MapStore
from fmoe_local.policies.base import ModelShape, Policy
from fmoe_local.policies.cpu_moe import CpuMoEPolicy
from fmoe_local.policies.fmoe import FMoEPolicy
from fmoe_local.policies.lfu import LFUPolicy
from fmoe_local.policies.lru import LRUPolicy
from fmoe_local.policies.moe_infinity import MoEInfinityPolicy
from fmoe_local.policies.on_demand import OnDemandPolicy
from fmoe_local.policies.speculative import SpeculativePolicy

# Every class takes (shape, config, map_store); only fmoe uses the map store.
REGISTRY: dict[str, type] = {
    "fmoe": FMoEPolicy,
    "moe_infinity": MoEInfinityPolicy,
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "speculative": SpeculativePolicy,
    "on_demand": OnDemandPolicy,
    "cpu_moe": CpuMoEPolicy,
}


def make_policy(name: str, shape: ModelShape, config: RuntimeConfig, map_store: MapStore | None = None) -> Policy:
    """Build the named policy. fmoe without a map store gets a fresh in-memory one sized by `config`."""
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"Unknown policy '{name}'. Choose one of: {', '.join(REGISTRY)}.")
    return cls(shape, config, map_store)


__all__ = ["REGISTRY", "make_policy"]
