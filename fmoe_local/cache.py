"""ExpertCache: a fixed number of device slots holding expert weights, allocated once.

Scope: residency (which (layer, expert) sits in which slot), on-demand loads, prefetch loads, pinning of the experts
a layer is computing with, eviction through the policy, and hit/miss/prefetch accounting. It does NOT decide what to
prefetch (policies/), when (prefetcher.py), or how experts are computed (experts.py).

Budget: the slot tensors are the only device memory expert weights ever occupy, so `capacity * expert_bytes` is a
hard ceiling, in prefill too (experts.py computes a layer in chunks of at most `capacity` experts).

Complete: once every expert of the model is resident (possible only with L·J slots) nothing can miss or be evicted
again, and acquire takes a short path (no loads, waits or stall clock).

Threads: the forward thread calls acquire/release; the prefetcher thread calls try_prefetch. One lock guards the
residency tables; copies run outside it. Host copies are permanent, so eviction only frees a slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fmoe_local.host import HostStore
from fmoe_local.policies.base import ExpertKey, Policy
from fmoe_local.stats import LayerCounters

GIB = 1024**3


def slots_for_budget(cache_gb: float, expert_bytes: int) -> int:
    return int(cache_gb * GIB // expert_bytes)


@dataclass
class _Slot:
    key: ExpertKey | None = None
    pins: int = 0
    ready: threading.Event = field(default_factory=threading.Event)
    by_prefetch: bool = False  # loaded by the prefetcher and not used yet
    copy_event: object | None = None  # CUDA: the copy's completion on the copy stream
    last_use: object | None = None  # CUDA: compute stream event after the last kernel reading this slot


class _Copier:
    """Moves one expert from the host store into a slot: a plain copy on CPU, a copy stream + events on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        # One pinned staging set per thread (forward thread, prefetcher thread), reused: pinning is expensive, and
        # only staging is pinned because pinning every expert exhausts consumer machines' RAM.
        self._staging = threading.local()

    def copy(self, slot: _Slot, dst: dict[str, torch.Tensor], index: int, src: dict[str, torch.Tensor]) -> None:
        if not self.cuda:
            for name, t in src.items():
                dst[name][index].copy_(t)
            return
        # Pinned staging so the DMA is truly asynchronous; the copy stream first waits for the last kernels that
        # read this slot's previous occupant.
        staged = getattr(self._staging, "buffers", None)
        if staged is None:
            staged = {name: torch.empty_like(t, device="cpu").pin_memory() for name, t in src.items()}
            self._staging.buffers = staged
        for name, t in src.items():
            staged[name].copy_(t)
        with torch.cuda.stream(self.stream):
            if slot.last_use is not None:
                self.stream.wait_event(slot.last_use)
            for name, t in staged.items():
                dst[name][index].copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        slot.copy_event = event
        # The staging buffers are reused by this thread's next copy: wait for this DMA to finish first.
        event.synchronize()


