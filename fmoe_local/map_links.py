"""Successor links of the map store: for each stored map, the slot of the map stored right after it in its request.

Scope: one [C] slot array and the rules that keep it true while the store writes, clears, resizes and renumbers.
It does NOT hold maps, lock (MapStore calls it under its own lock) or persist (MapStore hands links to its
MapPersistence).

Why the store owns them: the successor of the map most similar to the current iteration predicts the next
iteration (policies/fmoe.py, "Successor links"); held with the maps, they are saved and loaded with them, so the
user's history keeps helping after a restart.

Rules: recording `prev → slot` overwrites prev's link. Replacing a slot's map keeps the links that point at it, and
its own outgoing link until a new one is recorded: the store replaces the map most similar to the new one, so a
link still points at a similar map. A link only ever joins two stored slots; renumbering maps both ends and drops
a link whose target is gone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class SuccessorLinks:
    def __init__(self, capacity: int) -> None:
        self._next = np.full(capacity, -1, np.int64)  # [C] slot stored after slot s in its request, or −1

    def get(self, slot: int, n: int) -> int:
        """The successor of `slot` among the n stored maps, −1 if none is known."""
        if not 0 <= slot < n:
            return -1
        nxt = int(self._next[slot])
        return nxt if 0 <= nxt < n else -1

    def record(self, prev: int, slot: int, n: int) -> bool:
        """Link `prev → slot` when both are stored slots; True if recorded."""
        if not (0 <= prev < n and 0 <= slot < n):
            return False
        self._next[prev] = slot
        return True

    def targets(self, n: int) -> np.ndarray:
        """[n] a copy of the links of slots 0..n−1 (−1: none)."""
        return self._next[:n].copy()

    def clear(self) -> None:
        self._next[:] = -1

    def reset(self, capacity: int, kept: np.ndarray, targets: Sequence[int] | np.ndarray) -> int:
        """Start over with room for `capacity` slots after a renumbering: new slot i is old slot kept[i] (ascending),
        linked to old slot targets[i] (−1: none). Returns how many links were dropped (target not kept)."""
        new = renumber(kept, targets)
        self._next = np.full(capacity, -1, np.int64)
        self._next[: new.size] = new
        return int(np.count_nonzero((new < 0) & (np.asarray(targets, np.int64) >= 0)))


def renumber(kept: np.ndarray, targets: Sequence[int] | np.ndarray) -> np.ndarray:
    """Links after renumbering: map i is old slot kept[i] (ascending) and linked to old slot targets[i] (−1: none).

    Returns [len(kept)] new slots (the target's index in `kept`), −1 where there was none or the target was not kept.
    """
    kept = np.asarray(kept, np.int64)
    targets = np.asarray(targets, np.int64)
    if kept.size == 0:
        return np.zeros(0, np.int64)
    idx = np.minimum(np.searchsorted(kept, targets), kept.size - 1)
    return np.where((targets >= 0) & (kept[idx] == targets), idx, -1)
