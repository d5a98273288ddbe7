"""What one expert map is, and the contract of whatever keeps maps across restarts.

Scope: the `ExpertMap` record (one iteration's gate distributions + semantic embedding) and the `MapPersistence`
protocol that store/ implements over SQLite. It does NOT store, search or persist anything itself (maps.py holds
the in-memory store, store/maps.py the SQLite side).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class ExpertMap:
    probs: np.ndarray  # [L, J] float32: gate probabilities of every MoE layer
    semantic: np.ndarray | None  # [h] float32: semantic embedding of the iteration, None when unavailable
    request_id: int


@runtime_checkable
class MapPersistence(Protocol):
    """Where maps survive restarts. Slot numbers are the identity on disk: `put` on a used slot replaces it.

    `put_link` and `replace_all` have defaults for a store that cannot do better (a persistence subclasses
    MapPersistence to inherit them): links that last only in memory, and a replacement that a kill in the middle
    leaves half done."""

    def load(self) -> list[tuple[int, ExpertMap]] | list[tuple[int, ExpertMap, int]]:
        """(slot, map), or (slot, map, next_slot) with −1 for none where the store keeps links (`put_link`)."""
        ...

    def put(self, slot: int, expert_map: ExpertMap) -> None:
        """Must not block the caller (queue the write). Writes, links and `clear` must apply in call order."""
        ...

    def clear(self) -> None: ...

    def put_link(self, slot: int, next_slot: int) -> None:
        """`next_slot` was stored right after `slot` in its request (`put` leaves a slot's link); `load()` gives it
        back. Default: not kept, links last only in memory."""

    def replace_all(self, entries: list[tuple[int, ExpertMap, int]]) -> None:
        """Everything stored becomes `entries` (slot, map, next_slot or −1): a renumbering (a capacity change, a load
        that had to compact). A store that can should make it one transaction; this default clears and puts again."""
        self.clear()
        for slot, expert_map, _ in entries:
            self.put(slot, expert_map)
        for slot, _, next_slot in entries:
            if next_slot >= 0:
                self.put_link(slot, next_slot)
