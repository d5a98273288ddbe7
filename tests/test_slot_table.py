"""SlotTable: the cache's rules with no thread or clock — what an access counts, pins, victims, prefetch admission.

The live cache (tests/test_cache.py) and the replay (tests/test_replay.py) drive this one table; here a `Loads`
that records what it is asked stands for either.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from fmoe_local.policies.base import ExpertKey, ModelShape
from fmoe_local.policies.lru import LRUPolicy
from fmoe_local.slot_table import SlotTable
from fmoe_local.stats import LayerCounters

L, J, K = 3, 4, 2


class Recorder:
    """A copier that lands every on-demand load at once and leaves prefetches in flight until `land_all`."""

    def __init__(self) -> None:
        self.table: SlotTable | None = None
        self.pins: list[tuple[int, ExpertKey, bool]] = []
        self.loads: list[ExpertKey] = []
        self.waits = 0
        self.on_wait = None

    def pinned(self, s: int, key: ExpertKey, landed: bool) -> None:
        self.pins.append((s, key, landed))

    def load(self, s: int, key: ExpertKey) -> None:
        self.loads.append(key)
        self.table.land(s)

    def wait_for_slot(self) -> None:
        self.waits += 1
        if self.on_wait is None:
            raise TimeoutError("no slot")
        self.on_wait()


class CountingLRU(LRUPolicy):
    def __init__(self) -> None:
        super().__init__(ModelShape(L, J, K))
        self.choices: list[tuple[set, int, int]] = []
        self.accesses: list[tuple[int, list[int], list[bool]]] = []

    def record_access(self, layer: int, experts: Sequence[int], hits: Sequence[bool]) -> None:
        self.accesses.append((layer, list(experts), list(hits)))
        super().record_access(layer, experts, hits)

    def choose_victims(self, candidates, current_layer, count=1):
        self.choices.append((set(candidates), current_layer, count))
        return super().choose_victims(candidates, current_layer, count)


def make(capacity: int) -> tuple[SlotTable, Recorder, CountingLRU]:
    policy = CountingLRU()
    table = SlotTable(L, J, capacity, policy, LayerCounters(L, J), expert_bytes=100)
    loads = Recorder()
    loads.table = table
    return table, loads, policy


def test_an_access_counts_hits_late_misses_and_host_misses_and_tells_the_policy_all_but_host_as_there():
    table, loads, policy = make(4)
    s = table.admit_prefetch(0, 1)  # copying, not landed: late when accessed
    table.access(0, [2], loads)  # loaded at once (Recorder): a hit next time
    slots = table.access(0, [1, 2, 3, 0], loads, on_host=lambda missing: [e == 0 for e in missing])
    c = table.counters
    assert (int(c.late[0, 1]), int(c.hits[0, 2]), int(c.misses[0, 3]), int(c.misses[0, 0])) == (1, 1, 1, 1)
    assert int(c.on_host[0, 0]) == 1 and int(c.on_host.sum()) == 1
    assert slots[0] == s and slots[3] == -1 and not table.claimed[0, 0]
    assert (s, (0, 1), False) in loads.pins and loads.loads == [(0, 2), (0, 3)]
    assert policy.accesses[-1] == (0, [1, 2, 3, 0], [True, True, False, False])
    assert c.prefetched[0, 1] == 1 and c.prefetch_used == 1
    assert c.bytes_moved == 2 * 100  # the two on-demand loads landed; the prefetch has not


def test_pins_last_until_the_next_access_and_pinned_or_loading_slots_are_never_victims():
    table, loads, policy = make(3)
    first = table.access(0, [0, 1], loads)
    table.release(first)
    assert set(table.candidates()) == set()  # pinned until the next access
    assert table.admit_prefetch(1, 0) is not None  # the free slot; still copying
    assert table.admit_prefetch(1, 1) is None  # nothing free, nothing evictable: dropped, never waited for
    table.unhold()
    assert set(table.candidates()) == {(0, 0), (0, 1)}
    table.access(2, [3], loads)  # evicts one of layer 0's, through the policy, never the copy in flight
    assert policy.choices[-1] == ({(0, 0), (0, 1)}, 2, 1)
    assert table.claimed[1, 0]


def test_a_claim_with_every_slot_pinned_or_loading_waits_through_loads_and_then_evicts():
    table, loads, policy = make(2)
    table.release(table.access(0, [0], loads))
    inflight = table.admit_prefetch(1, 3)
    loads.on_wait = lambda: table.land(inflight)  # what the copy engine does meanwhile
    table.access(0, [0, 1], loads)  # (0, 0) pinned again, (1, 3) still copying: (0, 1) must wait
    assert loads.waits == 1 and policy.choices[-1] == ({(1, 3)}, 0, 1)
    assert table.counters.prefetch_wasted == 1 and table.slot_of.keys() == {(0, 0), (0, 1)}


def test_a_waiter_that_gives_up_ends_the_claim():
    table, loads, _ = make(2)
    table.admit_prefetch(2, 0), table.admit_prefetch(2, 1)  # both slots copying, never landing
    with pytest.raises(TimeoutError):
        table.access(0, [0], loads)
    assert loads.waits == 1 and (0, 0) not in table.slot_of


class OneVictimPerAsk(SlotTable):
    def _choose(self, count: int) -> list[ExpertKey]:
        return super()._choose(min(count, 1))


def test_victims_for_a_whole_access_chosen_at_once_equal_those_chosen_one_at_a_time():
    rng = np.random.default_rng(1)
    seq = [(int(rng.integers(L)), rng.choice(J, size=3, replace=False).tolist()) for _ in range(80)]
    outcomes = []
    for cls in (SlotTable, OneVictimPerAsk):
        policy = CountingLRU()
        table = cls(L, J, 6, policy, LayerCounters(L, J), expert_bytes=100)
        loads = Recorder()
        loads.table = table
        for layer, experts in seq:
            table.release(table.access(layer, experts, loads))
        outcomes.append((dict(table.slot_of), table.counters.misses.copy(), [c for _, _, c in policy.choices]))
    (slots_a, misses_a, counts_a), (slots_b, misses_b, counts_b) = outcomes
    assert max(counts_a) > 1 and max(counts_b) == 1  # the two really chose differently
    assert slots_a.keys() == slots_b.keys() and (misses_a == misses_b).all()


def test_random_operations_keep_candidates_the_landed_unpinned_keys_and_the_table_consistent():
    rng = np.random.default_rng(0)
    table, loads, _ = make(7)
    inflight: list[int] = []

    def land_one() -> None:
        table.land(inflight.pop(0))

    loads.on_wait = land_one
    for _ in range(400):
        op = rng.integers(4)
        if op == 0:
            s = table.admit_prefetch(int(rng.integers(L)), int(rng.integers(J)))
            if s is not None:
                inflight.append(s)
        elif op == 1 and inflight:
            land_one()
        elif op == 2:
            table.unhold()
        elif op == 3:
            slots = table.access(int(rng.integers(L)), rng.choice(J, size=2, replace=False).tolist(), loads)
            for s in slots:  # a late access's copy lands before the layer computes
                if s in inflight:
                    inflight.remove(s)
                    table.land(s)
            table.release(slots)
        keys = [table.key_of(s) for s in range(table.capacity)]
        landed_unpinned = {k for s, k in enumerate(keys) if k is not None and table.landed(s) and table.pins(s) == 0}
        assert set(table.candidates()) == landed_unpinned
        assert (
            {k for k in keys if k is not None} == set(table.slot_of) == {tuple(k) for k in np.argwhere(table.claimed)}
        )
        assert len(table.slot_of) + len(table._free) == table.capacity


def test_vacate_frees_a_claim_that_will_not_land_and_complete_needs_every_expert_landed():
    table, loads, _ = make(L * J)
    s = table.admit_prefetch(0, 0)
    table.vacate(s)
    assert not table.claimed[0, 0] and table.has_free() and (0, 0) not in table.slot_of
    for layer in range(L):
        table.release(table.access(layer, list(range(J)), loads))
    assert table.complete
    assert table.admit_prefetch(0, 0) is None
    table.access(1, [0, 1], loads)
    assert int(table.counters.hits.sum()) == 2


def test_unused_prefetches_are_wasted_when_evicted_or_when_the_request_ends():
    table, loads, _ = make(2)
    a, b = table.admit_prefetch(2, 0), table.admit_prefetch(2, 1)
    table.land(a)
    table.land(b)
    table.release(table.access(0, [0], loads))  # evicts one unused prefetch
    assert table.counters.prefetch_wasted == 1
    assert table.end_request() == 1 and table.counters.prefetch_wasted == 2
    assert table.end_request() == 0
