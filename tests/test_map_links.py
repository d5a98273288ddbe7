"""Successor links: recording, bounds, and renumbering when slots move."""

from __future__ import annotations

import numpy as np

from fmoe_local.map_links import SuccessorLinks, renumber


def test_record_overwrites_and_only_joins_stored_slots():
    links = SuccessorLinks(4)
    assert links.record(0, 1, n=2)
    assert not links.record(1, 2, n=2)  # slot 2 is not stored
    assert not links.record(-1, 0, n=2)  # a request's first map has no predecessor
    assert links.get(0, n=2) == 1 and links.get(1, n=2) == -1
    assert links.record(0, 0, n=2)  # a map that replaced its own predecessor links to itself
    assert links.get(0, n=2) == 0
    assert links.get(0, n=0) == -1  # nothing stored: nothing to follow
    links.clear()
    assert links.targets(2).tolist() == [-1, -1]


def test_renumber_maps_both_ends_and_drops_links_to_slots_not_kept():
    kept = np.array([2, 5, 9])  # new slots 0, 1, 2
    assert renumber(kept, [9, 3, -1]).tolist() == [2, -1, -1]
    assert renumber(kept, [5, 2, 5]).tolist() == [1, 0, 1]
    assert renumber(kept, [10, 0, 1]).tolist() == [-1, -1, -1]  # beyond and between the kept slots
    assert renumber(np.zeros(0, np.int64), []).tolist() == []


def test_reset_starts_over_at_the_new_capacity_and_counts_dropped_links():
    links = SuccessorLinks(2)
    assert links.reset(5, np.array([3, 4]), [4, 0]) == 1  # 3 → 4 becomes 0 → 1; 4 → 0 is dropped
    assert links.targets(5).tolist() == [1, -1, -1, -1, -1]
    assert links.record(4, 0, n=5)  # room for the new capacity
