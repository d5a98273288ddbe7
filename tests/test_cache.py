"""ExpertCache: residency, hit/miss accounting, pinning, and the complete state (every expert resident).

A small in-memory host store stands in for a checkpoint: each expert's weights are filled with a value naming it,
so a slot's content says which expert it holds.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from fmoe_local.cache import ExpertCache, ExpertLoadError
from fmoe_local.copier import Interrupted, LoadTimeout
from fmoe_local.host import HostStore
from fmoe_local.policies.base import ModelShape
from fmoe_local.policies.lru import LRUPolicy
from fmoe_local.stats import LayerCounters

L, J, K = 3, 4, 2


class ValueHost(HostStore):
    """Expert (l, e) is a [2, 3] block of the value 10·l + e (a dense store: HostStore's defaults for the rest)."""

    num_layers, num_experts = L, J
    param_shapes = {"w": (2, 3)}
    param_dtype = torch.float32
    expert_bytes = 2 * 3 * 4

    def __init__(self) -> None:
        self.reads: list[tuple[int, int]] = []

    def read(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        self.reads.append((layer, expert))
        return {"w": torch.full((2, 3), float(10 * layer + expert))}

    def close(self) -> None:
        pass


class RecordingPolicy(LRUPolicy):
    """lru, keeping every record_access call."""

    def __init__(self) -> None:
        super().__init__(ModelShape(L, J, K))
        self.accesses: list[tuple[int, list[int], list[bool]]] = []

    def record_access(self, layer: int, experts: Sequence[int], hits: Sequence[bool]) -> None:
        self.accesses.append((layer, list(experts), list(hits)))
        super().record_access(layer, experts, hits)


def make_cache(capacity: int) -> tuple[ExpertCache, ValueHost, RecordingPolicy]:
    host, policy = ValueHost(), RecordingPolicy()
    cache = ExpertCache(host, capacity, torch.device("cpu"), policy, LayerCounters(L, J))
    return cache, host, policy


def holds(cache: ExpertCache, slot: int, layer: int, expert: int) -> bool:
    return bool((cache.tensors["w"][slot] == 10 * layer + expert).all())


def test_cache_is_complete_once_every_expert_is_loaded_and_then_only_hits():
    cache, host, policy = make_cache(capacity=10**6)
    assert cache.capacity == L * J
    for layer in range(L):
        assert not cache.complete
        cache.release(cache.acquire(layer, list(range(J))))
    assert cache.complete
    assert len(host.reads) == L * J
    assert int(cache.counters.misses.sum()) == L * J and int(cache.counters.hits.sum()) == 0

    slots = cache.acquire(1, [0, 3])
    assert holds(cache, slots[0], 1, 0) and holds(cache, slots[1], 1, 3)
    assert policy.accesses[-1] == (1, [0, 3], [True, True])
    assert int(cache.counters.hits[1, 0]) == 1 and int(cache.counters.hits[1, 3]) == 1
    # The running layer's experts stay pinned until the next acquire, as on the general path.
    assert all(cache._slots.pins(s) == 1 for s in slots)
    cache.release(slots)
    assert all(cache._slots.pins(s) == 1 for s in slots)
    cache.release(cache.acquire(2, [1]))
    assert all(cache._slots.pins(s) == 0 for s in slots)
    assert len(host.reads) == L * J  # nothing was copied again
    assert not cache.try_prefetch(0, 0)


def test_a_cache_smaller_than_the_model_is_never_complete():
    cache, host, _ = make_cache(capacity=L * J - 1)
    for _ in range(2):
        for layer in range(L):
            cache.release(cache.acquire(layer, list(range(J))))
            assert not cache.complete
    assert cache.resident_bytes() <= cache.budget_bytes


def test_prefetched_expert_counts_as_used_on_its_first_hit_in_the_complete_state():
    cache, _, _ = make_cache(capacity=L * J)
    for layer in range(L):
        for e in range(J):
            if (layer, e) != (2, 3):
                cache.release(cache.acquire(layer, [e]))
    assert not cache.complete
    assert cache.try_prefetch(2, 3)
    assert cache.complete
    cache.release(cache.acquire(2, [3]))
    cache.release(cache.acquire(2, [3]))
    assert cache.counters.prefetch_used == 1
    assert cache.drop_unused_prefetches() == 0


class GatedHost(ValueHost):
    """Reads of the experts in `gated` wait for `gate`; reads of those in `broken` raise."""

    def __init__(self, gated=(), broken=()) -> None:
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gated, self.broken = set(gated), set(broken)

    def read(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        if (layer, expert) in self.broken:
            raise OSError(5, "Input/output error")
        if (layer, expert) in self.gated:
            self.entered.set()
            self.gate.wait(10)
        return super().read(layer, expert)


def _cache_over(host: ValueHost, capacity: int = 4) -> ExpertCache:
    return ExpertCache(host, capacity, torch.device("cpu"), RecordingPolicy(), LayerCounters(L, J))


def test_a_prefetch_still_copying_is_late_neither_hit_nor_miss():
    host = GatedHost(gated={(1, 2)})
    cache = _cache_over(host)
    prefetch = threading.Thread(target=cache.try_prefetch, args=(1, 2))
    prefetch.start()
    assert host.entered.wait(5)
    threading.Timer(0.1, host.gate.set).start()
    slots = cache.acquire(1, [2])  # waits for the copy in flight
    prefetch.join(5)
    assert holds(cache, slots[0], 1, 2)
    c = cache.counters
    assert (int(c.hits.sum()), int(c.late.sum()), int(c.misses.sum())) == (0, 1, 0)
    assert c.prefetch_used == 1
    assert cache.policy.accesses[-1] == (1, [2], [True])  # the policy hears "there", as the replay tells it


def test_a_failed_load_releases_its_slot_and_raises_a_sentence():
    cache = _cache_over(GatedHost(broken={(0, 1)}))
    with pytest.raises(ExpertLoadError, match="Could not load expert 1 of MoE layer 0.*download the model again"):
        cache.acquire(0, [0, 1])
    assert not cache.claimed_mask()[0, 1]
    assert all(cache._slots.pins(s) == 0 for s in range(cache.capacity))  # the access's pins undone, the hit's too
    cache.host.broken.clear()
    slots = cache.acquire(0, [0, 1])
    assert holds(cache, slots[1], 0, 1)


def test_a_failed_prefetch_raises_on_the_prefetcher_and_releases_its_slot():
    cache = _cache_over(GatedHost(broken={(2, 3)}))
    with pytest.raises(ExpertLoadError):
        cache.try_prefetch(2, 3)
    assert not cache.claimed_mask().any()


def test_interrupt_ends_a_wait_for_a_stuck_read_and_the_read_settles_later():
    host = GatedHost(gated={(0, 0)})
    cache = _cache_over(host)
    threading.Timer(0.2, cache.interrupt.set).start()
    with pytest.raises(Interrupted):
        cache.acquire(0, [0])
    assert all(cache._slots.pins(s) == 0 for s in range(cache.capacity))
    cache.interrupt.clear()
    host.gate.set()  # the read finishes in the background and its slot becomes an ordinary resident expert
    slots = cache.acquire(0, [0])
    assert holds(cache, slots[0], 0, 0)
    assert len(host.reads) == 1


def test_a_wait_past_the_deadline_says_what_to_check():
    host = GatedHost(gated={(0, 0)})
    cache = ExpertCache(host, 4, torch.device("cpu"), RecordingPolicy(), LayerCounters(L, J), load_timeout_s=0.2)
    with pytest.raises(LoadTimeout, match="expert 0 of MoE layer 0 took too long.*check the disk"):
        cache.acquire(0, [0])
    host.gate.set()


def test_a_miss_claimed_by_on_host_is_counted_and_reported_but_never_loaded():
    cache, host, policy = make_cache(capacity=3)
    cache.release(cache.acquire(0, [1]))  # (0, 1) resident
    host.reads.clear()
    asked = []
    slots = cache.acquire(0, [1, 2, 3], on_host=lambda missing: asked.append(missing) or [e == 3 for e in missing])
    assert asked == [[2, 3]]  # once per access, about its misses only, in access order
    # 1 hits, 2 is loaded into a slot, 3 is left to the caller (slot −1): nothing read or claimed for it.
    assert slots[0] >= 0 and slots[1] >= 0 and slots[2] == -1
    assert host.reads == [(0, 2)] and holds(cache, slots[1], 0, 2)
    assert not cache.claimed_mask()[0, 3]
    c = cache.counters
    assert (int(c.hits[0, 1]), int(c.misses[0, 2]), int(c.misses[0, 3])) == (1, 1, 1)
    assert int(c.on_host.sum()) == 1 and int(c.on_host[0, 3]) == 1
    assert policy.accesses[-1] == (0, [1, 2, 3], [True, False, False])  # the policy sees the access once
    cache.release([s for s in slots if s >= 0])
    # A resident expert is a hit whatever on_host says: it is only asked about misses.
    assert cache.acquire(0, [1], on_host=lambda missing: [True] * len(missing)) != [-1] and int(c.on_host.sum()) == 1


def _join_abandoned_loaders(cache: ExpertCache) -> None:
    """Wait for the loader threads left to stuck reads (their reads have been released by the caller)."""
    for thread in cache._loader.abandoned:
        thread.join(5)


def test_a_read_past_its_deadline_is_given_up_and_nothing_waits_behind_it():
    # A failing disk: before, the loader's one thread stayed inside the read, every later load queued behind it and
    # timed out naming itself, not the expert that hung — until a restart.
    host = GatedHost(gated={(0, 0)})
    cache = ExpertCache(host, 4, torch.device("cpu"), RecordingPolicy(), LayerCounters(L, J), load_timeout_s=0.3)
    with pytest.raises(LoadTimeout, match="expert 0 of MoE layer 0 took too long"):
        cache.acquire(0, [0])
    assert host.entered.is_set() and not cache.claimed_mask()[0, 0]  # the claim was released
    slots = cache.acquire(0, [1])  # another expert loads at once, though the read of (0, 0) is still stuck
    assert holds(cache, slots[0], 0, 1)
    cache.release(slots)
    host.gated.clear()  # the disk answers again: the same expert is read afresh
    slots = cache.acquire(0, [0])
    assert holds(cache, slots[0], 0, 0) and host.reads.count((0, 0)) == 1  # GatedHost logs a read when it returns
    cache.release(slots)
    cache.unhold()
    host.gate.set()  # the first read finally returns: its late result must land nowhere
    _join_abandoned_loaders(cache)
    assert len(cache._loader.abandoned) == 1 and host.reads.count((0, 0)) == 2
    for key in cache.resident():
        assert holds(cache, cache._slots.slot_of[key], *key)
    assert sorted(cache.resident()) == [(0, 0), (0, 1)]
    cache.close()


def test_after_stop_a_stuck_read_keeps_its_claim_but_no_load_waits_behind_it():
    host = GatedHost(gated={(0, 0)})
    cache = ExpertCache(host, 4, torch.device("cpu"), RecordingPolicy(), LayerCounters(L, J), load_timeout_s=2.0)
    threading.Timer(0.2, cache.interrupt.set).start()
    with pytest.raises(Interrupted):
        cache.acquire(0, [0])
    cache.interrupt.clear()
    slots = cache.acquire(1, [2])  # before: queued behind the stuck read until its deadline (LoadTimeout)
    assert holds(cache, slots[0], 1, 2)
    cache.release(slots)
    host.gate.set()  # a slow read, not a lost one: it lands in the claim it kept
    _join_abandoned_loaders(cache)
    slots = cache.acquire(0, [0])
    assert holds(cache, slots[0], 0, 0) and host.reads.count((0, 0)) == 1
    cache.close()


def test_a_slot_is_not_overwritten_before_the_kernels_reading_its_last_expert_are_done():
    """The slot-reuse guard (CUDA logic on the fake streams): `release` records an event after the layer's kernels
    (`last_use`), and the copy of the next expert into that slot waits for it on its copy stream. Without it a copy
    could overwrite weights a kernel still reads, and nothing else would notice."""
    from tests.fake_streams import FakeStreams

    fake = FakeStreams()
    cache = ExpertCache(ValueHost(), 1, torch.device("cpu"), RecordingPolicy(), LayerCounters(L, J), streams=fake)
    (s,) = cache.acquire(0, [0])
    cache.before_use(s)
    cache.release([s])
    kernels_done = next(e for e in reversed(fake.log) if e[0] == "record" and e[2] == "compute")[1]
    cache.unhold()  # the next forward pass: expert (0, 0) is no longer in use and may be evicted
    assert cache.acquire(0, [1]) == [s]  # the one slot, reused
    copy_waits = [e for e in fake.log if e[0] == "wait_event" and e[1].startswith("copy")]
    assert kernels_done in [e[2] for e in copy_waits], fake.log
    cache.close()
