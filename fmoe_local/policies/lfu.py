"""lfu: no prefetching; evict the least frequently used expert (ties: least recently used).

Scope: counts accesses over the policy's lifetime (all requests), the way a frequency cache warms up to a
workload. It does NOT decay counts or prefetch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fmoe_local.config import RuntimeConfig
from fmoe_local.policies._common import RecencyPolicy, flat_codes, lowest, split_keys
from fmoe_local.policies.base import ExpertKey, ModelShape


class LFUPolicy(RecencyPolicy):
    name = "lfu"

    def __init__(self, shape: ModelShape, config: RuntimeConfig | None = None, map_store: object | None = None) -> None:
        super().__init__(shape, config, map_store)
        self._count = np.zeros((shape.num_layers, shape.num_experts), np.int64)  # [L, J]

    def record_access(self, layer: int, experts: Sequence[int], hits: Sequence[bool]) -> None:
        super().record_access(layer, experts, hits)
        self._count[layer, np.asarray(experts, np.int64)] += 1

    def choose_victims(self, candidates: Sequence[ExpertKey], current_layer: int, count: int = 1) -> list[ExpertKey]:
        layers, experts = split_keys(candidates)
        codes = flat_codes(candidates, layers, experts, self.shape.num_experts)
        # Fewest uses first, then oldest use.
        last, uses = self._last_use.ravel()[codes], self._count.ravel()[codes]
        return lowest(candidates, layers, experts, last, uses, count=count)
