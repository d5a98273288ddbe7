"""ExpertCache: a fixed number of device slots holding expert weights, allocated once.

Scope: residency (which (layer, expert) sits in which slot), on-demand loads, prefetch loads, pinning of the experts
a layer is computing with, eviction through the policy, and hit/miss/prefetch accounting. It does NOT decide what to
prefetch (policies/), when (prefetcher.py), or how experts are computed (experts.py).

Budget: the slot tensors are the only device memory expert weights ever occupy, so `capacity * expert_bytes` is a
hard ceiling, in prefill too (experts.py computes a layer in chunks of at most `capacity` experts).

Complete: once every expert of the model is resident (possible only with L·J slots) nothing can miss or be evicted
again, and acquire takes a short path (no loads, waits or stall clock).

Threads (the Offload's rule, offload.py, which alone owns the cache): the forward thread calls acquire/release; the
prefetcher thread calls try_prefetch and copies its own prefetches; the forward pass's on-demand loads run on the
loader thread (copier.py) while the forward thread waits for them. One lock guards the residency tables (slot_table.py);
copies run outside it, in chunks, and a prefetch gives way to a running on-demand load between chunks (`_give_way`).
On CUDA a landing means the copy is issued: the forward thread never waits for a copy on the host, the compute stream
waits for its event (`before_use`). Host copies are permanent, so eviction only frees a slot.

Failures and waits: a load that fails releases its slot and raises (to the forward pass, or to the prefetcher,
which reports it to the request); every wait has a deadline (`load_timeout_s`) and gives up at once when
`interrupt` is set (Stop, close; loads nobody waits for any more are then dropped unless started), so no wait here
is unbounded.

Counting (the one definition, DESIGN.md "Hits, late and misses"): an access is a hit when its expert is resident
and copied, late when a prefetch of it is still copying, a miss when it is not in the cache at all — loaded on
demand, or computed from the host copy when the caller's `on_host` says so (miss handling, miss_cost.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from fmoe_local.cache_budget import check_capacity
from fmoe_local.copier import Copier, Interrupted, Landing, Loader, LoadTimeout
from fmoe_local.host import HostStore
from fmoe_local.policies.base import ExpertKey, Policy
from fmoe_local.slot_table import SlotTable
from fmoe_local.stats import LayerCounters

OnHost = Callable[[list[int]], Sequence[bool]]  # an access's missing experts → computed on the host, each?


class ExpertLoadError(RuntimeError):
    """An expert could not be read from the host store or copied into its slot; the slot was released."""


class ExpertCache:
    def __init__(
        self,
        host: HostStore,
        capacity: int,
        device: torch.device,
        policy: Policy,
        counters: LayerCounters,
        interrupt: threading.Event | None = None,
        load_timeout_s: float = 60.0,
        copy_chunk_bytes: int = 32 * 1024**2,
        streams: object | None = None,
    ) -> None:
        """`streams`: the CUDA operations (copier.CudaStreams on a GPU; tests pass a fake to run the GPU logic on
        CPU tensors)."""
        check_capacity(capacity, host.expert_bytes)
        self.host = host
        self.device = device
        self.capacity = min(capacity, host.num_layers * host.num_experts)
        self.policy = policy
        self.counters = counters
        self.expert_bytes = host.expert_bytes
        self.tensors = {
            name: torch.empty(
                (self.capacity, *shape), dtype=host.param_dtypes.get(name, host.param_dtype), device=device
            )
            for name, shape in host.param_shapes.items()
        }
        self._slots = SlotTable(self.capacity)
        self._lock = threading.Condition()
        self._demand = 0  # on-demand loads in progress: the prefetcher yields to them
        # CUDA: the event of the last on-demand copy issued (the loader's stream runs them in order, so it stands
        # for all of them). A load is "in progress" above only until its DMA is issued; the prefetcher also waits
        # for this event, or its copies would take half the link from every demand copy still on the wire.
        self._last_demand_copy: object | None = None
        self._slot_waiters = 0  # claims waiting for a slot to become evictable: prefetches must not pause then
        self._held: list[int] = []  # slots of the last acquire, pinned until the next one
        self._copier = Copier(device, copy_chunk_bytes, streams)
        self._loader = Loader()
        self.interrupt = interrupt or threading.Event()
        self.load_timeout_s = load_timeout_s
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
            return self._slots.resident()

    def resident_bytes(self) -> int:
        return len(self.resident()) * self.expert_bytes

    def claimed_mask(self) -> np.ndarray:
        """[L, J] bool: experts resident or being copied in, i.e. what a prefetch would find already there."""
        mask = np.zeros((self.host.num_layers, self.host.num_experts), bool)
        with self._lock:
            keys = list(self._slots.slot_of)
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
    def acquire(self, layer: int, experts: Sequence[int], on_host: OnHost | None = None) -> list[int]:
        """Make `experts` of `layer` resident and pinned; returns their slots. Misses load now (on demand), except
        those `on_host(missing)` claims (one flag per missing expert, in access order): they are counted as misses
        (and as computed on the host), get slot −1 and load nothing — the caller computes them from the host copy,
        after this returns, so the loads are under way by then. The policy sees every access either way."""
        if len(experts) > self.capacity:
            raise ValueError("acquire() got more experts than the cache has slots; compute in chunks.")
        with self._lock:
            self._unhold_locked()
            self.current_layer = layer
            if self._complete:
                # Nothing to load or wait for (every slot is ready): no on-demand bracket, no stall clock.
                slots = [self._pin_hit_locked(layer, e, self._slots.slot_of[(layer, e)]) for e in experts]
                self.policy.record_access(layer, list(experts), [True] * len(experts))
                return slots
            self._demand += 1
        t0 = time.perf_counter()
        deadline = t0 + self.load_timeout_s
        pinned: list[tuple[int, Landing]] = []  # what this access pinned, to undo if it fails
        try:
            with self._lock:
                slots, waits = self._pin_and_claim_locked(layer, experts, pinned, deadline, on_host)
            for landing, key in waits:
                landing.wait_until(deadline, self.interrupt, f"expert {key[1]} of MoE layer {key[0]}")
        except BaseException as exc:
            with self._lock:
                for s, landing in pinned:
                    slot = self._slots[s]
                    if slot.ready is not landing:  # a failed load already released its slot
                        continue
                    slot.pins -= 1
                    if slot.pins or landing.is_set():
                        continue
                    landing.abandoned = True  # nobody waits for it now: skipped if not started
                    if not isinstance(exc, (LoadTimeout, Interrupted)) or landing.copying:
                        continue
                    # Its read may never return (a failing disk): the loader leaves it its thread and goes on with
                    # the queue, so no later load waits behind it (and a timeout always names the read that hung).
                    if landing.job is not None:
                        self._loader.abandon(landing.job)
                    if isinstance(exc, LoadTimeout):
                        # Past its deadline the read counts as lost: the claim is released, so the next access
                        # reads the expert again instead of waiting on this landing (a late result is dropped).
                        # After Stop it may just be slow: it keeps the claim and lands when the read returns.
                        self._release_locked(s, slot.key, landing, exc)
            raise
        finally:
            with self._lock:
                self._demand -= 1
                self.counters.stall_s += time.perf_counter() - t0
                self._lock.notify_all()
        return slots

    def _pin_and_claim_locked(
        self,
        layer: int,
        experts: Sequence[int],
        pinned: list[tuple[int, Landing]],
        deadline: float,
        on_host: OnHost | None = None,
    ) -> tuple[list[int], list[tuple[Landing, ExpertKey]]]:
        """Pin the resident experts of this access, then claim slots for the missing ones and start their loads.
        Returns the slots and the landings to wait for (late prefetches and the new loads)."""
        waits: list[tuple[Landing, ExpertKey]] = []
        hits: list[bool] = []
        slots = []
        # Pin every resident expert of this access first, so that loading a missing one can never evict
        # another expert the same layer is about to use.
        for e in experts:
            s = self._slots.slot_of.get((layer, e))
            hits.append(s is not None)  # what the policy is told, late or not (the replay tells it the same)
            slots.append(-1 if s is None else s)
            if s is None:
                continue
            slot = self._slots[s]
            if slot.ready.is_set():
                self._pin_hit_locked(layer, e, s)
            else:  # late: its prefetch is still copying
                slot.pins += 1
                if slot.by_prefetch:
                    slot.by_prefetch = False
                    self.counters.prefetch_used += 1
                self.counters.late[layer, e] += 1
                waits.append((slot.ready, (layer, e)))
            pinned.append((s, slot.ready))
        missing = [e for e, hit in zip(experts, hits, strict=True) if not hit]
        host = {e for e, cpu in zip(missing, on_host(missing), strict=True) if cpu} if on_host and missing else ()
        for i, e in enumerate(experts):
            if hits[i]:
                continue
            if e in host:
                self.counters.misses[layer, e] += 1
                self.counters.on_host[layer, e] += 1
                continue  # slot −1: computed from the host copy, nothing loaded
            key = (layer, e)
            s = self._claim_locked(key, current_layer=layer, deadline=deadline)
            slot = self._slots[s]
            slot.pins += 1
            pinned.append((s, slot.ready))
            slots[i] = s
            self.counters.misses[layer, e] += 1
            waits.append((slot.ready, key))
            landing = slot.ready
            landing.job = self._loader.submit(lambda s=s, key=key, landing=landing: self._load(s, key, landing))
        self.policy.record_access(layer, list(experts), hits)
        return slots, waits

    def _pin_hit_locked(self, layer: int, expert: int, s: int) -> int:
        slot = self._slots[s]
        slot.pins += 1
        if slot.by_prefetch:
            slot.by_prefetch = False
            self.counters.prefetch_used += 1
        self.counters.hits[layer, expert] += 1
        return s

    def before_use(self, s: int) -> None:
        """Call right before computing with slot `s` (an acquired slot). CUDA: the compute stream waits for the copy
        into it — per expert, so the first expert of a layer computes while the copies of the next ones go on. Once
        it has waited, later work on that stream is ordered after the copy anyway, so the event is dropped (the slot
        is pinned: no copy can replace it)."""
        if not self._copier.cuda:
            return
        slot = self._slots[s]
        if slot.copy_event is not None:
            self._copier.streams.current().wait_event(slot.copy_event)
            slot.copy_event = None

    def release(self, slots: Sequence[int]) -> None:
        last_use = None
        if self._copier.cuda and not self._complete:  # complete: no copy will ever need to wait for these kernels
            last_use = self._copier.streams.event()
            last_use.record(self._copier.streams.current())
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
            if key in self._slots.slot_of or self._demand:
                return False
            if not self._slots.has_free() and not self._slots.evictable():
                return False
            s = self._claim_locked(key, current_layer=self.current_layer)
            self._slots[s].by_prefetch = True
            self.counters.prefetched[layer, expert] += 1
            landing = self._slots[s].ready
        error = self._load(s, key, landing, pause=lambda: self._give_way(s))
        if error is not None:
            raise error
        return True

    def _give_way(self, s: int) -> None:
        """Between two chunks of a prefetch: wait while an on-demand load runs (on CUDA, until its DMA is done),
        unless the forward pass is itself waiting for this very expert (a late access pinned it) or for a slot to
        free up (this copy's end may be what frees one). Bounded: every demand load ends (its own deadline, Stop,
        close), and so does a DMA once issued."""
        with self._lock:
            while self._demand and not self._slots[s].pins and not self._slot_waiters and not self.interrupt.is_set():
                self._lock.wait(timeout=0.05)
            demand_copy = None
            if not (self._slots[s].pins or self._slot_waiters):
                demand_copy, self._last_demand_copy = self._last_demand_copy, None
        if demand_copy is not None:
            demand_copy.synchronize()  # the prefetcher's thread; a DMA already issued always ends

    # ---- internals -----------------------------------------------------------------------------------------------
    def _claim_locked(self, key: ExpertKey, current_layer: int, deadline: float = math.inf) -> int:
        s = self._slots.take_free()
        if s is None:
            candidates = self._slots.evictable()
            self._slot_waiters += 1
            try:
                while not candidates:
                    # Every slot is pinned or still loading: wait for an in-flight copy or a release.
                    if self.interrupt.is_set():
                        raise Interrupted("Stopped while waiting for a free slot in the expert cache.")
                    if time.perf_counter() > deadline:
                        raise LoadTimeout(
                            "Every slot of the expert cache stayed busy loading for too long. The disk or the model "
                            "files may be failing; check the disk, or download the model again."
                        )
                    self._lock.notify_all()  # a paused prefetch sees the waiter and goes on
                    self._lock.wait(timeout=0.05)
                    candidates = self._slots.evictable()
            finally:
                self._slot_waiters -= 1
            victim = self.policy.choose_victims(candidates, current_layer, 1)[0]
            s = self._slots.evict(victim)
            if self._slots[s].by_prefetch:
                self.counters.prefetch_wasted += 1
        self._slots.occupy(s, key)
        return s

    def _release_locked(self, s: int, key: ExpertKey, landing: Landing, error: BaseException) -> None:
        """A load that will not land: the claim is released (the expert is simply not resident) and its waiters
        hear `error`."""
        self._slots.vacate(s, key, landing)
        landing.set(error)
        self._lock.notify_all()

    def _load(
        self, s: int, key: ExpertKey, landing: Landing, pause: Callable[[], None] | None = None
    ) -> ExpertLoadError | None:
        """Copy `key` into slot `s` and settle `landing`. Never raises: a failure releases the slot and is
        returned (and handed to every waiter through the landing)."""
        slot = self._slots[s]
        with self._lock:
            if landing.is_set():  # given up and released before it started (acquire, on a timeout or Stop)
                return None
            if landing.abandoned and slot.ready is landing and slot.pins == 0:
                # Everyone who wanted it stopped before it started: give the slot back unread.
                self._release_locked(s, key, landing, Interrupted("Stopped before this expert was loaded."))
                return None
        try:
            rows = self.host.read(*key)
            with self._lock:
                if landing.is_set():  # the read outlived its waiters: the claim was released, the slot maybe reused
                    return None
                landing.copying = True
            self._copier.copy(slot, self.tensors, s, rows, pause, self.host.land)
        except Exception as exc:  # noqa: BLE001 - any read/copy failure becomes the waiters' error
            error = ExpertLoadError(
                f"Could not load expert {key[1]} of MoE layer {key[0]}: {exc} If this repeats, the model files "
                "may be damaged: download the model again."
            )
            error.__cause__ = exc
            with self._lock:
                self._release_locked(s, key, landing, error)
            return error
        with self._lock:
            self.counters.bytes_moved += self.expert_bytes
            if pause is None and self._copier.cuda:  # an on-demand copy (read before landing: nobody cleared it)
                self._last_demand_copy = slot.copy_event
            landing.set()
            if self._slots.all_loaded(self._total):
                self._complete = True
            self._lock.notify_all()
        return None

    def pin_host(self, budget_bytes: int) -> int:
        """On CUDA, page-lock up to `budget_bytes` of the host store's RAM experts (host.pin) so that their copies
        skip the staging buffers; returns the bytes pinned (0 on the CPU, or for a store that cannot pin)."""
        if not self._copier.cuda or budget_bytes <= 0:
            return 0
        return self.host.pin(budget_bytes, self._copier.streams.register, self._copier.streams.unregister)

    def close(self) -> None:
        """Ends the loader thread (a load stuck in a read ends with its daemon thread)."""
        self._loader.close()

    def drop_unused_prefetches(self) -> int:
        """Count prefetched experts still unused at the end of a request as wasted (they stay resident)."""
        with self._lock:
            wasted = self._slots.forget_prefetches()
            self.counters.prefetch_wasted += wasted
            return wasted
