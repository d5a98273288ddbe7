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

from fmoe_local.policies._common import flat_codes, lowest, split_keys
from fmoe_local.policies.base import ExpertKey, ModelShape, Policy, Prefetch, PrefetchBatch

NEVER = np.iinfo(np.int32).max
_LAST = np.iinfo(np.int64).max  # position of "never used again": after every real one


class OraclePolicy(Policy):
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
        self.next_use[:n] = np.where(need, np.arange(n, dtype=np.int32)[:, None, None], NEVER)
        np.minimum.accumulate(self.next_use[::-1], axis=0, out=self.next_use[::-1])  # the nearest one at or after i
        self.iteration = -1
        self.window = max(0, capacity - 2 * shape.top_k)
        # [L·J] eviction key of every expert for the current iteration and layer (choose_victims); rows up to
        # `_switched` hold the next iteration's next use, the others this one's.
        self._key = np.zeros(L * J, np.int64)
        self._switch_rows(0, L, self.iteration)  # iteration −1 reads next_use[−1]: never, as indexing it did
        self._switched = -1

    def begin_request(self, request_id: int) -> None:
        pass

    def begin_iteration(self, semantic: np.ndarray | None) -> PrefetchBatch:
        self.iteration += 1
        if self.iteration >= self.need.shape[0]:
            raise RuntimeError("The oracle was replayed past the end of the trace it was built from.")
        self._switch_rows(0, self.shape.num_layers, self.iteration)
        self._switched = -1
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
        if current_layer < self._switched:  # a layer again (not in the replay's order): start over
            self._switch_rows(0, self.shape.num_layers, self.iteration)
            self._switched = -1
        if current_layer > self._switched:
            self._switch_rows(self._switched + 1, current_layer + 1, self.iteration + 1)
            self._switched = current_layer
        key = self._key[flat_codes(candidates, layers, experts, self.shape.num_experts)]
        return lowest(candidates, layers, experts, key, count=count)  # furthest next use first

    def _switch_rows(self, start: int, stop: int, i: int) -> None:
        """Key rows start..stop−1 from the next use at or after iteration i: −(position in access order), where
        never used again is the most negative of all."""
        L = self.shape.num_layers
        use = self.next_use[min(i, self.need.shape[0]), start:stop].astype(np.int64)  # [rows, J]
        pos = np.where(use == NEVER, _LAST, use * L + np.arange(start, stop)[:, None])
        self._key.reshape(L, -1)[start:stop] = -pos

    def end_iteration(self) -> None:
        pass

    def end_request(self) -> None:
        pass
