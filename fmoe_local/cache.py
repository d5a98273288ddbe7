"""ExpertCache: a fixed number of device slots holding expert weights, allocated once.

Scope: the slot tensors, the copies into them (on-demand loads on the loader thread, prefetches on the prefetcher's),
the waits for those copies, and their failures. The rules — residency, pins, eviction through the policy, prefetch
admission, hit/late/miss/prefetch accounting — are the SlotTable's (slot_table.py), the object the replay drives too
(fmoe_bench/simcache.py); this class applies them under its lock and does the moving. It does NOT decide what to
prefetch (policies/), when (prefetcher.py), or how experts are computed (experts.py).

Budget: the slot tensors are the only device memory expert weights ever occupy, so `capacity * expert_bytes` is a
hard ceiling, in prefill too (experts.py computes a layer in chunks of at most `capacity` experts).

Complete: once every expert of the model is resident (possible only with L·J slots) nothing can miss or be evicted
again, and acquire takes a short path (no loads, waits or stall clock).

Threads (the Offload's rule, offload.py, which alone owns the cache): the forward thread calls acquire/release; the
prefetcher thread calls try_prefetch and copies its own prefetches; the forward pass's on-demand loads run on the
loader thread (copier.py) while the forward thread waits for them. One lock guards the slot table; copies run outside
it, in chunks, and a prefetch gives way to a running on-demand load between chunks (`_give_way`).
On CUDA a landing means the copy is issued: the forward thread never waits for a copy on the host, the compute stream
waits for its event (`before_use`). Host copies are permanent, so eviction only frees a slot.

Failures and waits: a load that fails releases its slot and raises (to the forward pass, or to the prefetcher,
which reports it to the request); every wait has a deadline (`load_timeout_s`) and gives up at once when
`interrupt` is set (Stop, close; loads nobody waits for any more are then dropped unless started), so no wait here
is unbounded.

Counting: slot_table.py holds the one definition (DESIGN.md "Hits, late and misses"); a miss is computed from the
host copy when the caller's `on_host` says so (miss handling, miss_cost.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fmoe_local.cache_budget import check_capacity
from fmoe_local.copier import Copier, Interrupted, Landing, Loader, LoadTimeout
from fmoe_local.host import HostStore
from fmoe_local.policies.base import ExpertKey, Policy
from fmoe_local.slot_table import OnHost, SlotTable
from fmoe_local.stats import LayerCounters


@dataclass
class DeviceSlot:
    """What a slot needs beyond the table's rules: the Landing of its current claim (a new one per claim) and, on
    CUDA, the events a copy into it must wait for (copier.py reads and sets them)."""

    ready: Landing = field(default_factory=Landing)
    copy_event: object | None = None  # CUDA: the copy's completion on the copy stream
    last_use: object | None = None  # CUDA: compute stream event after the last kernel reading this slot


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
        self.counters = counters
        self.expert_bytes = host.expert_bytes
        self.tensors = {
            name: torch.empty(
                (self.capacity, *shape), dtype=host.param_dtypes.get(name, host.param_dtype), device=device
            )
            for name, shape in host.param_shapes.items()
        }
        self._slots = SlotTable(host.num_layers, host.num_experts, self.capacity, policy, counters, self.expert_bytes)
        self._dev = [DeviceSlot() for _ in range(self.capacity)]
        self._lock = threading.Condition()
        self._demand = 0  # on-demand loads in progress: the prefetcher yields to them
        # CUDA: the event of the last on-demand copy issued (the loader's stream runs them in order, so it stands
        # for all of them). A load is "in progress" above only until its DMA is issued; the prefetcher also waits
        # for this event, or its copies would take half the link from every demand copy still on the wire.
        self._last_demand_copy: object | None = None
        self._slot_waiters = 0  # claims waiting for a slot to become evictable: prefetches must not pause then
        self._copier = Copier(device, copy_chunk_bytes, streams)
        self._loader = Loader()
        self.interrupt = interrupt or threading.Event()
        self.load_timeout_s = load_timeout_s

    # ---- introspection -------------------------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self._slots.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        with self._lock:
            self._slots.policy = policy

    @property
    def current_layer(self) -> int:
        """The layer of the last acquire; −1 once a forward pass starts (the prefetcher sets it)."""
        return self._slots.current_layer

    @current_layer.setter
    def current_layer(self, layer: int) -> None:
        self._slots.current_layer = layer

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
        with self._lock:
            return self._slots.claimed.copy()

    @property
    def on_demand_active(self) -> bool:
        return self._demand > 0

    @property
    def complete(self) -> bool:
        """Every expert of the model is resident and loaded. Final: with no key ever missing, no slot is claimed
        again, so nothing is evicted and nothing can miss — prediction and copies have nothing left to do."""
        return self._slots.complete

    # ---- forward thread ------------------------------------------------------------------------------------------
    def acquire(self, layer: int, experts: Sequence[int], on_host: OnHost | None = None) -> list[int]:
        """Make `experts` of `layer` resident and pinned; returns their slots. Misses load now (on demand), except
        those `on_host(missing)` claims (one flag per missing expert, in access order): they are counted as misses
        (and as computed on the host), get slot −1 and load nothing — the caller computes them from the host copy,
        after this returns, so the loads are under way by then. The policy sees every access either way (the rules:
        slot_table.py)."""
        if len(experts) > self.capacity:
            raise ValueError("acquire() got more experts than the cache has slots; compute in chunks.")
        with self._lock:
            if self._slots.complete:
                # Nothing to load or wait for (every slot is ready): no on-demand bracket, no stall clock.
                return self._slots.access(layer, experts, _Access(self, math.inf))
            self._demand += 1
        t0 = time.perf_counter()
        access = _Access(self, t0 + self.load_timeout_s)
        try:
            with self._lock:
                slots = self._slots.access(layer, experts, access, on_host)
            for landing, key in access.waits:
                landing.wait_until(access.deadline, self.interrupt, f"expert {key[1]} of MoE layer {key[0]}")
        except BaseException as exc:
            with self._lock:
                for s, landing in access.pinned_slots:
                    if self._dev[s].ready is not landing:  # a failed load already released its slot
                        continue
                    self._slots.unpin(s)
                    if self._slots.pins(s) or landing.is_set():
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
                        self._release_locked(s, landing, exc)
            raise
        finally:
            with self._lock:
                self._demand -= 1
                self.counters.stall_s += time.perf_counter() - t0
                self._lock.notify_all()
        return slots

    def before_use(self, s: int) -> None:
        """Call right before computing with slot `s` (an acquired slot). CUDA: the compute stream waits for the copy
        into it — per expert, so the first expert of a layer computes while the copies of the next ones go on. Once
        it has waited, later work on that stream is ordered after the copy anyway, so the event is dropped (the slot
        is pinned: no copy can replace it)."""
        if not self._copier.cuda:
            return
        slot = self._dev[s]
        if slot.copy_event is not None:
            self._copier.streams.current().wait_event(slot.copy_event)
            slot.copy_event = None

    def release(self, slots: Sequence[int]) -> None:
        last_use = None
        if self._copier.cuda and not self._slots.complete:  # complete: no copy will ever wait for these kernels
            last_use = self._copier.streams.event()
            last_use.record(self._copier.streams.current())
        with self._lock:
            for s in slots:
                if last_use is not None:
                    self._dev[s].last_use = last_use
            # The layer's experts stay pinned until the next acquire (or the next forward pass): copies that
            # overlap this layer must not evict what it is using (slot_table.py).
            self._slots.release(slots)
            self._lock.notify_all()

    def unhold(self) -> None:
        """A new forward pass starts: the previous layer's experts are no longer in use."""
        with self._lock:
            self._slots.unhold()
            self._lock.notify_all()

    # ---- prefetcher thread ---------------------------------------------------------------------------------------
    def try_prefetch(self, layer: int, expert: int) -> bool:
        """Load (layer, expert) if absent and a slot can be freed without touching pinned experts."""
        with self._lock:
            if self._demand:
                return False
            s = self._slots.admit_prefetch(layer, expert)
            if s is None:
                return False
            landing = self._dev[s].ready = Landing()
        error = self._load(s, (layer, expert), landing, pause=lambda: self._give_way(s))
        if error is not None:
            raise error
        return True

    def _give_way(self, s: int) -> None:
        """Between two chunks of a prefetch: wait while an on-demand load runs (on CUDA, until its DMA is done),
        unless the forward pass is itself waiting for this very expert (a late access pinned it) or for a slot to
        free up (this copy's end may be what frees one). Bounded: every demand load ends (its own deadline, Stop,
        close), and so does a DMA once issued."""
        with self._lock:
            while self._demand and not self._slots.pins(s) and not self._slot_waiters and not self.interrupt.is_set():
                self._lock.wait(timeout=0.05)
            demand_copy = None
            if not (self._slots.pins(s) or self._slot_waiters):
                demand_copy, self._last_demand_copy = self._last_demand_copy, None
        if demand_copy is not None:
            demand_copy.synchronize()  # the prefetcher's thread; a DMA already issued always ends

    # ---- internals -----------------------------------------------------------------------------------------------
    def _release_locked(self, s: int, landing: Landing, error: BaseException) -> None:
        """A load that will not land: if slot `s` still holds that claim (`landing`), it is released (the expert is
        simply not resident); the landing's waiters hear `error`."""
        if self._dev[s].ready is landing:
            self._slots.vacate(s)
            self._dev[s].ready = Landing()
        landing.set(error)
        self._lock.notify_all()

    def _load(
        self, s: int, key: ExpertKey, landing: Landing, pause: Callable[[], None] | None = None
    ) -> ExpertLoadError | None:
        """Copy `key` into slot `s` and settle `landing`. Never raises: a failure releases the slot and is
        returned (and handed to every waiter through the landing)."""
        slot = self._dev[s]
        with self._lock:
            if landing.is_set():  # given up and released before it started (acquire, on a timeout or Stop)
                return None
            if landing.abandoned and slot.ready is landing and self._slots.pins(s) == 0:
                # Everyone who wanted it stopped before it started: give the slot back unread.
                self._release_locked(s, landing, Interrupted("Stopped before this expert was loaded."))
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
                self._release_locked(s, landing, error)
            return error
        with self._lock:
            if pause is None and self._copier.cuda:  # an on-demand copy (read before landing: nobody cleared it)
                self._last_demand_copy = slot.copy_event
            self._slots.land(s)
            landing.set()
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
            return self._slots.end_request()


