"""The replay's simulated copier and clock around the runtime's own cache rules (fmoe_local/slot_table.py).

Scope: what the live cache does with threads and a copy engine, done here in simulated time — one prefetch copy in
flight that progresses by bytes through the transfer windows replay.py gives it, on-demand loads that land at once
and cost `cost.load_s`, misses computed on the host (at the same time as the layer's copies), prefills wider than
the cache taken in chunks as experts.py does, and the stall each layer adds. Residency, pins, victim choice, prefetch
admission and every count (hit, late, miss, on host, prefetched, used, wasted, bytes) are the SlotTable's, the same
object the runtime's cache.py drives. It does NOT order events or time iterations (replay.py does) and it never
decides what to prefetch or evict.
"""

from __future__ import annotations

from collections.abc import Callable

from fmoe_bench.presets import CostModel
from fmoe_local.policies.base import ExpertKey, ModelShape, Policy
from fmoe_local.prefetch_queue import PrefetchQueue
from fmoe_local.slot_table import SlotTable
from fmoe_local.stats import LayerCounters


class SimCache:
    """A SlotTable of `capacity` slots driven by a simulated link (it is the table's `Loads`)."""

    def __init__(self, shape: ModelShape, capacity: int, policy: Policy, cost: CostModel) -> None:
        self.cost = cost
        self.counters = LayerCounters(shape.num_layers, shape.num_experts)
        self.table = SlotTable(shape.num_layers, shape.num_experts, capacity, policy, self.counters, cost.expert_bytes)
        self.inflight: int | None = None  # the slot of the prefetch being copied
        self.inflight_left = 0.0  # its bytes still to copy
        self._link = 0.0  # seconds of link work of the access in progress

    def begin_iteration(self) -> None:
        """A forward pass starts: the last layer's experts are no longer in use (prefetcher.py's begin_iteration)."""
        self.table.current_layer = -1
        self.table.unhold()

    def transfer(self, budget: float, queue: PrefetchQueue, iteration: int) -> None:
        """Move up to `budget` bytes of queued prefetches, highest priority first (timeline: replay.py)."""
        while budget > 0:
            if self.inflight is None and not self._start_next(queue, iteration):
                return
            step = min(budget, self.inflight_left)
            budget -= step
            self.inflight_left -= step
            if self.inflight_left <= 0:
                self._land_inflight()

    def _start_next(self, queue: PrefetchQueue, iteration: int) -> bool:
        table = self.table
        while (key := queue.pop(iteration, table.current_layer, table.claimed)) is not None:
            s = table.admit_prefetch(*key)
            if s is None:
                continue  # every slot held: the runtime drops the prefetch too
            self.inflight, self.inflight_left = s, float(self.cost.expert_bytes)
            return True
        return False

    def _land_inflight(self) -> None:
        s, self.inflight, self.inflight_left = self.inflight, None, 0.0
        self.table.land(s)

    # ---- the table's Loads ---------------------------------------------------------------------------------------
    def pinned(self, s: int, key: ExpertKey, landed: bool) -> None:
        if not landed:  # late: wait for the rest of its copy, as cache.acquire does (only the copy in flight is)
            self._link += self.inflight_left / self.cost.bandwidth
            self._land_inflight()

    def load(self, s: int, key: ExpertKey) -> None:
        self._link += self.cost.load_s
        self.table.land(s)

    def wait_for_slot(self) -> None:
        # Every other slot is pinned: wait for the copy in flight to free one, as cache.acquire does.
        if self.inflight is None:
            raise RuntimeError("The cache has no slot to load into; raise the cache size.")
        self._link += self.inflight_left / self.cost.bandwidth
        self._land_inflight()

    # ---- the forward pass ----------------------------------------------------------------------------------------
    def access(
        self,
        layer: int,
        experts: tuple[int, ...],
        counts: tuple[int, ...] | None = None,
        plan: Callable[[list[int]], list[bool]] | None = None,
    ) -> tuple[float, float]:
        """The forward pass needs `experts` of `layer`: returns the stall and the host compute in seconds.

        `plan(tokens)` (miss handling: the runtime's own `MissPlanner.plan`) gets the token counts of the layer's
        misses and says which the host computes: they load nothing and cost the CPU `cost.cpu_s(tokens)` each, as
        offload.py and experts.py do. `counts[i]` is how many tokens need `experts[i]` (1 when not given: decode).

        Time: the link's work for the layer (the rest of a late prefetch's copy, the copy a slot waits for, the
        on-demand loads) and the CPU's share run at once — the runtime issues the copies before the CPU computes —
        so the layer waits max(link, CPU). The returned stall is the part of the link's time the CPU does not cover
        (stall + host = that max); the CPU's work is still never credited as overlapping the GPU's compute.

        More experts than slots (a long prefill) are taken in chunks of `capacity`, as experts.py computes them:
        one access (and release), one plan and one max per chunk, so a later chunk's evictions see the earlier
        chunk's use.
        """
        table, cost, cap = self.table, self.cost, self.table.capacity
        stall = host = 0.0
        for start in range(0, len(experts), cap):
            chunk = experts[start : start + cap]
            cpu = 0.0
            on_host = None
            if plan is not None:
                n = counts[start : start + cap] if counts is not None else (1,) * len(chunk)
                tokens = dict(zip(chunk, n, strict=True))

                def on_host(missing: list[int], tokens: dict[int, int] = tokens) -> list[bool]:
                    nonlocal cpu
                    flags = plan([tokens[e] for e in missing])
                    cpu += sum(cost.cpu_s(tokens[e]) for e, f in zip(missing, flags, strict=True) if f)
                    return flags

            self._link = 0.0
            slots = table.access(layer, chunk, self, on_host)
            table.release([s for s in slots if s >= 0])
            stall += max(0.0, self._link - cpu)
            host += cpu
        self.counters.stall_s += stall
        self.counters.host_s += host
        return stall, host

    def end_request(self) -> None:
        self.table.end_request()
