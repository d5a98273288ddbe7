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

    Optional `put_link(slot, next_slot)` keeps successor links (`put` leaves a slot's link); `load()` then gives
    (slot, map, next_slot), −1 for none. Without it, entries are (slot, map) and links last only in memory.
    Optional `replace_all([(slot, map, next_slot)])`: everything stored replaced at once, as one transaction (a
    renumbering: a capacity change, a load that had to compact); without it the store clears and puts again, which
    a kill in the middle leaves half done."""

    def load(self) -> list[tuple[int, ExpertMap]] | list[tuple[int, ExpertMap, int]]: ...

    def put(self, slot: int, expert_map: ExpertMap) -> None:
        """Must not block the caller (queue the write). Writes, links and `clear` must apply in call order."""
        ...

    def clear(self) -> None: ...