class ExpertCache:
    def __init__(
        self,
        host: HostStore,
        capacity: int,
        device: torch.device,
        policy: Policy,
        counters: LayerCounters,
    ) -> None:
        if capacity < 1:
            raise ValueError(
                f"The expert cache is smaller than one expert ({host.expert_bytes / GIB:.3f} GB). "
                "Give it more GB in the settings."
            )
        self.host = host
        self.device = device
        self.capacity = min(capacity, host.num_layers * host.num_experts)
        self.policy = policy
        self.counters = counters
        self.expert_bytes = host.expert_bytes
        self.tensors = {
            name: torch.empty((self.capacity, *shape), dtype=host.param_dtype, device=device)
            for name, shape in host.param_shapes.items()
        }
        self._slots = [_Slot() for _ in range(self.capacity)]
        self._slot_of: dict[ExpertKey, int] = {}
        self._free = list(range(self.capacity - 1, -1, -1))
        self._lock = threading.Condition()
        self._demand = 0  # on-demand loads in progress: the prefetcher yields to them
        self._held: list[int] = []  # slots of the last acquire, pinned until the next one
        self._copier = _Copier(device)
        self.current_layer = -1
        self._total = host.num_layers * host.num_experts
        self._complete = False  # every expert resident and loaded: see `complete`

    # ---- introspection -------------------------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self.capacity * self.expert_bytes

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def resident(self) -> list[ExpertKey]:
        with self._lock:
            return [s.key for s in self._slots if s.key is not None and s.ready.is_set()]

    def resident_bytes(self) -> int:
        return len(self.resident()) * self.expert_bytes

    def claimed_mask(self) -> np.ndarray:
        """[L, J] bool: experts resident or being copied in, i.e. what a prefetch would find already there."""
        mask = np.zeros((self.host.num_layers, self.host.num_experts), bool)
        with self._lock:
            keys = list(self._slot_of)
        if keys:
            layers, experts = zip(*keys, strict=True)
            mask[list(layers), list(experts)] = True
        return mask

    @property
    def on_demand_active(self) -> bool:
        return self._demand > 0

    @property
    def complete(self) -> bool:
        """Every expert of the model is resident and loaded. Final: with no key ever missing, no slot is claimed
        again, so nothing is evicted and nothing can miss — prediction and copies have nothing left to do."""
        return self._complete

    # ---- forward thread ------------------------------------------------------------------------------------------
    def acquire(self, layer: int, experts: Sequence[int]) -> list[int]:
        """Make `experts` of `layer` resident and pinned; returns their slots. Misses load now (on demand)."""
        if len(experts) > self.capacity:
            raise ValueError("acquire() got more experts than the cache has slots; compute in chunks.")
        with self._lock:
            self._unhold_locked()
            self.current_layer = layer
            if self._complete:
                # Nothing to load or wait for (every slot is ready): no on-demand bracket, no stall clock.
                slots = [self._pin_hit_locked(layer, e, self._slot_of[(layer, e)]) for e in experts]
                self.policy.record_access(layer, list(experts), [True] * len(experts))
                self._wait_copies(slots)
                return slots
            loads: list[tuple[int, ExpertKey]] = []
            waits: list[int] = []
            hits: list[bool] = []
            slots = []
            self._demand += 1
            # Pin every resident expert of this access first, so that loading a missing one can never evict
            # another expert the same layer is about to use.
            for e in experts:
                s = self._slot_of.get((layer, e))
                hits.append(s is not None)
                slots.append(-1 if s is None else s)
                if s is None:
                    continue
                self._pin_hit_locked(layer, e, s)
                if not self._slots[s].ready.is_set():
                    waits.append(s)
            for i, e in enumerate(experts):
                if hits[i]:
                    continue
                s = self._claim_locked((layer, e), current_layer=layer)
                self._slots[s].pins += 1
                loads.append((s, (layer, e)))
                slots[i] = s
                self.counters.misses[layer, e] += 1
            self.policy.record_access(layer, list(experts), hits)
        t0 = time.perf_counter()
        try:
            for s, key in loads:
                self._load(s, key)
            for s in waits:
                self._slots[s].ready.wait()
        finally:
            with self._lock:
                self._demand -= 1
                self.counters.stall_s += time.perf_counter() - t0
                self._lock.notify_all()
        self._wait_copies(slots)
        return slots

    def _pin_hit_locked(self, layer: int, expert: int, s: int) -> int:
        slot = self._slots[s]
        slot.pins += 1
        if slot.by_prefetch:
            slot.by_prefetch = False
            self.counters.prefetch_used += 1
        self.counters.hits[layer, expert] += 1
        return s

    def _wait_copies(self, slots: list[int]) -> None:
        """CUDA: the compute stream waits for the copies into `slots`. Once it has, later work on that stream is
        ordered after them anyway, so the event is dropped (the slots are pinned: no copy can replace it)."""
        if not self._copier.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        for s in slots:
            slot = self._slots[s]
            if slot.copy_event is not None:
                stream.wait_event(slot.copy_event)
                slot.copy_event = None

    def release(self, slots: Sequence[int]) -> None:
        last_use = None
        if self._copier.cuda and not self._complete:  # complete: no copy will ever need to wait for these kernels
            last_use = torch.cuda.Event()
            last_use.record(torch.cuda.current_stream(self.device))
        with self._lock:
            for s in slots:
                if last_use is not None:
                    self._slots[s].last_use = last_use
            # The layer's experts stay pinned until the next acquire (or the next forward pass): copies that
            # overlap this layer must not evict what it is using — the replay benchmark models the same rule.
            self._held.extend(slots)
            self._lock.notify_all()

    def unhold(self) -> None:
        """A new forward pass starts: the previous layer's experts are no longer in use."""
        with self._lock:
            self._unhold_locked()
            self._lock.notify_all()

    def _unhold_locked(self) -> None:
        for s in self._held:
            self._slots[s].pins -= 1
        self._held.clear()

    # ---- prefetcher thread ---------------------------------------------------------------------------------------
    def try_prefetch(self, layer: int, expert: int) -> bool:
        """Load (layer, expert) if absent and a slot can be freed without touching pinned experts."""
        key = (layer, expert)
        with self._lock:
            if key in self._slot_of or self._demand:
                return False
            if not self._free and not self._evictable_locked():
                return False
            s = self._claim_locked(key, current_layer=self.current_layer)
            self._slots[s].by_prefetch = True
            self.counters.prefetched[layer, expert] += 1
        self._load(s, key)
        return True

    # ---- internals -----------------------------------------------------------------------------------------------
    def _evictable_locked(self) -> list[ExpertKey]:
        return [s.key for s in self._slots if s.key is not None and s.pins == 0 and s.ready.is_set()]

    def _claim_locked(self, key: ExpertKey, current_layer: int) -> int:
        if self._free:
            s = self._free.pop()
        else:
            candidates = self._evictable_locked()
            while not candidates:
                # Every slot is pinned or still loading: wait for an in-flight copy or a release.
                self._lock.wait(timeout=1.0)
                candidates = self._evictable_locked()
            victim = self.policy.choose_victims(candidates, current_layer, 1)[0]
            s = self._slot_of.pop(victim)
            if self._slots[s].by_prefetch:
                self.counters.prefetch_wasted += 1
        slot = self._slots[s]
        slot.key, slot.pins, slot.by_prefetch = key, 0, False
        slot.ready = threading.Event()
        self._slot_of[key] = s
        return s

    def _load(self, s: int, key: ExpertKey) -> None:
        slot = self._slots[s]
        self._copier.copy(slot, self.tensors, s, self.host.read(*key))
        with self._lock:
            self.counters.bytes_moved += self.expert_bytes
            slot.ready.set()
            if len(self._slot_of) == self._total and all(x.ready.is_set() for x in self._slots):
                self._complete = True
            self._lock.notify_all()

    def drop_unused_prefetches(self) -> int:
        """Count prefetched experts still unused at the end of a request as wasted (they stay resident)."""
        with self._lock:
            wasted = 0
            for slot in self._slots:
                if slot.by_prefetch:
                    slot.by_prefetch = False
                    wasted += 1
            self.counters.prefetch_wasted += wasted
            return wasted
