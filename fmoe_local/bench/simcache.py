"""The replay's simulated expert cache: slots, pins, one copy in flight, on-demand loads, hit/miss accounting.

Scope: residency and the copy engine's progress in bytes, evicting only through the policy's `choose_victim`
(the same call the runtime's cache.py makes). It does NOT order events or time iterations (replay.py does) and it
never decides what to prefetch or evict.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import numpy as np

from fmoe_local.bench.presets import CostModel
from fmoe_local.policies.base import ExpertKey, ModelShape, Policy
from fmoe_local.stats import LayerCounters


class KeyArray(Sequence):
    """Eviction candidates: a Sequence of (layer, expert) tuples that is also a [n, 2] int64 array.

    Both views already exist in the simulated cache, so handing them over costs no conversion: `np.asarray`
    returns the array, indexing and iteration the tuples.
    """

    def __init__(self, keys: np.ndarray, tuples: list[ExpertKey]) -> None:
        self._keys, self._tuples = keys, tuples  # [n, 2], n tuples

    def __len__(self) -> int:
        return len(self._tuples)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return KeyArray(self._keys[i], self._tuples[i])
        return self._tuples[i]

    def __iter__(self) -> Iterator[ExpertKey]:
        return iter(self._tuples)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self._keys if dtype is None else self._keys.astype(dtype)


class SimCache:
    """Residency of `capacity` slots; the only place the replay evicts, always through the policy.

    `keys[:n_free]` are the eviction candidates and `keys[n_free:n]` the experts that may not be evicted now
    (pinned by the layer in use, or the copy in flight): swapping rows keeps the candidates one contiguous view,
    so an eviction costs no copy of the resident set.
    """

    def __init__(self, shape: ModelShape, capacity: int, policy: Policy, cost: CostModel) -> None:
        self.capacity, self.policy, self.cost = capacity, policy, cost
        self.resident: dict[ExpertKey, bool] = {}  # key → loaded by a prefetch and not used yet
        self.row_of: dict[ExpertKey, int] = {}
        self.keys = np.zeros((capacity, 2), np.int64)  # [capacity, 2]
        self.key_at: list[ExpertKey] = [(-1, -1)] * capacity  # the same rows as tuples
        self.n_free = 0
        self.held: set[ExpertKey] = set()  # pinned ∪ in flight
        self.counters = LayerCounters(shape.num_layers, shape.num_experts)
        self.inflight: ExpertKey | None = None
        self.inflight_left = 0.0  # bytes
        self.pinned: tuple[ExpertKey, ...] = ()
        self.current_layer = -1
        self.late = 0  # accesses that found their prefetch still copying (counted as misses)

    def _put(self, row: int, key: ExpertKey) -> None:
        self.key_at[row] = key
        self.keys[row, 0], self.keys[row, 1] = key
        self.row_of[key] = row

    def _swap(self, r1: int, r2: int) -> None:
        if r1 != r2:
            k1, k2 = self.key_at[r1], self.key_at[r2]
            self._put(r1, k2)
            self._put(r2, k1)

    def _hold(self, key: ExpertKey) -> None:
        self.held.add(key)
        row = self.row_of.get(key)
        if row is not None and row < self.n_free:
            self.n_free -= 1
            self._swap(row, self.n_free)

    def _release(self, key: ExpertKey) -> None:
        self.held.discard(key)
        row = self.row_of.get(key)
        if row is not None and row >= self.n_free:
            self._swap(row, self.n_free)
            self.n_free += 1

    def set_pinned(self, keys: tuple[ExpertKey, ...]) -> None:
        for key in self.pinned:
            if key != self.inflight and key not in keys:
                self._release(key)
        self.pinned = keys
        for key in keys:
            self._hold(key)

    def _finish_copy(self) -> None:
        key, self.inflight = self.inflight, None
        if key not in self.pinned:
            self._release(key)

    def _insert(self, key: ExpertKey, by_prefetch: bool) -> bool:
        """Give `key` a slot, evicting through the policy when full; False when every slot is held."""
        n = len(self.resident)
        if n < self.capacity:
            row = n  # just past the held rows
            self._put(row, key)
            if key not in self.held:
                self._swap(row, self.n_free)
                self.n_free += 1
        else:
            if self.n_free == 0:
                return False
            cand = KeyArray(self.keys[: self.n_free], self.key_at[: self.n_free])
            victim = self.policy.choose_victim(cand, self.current_layer)
            victim = (int(victim[0]), int(victim[1]))
            if self.resident.pop(victim):
                self.counters.prefetch_wasted += 1
            row = self.row_of.pop(victim)  # a candidate row: the new key takes it
            self._put(row, key)
            if key in self.held:
                self.n_free -= 1
                self._swap(row, self.n_free)
        self.resident[key] = by_prefetch
        return True

    def transfer(self, budget: float, heap: list, iteration: int) -> None:
        """Move up to `budget` bytes of queued prefetches, highest priority first (timeline: replay.py)."""
        while budget > 0:
            if self.inflight is None and not self._start_next(heap, iteration):
                return
            step = min(budget, self.inflight_left)
            budget -= step
            self.inflight_left -= step
            if self.inflight_left <= 0:
                self._finish_copy()

    def _start_next(self, heap: list, iteration: int) -> bool:
        while heap:
            _, _, it, layer, expert = heapq.heappop(heap)
            key = (layer, expert)
            if it < iteration or layer <= self.current_layer or key in self.resident:
                continue
            self.held.add(key)  # a copy in flight is never a victim
            if not self._insert(key, by_prefetch=True):
                self.held.discard(key)
                continue  # every slot held: the runtime drops the prefetch too
            self.counters.prefetched[layer, expert] += 1
            self.counters.bytes_moved += self.cost.expert_bytes
            self.inflight, self.inflight_left = key, float(self.cost.expert_bytes)
            return True
        return False

    def access(self, layer: int, experts: tuple[int, ...]) -> tuple[list[bool], float]:
        """The forward pass needs `experts` of `layer`: returns hits and the stall in seconds.

        More experts than slots (a long prefill) are taken in chunks of `capacity`, as experts.py computes them.
        """
        self.current_layer = layer
        keys = tuple((layer, e) for e in experts)
        hits, stall = [], 0.0
        c = self.counters
        for start in range(0, len(keys), self.capacity):
            chunk = keys[start : start + self.capacity]
            self.set_pinned(chunk)
            for key in chunk:
                if key in self.resident:
                    hits.append(True)  # what the runtime's cache tells the policy, late or not
                    if self.resident[key]:
                        self.resident[key] = False
                        c.prefetch_used += 1
                    if key == self.inflight:  # a late prefetch: wait for its copy, as cache.acquire does
                        stall += self.inflight_left / self.cost.bandwidth
                        self._finish_copy()
                        c.misses[key] += 1
                        self.late += 1
                    else:
                        c.hits[key] += 1
                    continue
                hits.append(False)
                c.misses[key] += 1
                if not self._insert(key, by_prefetch=False):
                    # Every other slot is pinned: wait for the copy in flight to free one, as cache.acquire does.
                    stall += self.inflight_left / self.cost.bandwidth
                    self._finish_copy()
                    if not self._insert(key, by_prefetch=False):
                        raise RuntimeError("The cache has no slot to load into; raise the cache size.")
                c.bytes_moved += self.cost.expert_bytes
                stall += self.cost.load_s
        c.stall_s += stall
        return hits, stall

    def end_request(self) -> None:
        for key, unused in self.resident.items():
            if unused:
                self.counters.prefetch_wasted += 1
                self.resident[key] = False
