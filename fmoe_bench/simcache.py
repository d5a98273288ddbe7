"""The replay's simulated expert cache: slots, pins, one copy in flight, on-demand loads, misses computed on the
host (at the same time as the layer's copies), hit/miss accounting.

Scope: residency and the copy engine's progress in bytes, evicting only through the policy's `choose_victims`
(the same call the runtime's cache.py makes). It does NOT order events or time iterations (replay.py does) and it
never decides what to prefetch or evict.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fmoe_bench.presets import CostModel
from fmoe_local.policies.base import CandidateKeys, ExpertKey, ModelShape, Policy
from fmoe_local.prefetch_queue import PrefetchQueue
from fmoe_local.stats import LayerCounters


class SimCache:
    """Residency of `capacity` slots; the only place the replay evicts, always through the policy.

    Residency and holds are [L, J] masks, so the eviction candidates (resident, not pinned by the layer in use,
    not the copy in flight) are one `flatnonzero` away, already in (layer, expert) order.
    """

    def __init__(self, shape: ModelShape, capacity: int, policy: Policy, cost: CostModel) -> None:
        self.capacity, self.policy, self.cost = capacity, policy, cost
        self.num_experts = shape.num_experts
        self.resident: dict[ExpertKey, bool] = {}  # key → loaded by a prefetch and not used yet
        self.resident_mask = np.zeros((shape.num_layers, shape.num_experts), bool)  # [L, J] the same keys
        self.held_mask = np.zeros((shape.num_layers, shape.num_experts), bool)  # [L, J] pinned ∪ in flight
        self.counters = LayerCounters(shape.num_layers, shape.num_experts)
        self.inflight: ExpertKey | None = None
        self.inflight_left = 0.0  # bytes
        self.pinned: tuple[ExpertKey, ...] = ()
        self.current_layer = -1
        self._victims: list[ExpertKey] = []  # chosen in one call for a layer's misses, used first to last

    def candidates(self) -> CandidateKeys:
        codes = np.flatnonzero(self.resident_mask & ~self.held_mask)
        layers = codes // self.num_experts
        return CandidateKeys(layers, codes - layers * self.num_experts, in_order=True, codes=codes)  # ascending

    def set_pinned(self, keys: tuple[ExpertKey, ...]) -> None:
        for key in self.pinned:
            if key != self.inflight:
                self.held_mask[key] = False
        self.pinned = keys
        for key in keys:
            self.held_mask[key] = True

    def _finish_copy(self) -> None:
        key, self.inflight = self.inflight, None
        if key not in self.pinned:
            self.held_mask[key] = False

    def _insert(self, key: ExpertKey, by_prefetch: bool) -> bool:
        """Give `key` a slot, evicting through the policy when full; False when every slot is held."""
        if len(self.resident) >= self.capacity:
            if self._victims:
                victim = self._victims.pop()
            else:
                chosen = self._choose(1)
                if not chosen:
                    return False
                victim = chosen[0]
            victim = (int(victim[0]), int(victim[1]))
            if self.resident.pop(victim):
                self.counters.prefetch_wasted += 1
            self.resident_mask[victim] = False
        self.resident[key] = by_prefetch
        self.resident_mask[key] = True
        return True

    def _choose(self, count: int) -> list[ExpertKey]:
        cand = self.candidates()
        if not len(cand):
            return []
        return self.policy.choose_victims(cand, self.current_layer, min(count, len(cand)))

    def transfer(self, budget: float, queue: PrefetchQueue, iteration: int) -> None:
        """Move up to `budget` bytes of queued prefetches, highest priority first (timeline: replay.py)."""
        while budget > 0:
            if self.inflight is None and not self._start_next(queue, iteration):
                return
            step = min(budget, self.inflight_left)
            budget -= step
            self.inflight_left -= step
            if self.inflight_left <= 0:
                self._finish_copy()

    def _start_next(self, queue: PrefetchQueue, iteration: int) -> bool:
        while (key := queue.pop(iteration, self.current_layer, self.resident_mask)) is not None:
            layer, expert = key
            self.held_mask[key] = True  # a copy in flight is never a victim
            if not self._insert(key, by_prefetch=True):
                self.held_mask[key] = False
                continue  # every slot held: the runtime drops the prefetch too
            self.counters.prefetched[layer, expert] += 1
            self.counters.bytes_moved += self.cost.expert_bytes
            self.inflight, self.inflight_left = key, float(self.cost.expert_bytes)
            return True
        return False

    def access(
        self,
        layer: int,
        experts: tuple[int, ...],
        counts: tuple[int, ...] | None = None,
        plan: Callable[[list[int]], list[bool]] | None = None,
    ) -> tuple[list[bool], float, float]:
        """The forward pass needs `experts` of `layer`: returns hits, the stall and the host compute in seconds.

        `plan(tokens)` (miss handling: the runtime's own `MissPlanner.plan`) gets the token counts of the layer's
        misses and says which the host computes: those are counted as misses computed on the host, load nothing and
        cost the CPU `cost.cpu_s(tokens)` each, as cache.acquire with `on_host` and experts.py do. `counts[i]` is how
        many tokens need `experts[i]` (1 when not given: decode).

        Time: the link's work for the layer (the rest of a late prefetch's copy, the copy a slot waits for, the
        on-demand loads) and the CPU's share run at once — the runtime issues the copies before the CPU computes —
        so the layer waits max(link, CPU). The returned stall is the part of the link's time the CPU does not cover
        (stall + host = that max); the CPU's work is still never credited as overlapping the GPU's compute.

        More experts than slots (a long prefill) are taken in chunks of `capacity`, as experts.py computes them (one
        acquire, one plan and one max per chunk); like cache.acquire, each chunk's slots are claimed and then the
        chunk is reported to the policy (record_access), so a later chunk's evictions see the earlier chunk's use.
        """
        self.current_layer = layer
        resident, c, cap = self.resident, self.counters, self.capacity
        hits: list[bool] = []
        stall = host = 0.0
        for start in range(0, len(experts), cap):
            chunk_experts = experts[start : start + cap]
            chunk = tuple([(layer, e) for e in chunk_experts])
            first = len(hits)
            self.set_pinned(chunk)
            tokens = counts[start : start + cap] if counts is not None else (1,) * len(chunk)
            missed = [i for i, key in enumerate(chunk) if key not in resident]
            flags = plan([tokens[i] for i in missed]) if plan is not None and missed else [False] * len(missed)
            on_cpu = {missed[j] for j, cpu in enumerate(flags) if cpu}
            # Nothing changes the policy's mind between this chunk's loads (record_access comes after them): ask for
            # all the victims its misses need at once — the Policy contract makes that the same choice.
            need = len(missed) - len(on_cpu) - (cap - len(resident))
            if need > 0:
                self._victims = self._choose(need)[::-1]  # popped from the end: first victim first
            link = cpu = 0.0
            for i, (key, n) in enumerate(zip(chunk, tokens, strict=True)):
                unused = resident.get(key)
                if unused is not None:
                    hits.append(True)  # what the runtime's cache tells the policy, late or not
                    if unused:
                        resident[key] = False
                        c.prefetch_used += 1
                    if key == self.inflight:  # a late prefetch: wait for its copy, as cache.acquire does
                        link += self.inflight_left / self.cost.bandwidth
                        self._finish_copy()
                        c.late[key] += 1  # neither a hit nor a miss (DESIGN.md, "Hits, late and misses")
                    else:
                        c.hits[key] += 1
                    continue
                hits.append(False)
                c.misses[key] += 1
                if i in on_cpu:
                    c.on_host[key] += 1
                    cpu += self.cost.cpu_s(n)
                    continue
                if not self._insert(key, by_prefetch=False):
                    # Every other slot is pinned: wait for the copy in flight to free one, as cache.acquire does.
                    link += self.inflight_left / self.cost.bandwidth
                    self._finish_copy()
                    if not self._insert(key, by_prefetch=False):
                        raise RuntimeError("The cache has no slot to load into; raise the cache size.")
                c.bytes_moved += self.cost.expert_bytes
                link += self.cost.load_s
            stall += max(0.0, link - cpu)
            host += cpu
            self._victims = []
            self.policy.record_access(layer, list(chunk_experts), hits[first:])
        c.stall_s += stall
        c.host_s += host
        return hits, stall, host

    def end_request(self) -> None:
        for key, unused in self.resident.items():
            if unused:
                self.counters.prefetch_wasted += 1
                self.resident[key] = False
