"""The expert cache's slot table: which (layer, expert) sits in which slot, which slots are free, which can be evicted.

Scope: the residency bookkeeping of ExpertCache (cache.py) — one `Slot` record per slot (its expert, its pins, the
Landing of its current claim, whether a prefetch loaded it and it is unused yet, its CUDA events), the key → slot
map, the free list, and the moves between them: occupy a slot with a new claim, evict a key, vacate a claim whose
load will not land. It does NOT wait, count hits or misses, choose victims (the policy does, through the cache) or
copy anything (copier.py).

No lock and no thread of its own: the cache calls it only under its lock (cache.py, "Threads").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from fmoe_local.copier import Landing
from fmoe_local.policies.base import ExpertKey


@dataclass
class Slot:
    key: ExpertKey | None = None
    pins: int = 0
    ready: Landing = field(default_factory=Landing)  # this claim's load; a new one per claim
    by_prefetch: bool = False  # loaded by the prefetcher and not used yet
    copy_event: object | None = None  # CUDA: the copy's completion on the copy stream
    last_use: object | None = None  # CUDA: compute stream event after the last kernel reading this slot


class SlotTable:
    """`capacity` slots, indexed by slot number (`table[s]`); `slot_of`: every claimed key (resident or still being
    copied in) → its slot. Changed only through the methods below."""

    def __init__(self, capacity: int) -> None:
        self._slots = [Slot() for _ in range(capacity)]
        self.slot_of: dict[ExpertKey, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def __getitem__(self, s: int) -> Slot:
        return self._slots[s]

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots)

    def has_free(self) -> bool:
        return bool(self._free)

    def take_free(self) -> int | None:
        """A slot nobody has claimed, or None when every slot is."""
        return self._free.pop() if self._free else None

    def resident(self) -> list[ExpertKey]:
        """The keys whose load has landed."""
        return [s.key for s in self._slots if s.key is not None and s.ready.is_set()]

    def evictable(self) -> list[ExpertKey]:
        """Resident keys nobody has pinned: what a claim may evict."""
        return [s.key for s in self._slots if s.key is not None and s.pins == 0 and s.ready.is_set()]

    def evict(self, key: ExpertKey) -> int:
        """Forget `key`; returns its slot, for the caller to `occupy` at once (its record is left as it was)."""
        return self.slot_of.pop(key)

    def occupy(self, s: int, key: ExpertKey) -> None:
        """Slot `s` now holds a new claim of `key`: unpinned, with a fresh Landing for its load."""
        slot = self._slots[s]
        slot.key, slot.pins, slot.by_prefetch = key, 0, False
        slot.ready = Landing()
        self.slot_of[key] = s

    def vacate(self, s: int, key: ExpertKey, landing: Landing) -> None:
        """A load that will not land: if slot `s` still holds that claim (`landing`), it is free again."""
        slot = self._slots[s]
        if slot.ready is landing:
            del self.slot_of[key]
            slot.key, slot.pins, slot.by_prefetch = None, 0, False
            slot.ready = Landing()
            self._free.append(s)

    def all_loaded(self, total: int) -> bool:
        """`total` keys claimed (every expert of the model) and every slot's load landed."""
        return len(self.slot_of) == total and all(x.ready.is_set() for x in self._slots)

    def forget_prefetches(self) -> int:
        """Clear every slot's unused-prefetch flag; returns how many were set."""
        count = 0
        for slot in self._slots:
            if slot.by_prefetch:
                slot.by_prefetch = False
                count += 1
        return count
