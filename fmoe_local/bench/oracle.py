"""The oracle policy (replay only): knows every future expert access of the trace it replays.

Scope: Belady eviction (evict the candidate whose next use is furthest away) and earliest-need-first prefetching,
behind the same Policy interface as every other policy, under the same cache and bandwidth. It is the ceiling the
other policies are measured against. It does NOT run live (the future is unknown there) and keeps no map store.

Knowledge: `need[i, l, j]` — iteration i (in replay order) accesses expert j of layer l. The replay calls
begin_iteration once per iteration in that order, which is how the oracle knows where it is.

Prefetching: at begin_iteration it queues this iteration's accesses, priority L − layer (earliest need first); the
queue drops the ones already resident. It never queues more distinct experts than capacity − 2K: with at most that many
wanted, Belady always finds a victim whose next use is later than anything queued (K slots may be pinned by the
layer in use, K by the next), so a prefetch never pushes out something needed sooner. Prefetches for a later
iteration are not queued: the replay (like the runtime's prefetcher) drops queued work once its layer has passed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fmoe_local.policies._common import lowest, split_keys
from fmoe_local.policies.base import ExpertKey, ModelShape, Prefetch, PrefetchBatch

NEVER = np.iinfo(np.int32).max


class OraclePolicy:
    name = "oracle"
    needs_lookahead = False

    def __init__(self, shape: ModelShape, need: np.ndarray, capacity: int) -> None:
        n, L, J = need.shape
        if (L, J) != (shape.num_layers, shape.num_experts):
            raise ValueError("The oracle's future accesses do not match the model shape.")
        self.shape, self.capacity = shape, capacity
        self.need = need
        # next_use[i, l, j]: first iteration ≥ i that accesses (l, j); NEVER if none.
        self.next_use = np.empty((n + 1, L, J), np.int32)
        self.next_use[n] = NEVER
        for i in range(n - 1, -1, -1):
            self.next_use[i] = np.where(need[i], i, self.next_use[i + 1])
        self.iteration = -1
        self.window = max(0, capacity - 2 * shape.top_k)

    def begin_request(self, request_id: int) -> None:
        pass

    def begin_iteration(self, semantic: np.ndarray | None) -> PrefetchBatch:
        self.iteration += 1
        if self.iteration >= self.need.shape[0]:
            raise RuntimeError("The oracle was replayed past the end of the trace it was built from.")
        need = self.need[self.iteration]  # [L, J]
        within = int(np.count_nonzero(np.cumsum(need.sum(1)) <= self.window))  # leading layers inside the window
        layers, experts = np.nonzero(need[:within])  # layer by layer, experts ascending
        return PrefetchBatch(layers, experts, (self.shape.num_layers - layers).astype(np.float64))

    def observe_layer(self, layer: int, probs: np.ndarray, lookahead: np.ndarray | None = None) -> list[Prefetch]:
        return []

    def record_access(self, layer: int, experts: Sequence[int], hits: Sequence[bool]) -> None:
        pass

    def choose_victims(self, candidates: Sequence[ExpertKey], current_layer: int, count: int = 1) -> list[ExpertKey]:
        layers, experts = split_keys(candidates)
        # A candidate of a layer not reached yet in this iteration may still be used in it; one already passed
        # is next used in a later iteration.
        i = self.iteration
        row = np.where(layers > current_layer, i, i + 1)
        use = self.next_use[row, layers, experts].astype(np.int64)  # [n] iteration of the next use
        # Position in access order; never-used-again sorts last of all.
        pos = np.where(use == NEVER, np.iinfo(np.int64).max, use * self.shape.num_layers + layers)
        return lowest(candidates, layers, experts, -pos, count=count)  # furthest next use first

    def end_iteration(self) -> None:
        pass

    def end_request(self) -> None:
        pass
