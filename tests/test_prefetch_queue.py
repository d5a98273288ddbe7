"""prefetch_queue.py: one entry per expert, highest priority first, nothing stale handed out."""

from __future__ import annotations

import numpy as np

from fmoe_local.policies.base import Prefetch, PrefetchBatch
from fmoe_local.prefetch_queue import PrefetchQueue


def drain(q: PrefetchQueue, iteration: int = 0, current_layer: int = -1) -> list[tuple[int, int]]:
    out = []
    while (key := q.pop(iteration, current_layer)) is not None:
        out.append(key)
    return out


def test_highest_priority_first_and_ties_in_request_order() -> None:
    q = PrefetchQueue(3, 4)
    q.push(0, [Prefetch(2, 1, 0.5), Prefetch(1, 3, 0.9), Prefetch(0, 2, 0.5), Prefetch(1, 0, 0.5)])
    assert len(q) == 4
    assert drain(q) == [(1, 3), (2, 1), (0, 2), (1, 0)]
    assert len(q) == 0


def test_asking_again_keeps_the_higher_priority_once() -> None:
    q = PrefetchQueue(2, 4)
    q.push(0, [Prefetch(1, 1, 0.2), Prefetch(1, 2, 0.3)])
    q.push(0, [Prefetch(1, 1, 0.4), Prefetch(1, 2, 0.1)])  # (1,1) raised, (1,2) keeps 0.3
    q.push(0, [Prefetch(0, 0, 0.3)])  # ties with (1,2), asked later
    assert len(q) == 3
    assert drain(q) == [(1, 1), (1, 2), (0, 0)]


def test_the_same_expert_twice_in_one_batch_keeps_its_best() -> None:
    q = PrefetchQueue(2, 4)
    q.push(0, PrefetchBatch(np.array([1, 1, 0]), np.array([3, 3, 0]), np.array([0.1, 0.7, 0.5])))
    assert len(q) == 2
    assert drain(q) == [(1, 3), (0, 0)]


def test_layers_already_reached_and_older_passes_are_never_handed_out() -> None:
    q = PrefetchQueue(4, 2)
    q.push(5, [Prefetch(0, 0, 9.0), Prefetch(1, 1, 8.0), Prefetch(3, 0, 1.0)])
    assert q.pop(5, current_layer=1) == (3, 0)  # layers 0 and 1 have run
    assert len(q) == 0  # the passed ones are forgotten, so len() means work left
    q.push(4, [Prefetch(3, 1, 1.0)])  # an older forward pass: ignored
    assert len(q) == 0
    q.push(5, [Prefetch(2, 0, 1.0)])
    assert q.pop(6, current_layer=-1) is None  # the forward pass moved on: everything queued is stale
    q.push(6, [Prefetch(2, 1, 1.0)])
    q.push(7, [Prefetch(3, 1, 0.5)])  # a newer pass drops the older entries
    assert drain(q, 7) == [(3, 1)]


def test_batch_reads_as_a_sequence_of_prefetches() -> None:
    batch = PrefetchBatch(np.array([1, 2]), np.array([0, 3]), np.array([0.5, 0.25]))
    assert list(batch) == [Prefetch(1, 0, 0.5), Prefetch(2, 3, 0.25)]
    assert batch == [Prefetch(1, 0, 0.5), Prefetch(2, 3, 0.25)] and len(batch[1:]) == 1
    assert PrefetchBatch(np.array([]), np.array([]), np.array([])) == []


def test_resident_experts_are_dropped_not_handed_out() -> None:
    q = PrefetchQueue(2, 3)
    q.push(0, [Prefetch(1, 0, 0.9), Prefetch(1, 1, 0.8), Prefetch(1, 2, 0.1)])
    resident = np.zeros((2, 3), bool)
    resident[1, :2] = True
    assert q.pop(0, -1, resident) == (1, 2)
    assert len(q) == 0  # the resident ones are gone, not waiting behind