class _Access:
    """One acquire's side of the table's access (slot_table.Loads), run under the cache's lock: it notes what the
    access pinned (to undo on a failure) and what to wait for, starts the misses' loads on the loader thread, and
    waits — releasing the lock — while every slot is pinned or loading."""

    def __init__(self, cache: ExpertCache, deadline: float) -> None:
        self.cache, self.deadline = cache, deadline
        self.pinned_slots: list[tuple[int, Landing]] = []  # what this access pinned, with the claim's landing
        self.waits: list[tuple[Landing, ExpertKey]] = []  # late prefetches and the new loads

    def pinned(self, s: int, key: ExpertKey, landed: bool) -> None:
        ready = self.cache._dev[s].ready
        self.pinned_slots.append((s, ready))
        if not landed:  # late: its prefetch is still copying
            self.waits.append((ready, key))

    def load(self, s: int, key: ExpertKey) -> None:
        cache = self.cache
        landing = cache._dev[s].ready = Landing()
        self.pinned_slots.append((s, landing))
        self.waits.append((landing, key))
        landing.job = cache._loader.submit(lambda: cache._load(s, key, landing))

    def wait_for_slot(self) -> None:
        cache = self.cache
        if cache.interrupt.is_set():
            raise Interrupted("Stopped while waiting for a free slot in the expert cache.")
        if time.perf_counter() > self.deadline:
            raise LoadTimeout(
                "Every slot of the expert cache stayed busy loading for too long. The disk or the model "
                "files may be failing; check the disk, or download the model again."
            )
        cache._slot_waiters += 1
        try:
            cache._lock.notify_all()  # a paused prefetch sees the waiter and goes on
            cache._lock.wait(timeout=0.05)
        finally:
            cache._slot_waiters -= 1
