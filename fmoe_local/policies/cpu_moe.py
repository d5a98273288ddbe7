"""cpu_moe: llama.cpp's `--n-cpu-moe` as a peer — the CPU computes every expert the device does not hold for good.

Scope: what a user would pick instead of fMoE, measured in the same runtime. The cache holds whole MoE layers'
experts, the last ones first (llama.cpp keeps the experts of the first N layers on the CPU and the rest on the GPU),
as many layers as its slots fit; they are copied once (prefetched at the start of each forward pass until they are
resident) and never evicted. Every other expert is computed on the CPU from its host copy: the policy forces miss
handling "cpu", so a miss is never copied. It does NOT predict anything, and it does NOT keep the most used experts
instead of whole layers (the variant some users build by hand with llama.cpp's tensor overrides).

The slot count comes from the cache through the optional `set_capacity` (policies/base.py); with fewer slots than
one layer has experts, nothing is resident and every expert runs on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fmoe_local.config import RuntimeConfig
from fmoe_local.policies._common import RecencyPolicy, flat_codes, lowest, split_keys
from fmoe_local.policies.base import ExpertKey, ModelShape, Prefetch, PrefetchBatch


class CpuMoEPolicy(RecencyPolicy):
    name = "cpu_moe"
    miss_handling = "cpu"  # forces the engine's (and the replay's) miss handling: never copy a miss

    def __init__(self, shape: ModelShape, config: RuntimeConfig | None = None, map_store: object | None = None) -> None:
        super().__init__(shape, config, map_store)
        self._resident = np.zeros((shape.num_layers, shape.num_experts), bool)  # [L, J] the layers kept on device
        self._seen = np.zeros_like(self._resident)  # [L, J] kept experts already used as hits: surely resident
        self.set_capacity(0)

    def set_capacity(self, slots: int) -> None:
        """The cache has `slots` slots: keep the last slots // J layers whole."""
        layers = min(self.shape.num_layers, max(0, slots) // self.shape.num_experts)
        self._resident[:] = False
        if layers:
            self._resident[self.shape.num_layers - layers :] = True
        self._seen[:] = False

    @property
    def resident_layers(self) -> list[int]:
        return [int(x) for x in np.flatnonzero(self._resident.any(1))]

    def begin_request(self, request_id: int) -> None:
        super().begin_request(request_id)
        # "Seen as a hit" comes from record_access, which a learning pass (the replay's offline warm-up, a complete
        # cache's pass) also calls with every access a hit although nothing was copied: each request asks again,
        # and the queue drops what is already resident.
        self._seen[:] = False

    def begin_iteration(self, semantic: np.ndarray | None) -> Sequence[Prefetch]:
        # Until each kept expert has been seen as a hit, ask for it again: the queue drops what is already claimed,
        # and a pass that ended before its copy started (the queue keeps only the newest pass) does not lose it.
        layers, experts = np.nonzero(self._resident & ~self._seen)
        return PrefetchBatch(layers, experts, np.full(layers.size, 1.0))

    def record_access(self, layer: int, experts: Sequence[int], hits: Sequence[bool]) -> None:
        super().record_access(layer, experts, hits)
        ids = np.asarray(experts, np.int64)
        self._seen[layer, ids[np.asarray(hits, bool)]] |= self._resident[layer, ids[np.asarray(hits, bool)]]

    def choose_victims(self, candidates: Sequence[ExpertKey], current_layer: int, count: int = 1) -> list[ExpertKey]:
        # Only a kept layer's copy ever claims a slot, so there is room for it without evicting; should the cache
        # still need a victim (it was shrunk under us), experts of layers not kept go first, then the least recent.
        layers, experts = split_keys(candidates)
        codes = flat_codes(candidates, layers, experts, self.shape.num_experts)
        kept = self._resident.ravel()[codes].astype(np.int8)
        return lowest(candidates, layers, experts, self._last_use.ravel()[codes], kept, count=count)
