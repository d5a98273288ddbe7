"""The expert cache's rules, with no thread, lock, clock or tensor of their own: one definition that the live cache
and the replay both drive.

Scope: which (layer, expert) holds which slot and whether its copy has landed; pins (an access pins what it uses,
kept until the next access: the layer's copies must not evict what it computes with); victim choice, always through
the policy's `choose_victims`, among the landed and unpinned; what an access counts (DESIGN.md "Hits, late and
misses": hit = resident and landed, late = claimed by a copy still under way, miss = not claimed — loaded on demand
or, when the caller's `on_host` says so, computed from the host copy); prefetch admission (a key not claimed, and a
slot free or evictable); the prefetch accounting (prefetched, used, wasted) and bytes moved.

It does NOT copy, wait or time anything. Whoever moves the bytes implements `Loads` and calls `land`/`vacate` when a
claim's copy ends: cache.py (a loader thread, Landings and CUDA events, under its lock) or fmoe_bench/simcache.py (a
simulated link, one copy at a time, and a cost model's clock). Because both go through this table, the replay's
hit counts are the runtime's by construction (tests/test_replay_vs_runtime.py).

Threads: none. The live cache calls every method under its lock (cache.py, "Threads"); `Loads.wait_for_slot` is
where that caller may release its lock while it waits, so nothing else here may be assumed unchanged across it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from fmoe_local.policies.base import CandidateKeys, ExpertKey, Policy
from fmoe_local.stats import LayerCounters

OnHost = Callable[[list[int]], Sequence[bool]]  # an access's missing experts → computed on the host, each?


class Loads(Protocol):
    """What an access asks of whoever moves the bytes (cache.py: the loader thread; the replay: its simulated link)."""

    def pinned(self, s: int, key: ExpertKey, landed: bool) -> None:
        """The access pinned the claim in slot `s`: resident, or (`landed` False) late, a copy still under way."""
        ...

    def load(self, s: int, key: ExpertKey) -> None:
        """A miss claimed slot `s` (pinned): start its copy, which ends in `land(s)` or `vacate(s)`."""
        ...

    def wait_for_slot(self) -> None:
        """Every slot is pinned or still loading: return once that may have changed (a copy landed, pins dropped), or
        raise (a deadline, Stop, nothing left that could free one)."""
        ...


class SlotTable:
    """`capacity` slots (at most L·J) over an [L, J] model; slots are numbered 0..capacity−1. `slot_of`: every
    claimed key (landed or still being copied in) → its slot; `claimed` [L, J] the same keys as a mask (read it,
    never write it). Changed only through the methods below."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        capacity: int,
        policy: Policy,
        counters: LayerCounters,
        expert_bytes: int,
    ) -> None:
        self.total = num_layers * num_experts
        self.capacity = min(capacity, self.total)
        self.policy = policy
        self.counters = counters
        self.expert_bytes = expert_bytes
        self.current_layer = -1  # the layer of the last access (−1: a forward pass starts): victims are chosen for it
        self._experts = num_experts
        self._key: list[ExpertKey | None] = [None] * self.capacity
        self._pins = [0] * self.capacity
        self._landed = [False] * self.capacity
        self._by_prefetch = [False] * self.capacity  # loaded by a prefetch and not used yet
        self.slot_of: dict[ExpertKey, int] = {}
        self.claimed = np.zeros((num_layers, num_experts), bool)  # [L, J]
        # [L·J] landed and unpinned: the eviction candidates are one flatnonzero away, in (layer, expert) order. The
        # replay evicts about a million times per trace, so this is kept up to date rather than rebuilt.
        self._evictable = np.zeros(self.total, bool)
        self._candidate = [False] * self.capacity  # the same flag per slot, read without touching numpy
        self._num_evictable = 0
        self._num_landed = 0
        self._free = list(range(self.capacity - 1, -1, -1))
        self._held: list[int] = []  # slots of the last access, pinned until the next one
        self.complete = False  # every expert claimed and landed: final (nothing can miss, so nothing is evicted)

    # ---- reading -------------------------------------------------------------------------------------------------
    def key_of(self, s: int) -> ExpertKey | None:
        return self._key[s]

    def pins(self, s: int) -> int:
        return self._pins[s]

    def landed(self, s: int) -> bool:
        return self._landed[s]

    def has_free(self) -> bool:
        return bool(self._free)

    def resident(self) -> list[ExpertKey]:
        """The keys whose copy has landed, in slot order."""
        return [k for k, landed in zip(self._key, self._landed, strict=True) if k is not None and landed]

    def candidates(self) -> CandidateKeys:
        """Landed keys nobody has pinned, in ascending (layer, expert) order: what a claim may evict."""
        codes = np.flatnonzero(self._evictable)
        layers = codes // self._experts
        return CandidateKeys(layers, codes - layers * self._experts, in_order=True, codes=codes)

    # ---- an access (the forward pass) ----------------------------------------------------------------------------
    def access(self, layer: int, experts: Sequence[int], loads: Loads, on_host: OnHost | None = None) -> list[int]:
        """The forward pass computes `experts` of `layer` now: the previous access's pins are dropped, these experts
        are pinned and counted, missing ones claim slots (evicting through the policy) and `loads.load` starts their
        copies, except those `on_host(missing)` flags (one flag per missing expert, in access order): counted as
        misses computed on the host, slot −1, nothing claimed. The policy then sees every access (`record_access`,
        hit = claimed, late or not). Returns the slots, in `experts`' order; they stay pinned until the next access
        or `unhold`, once `release` hands them back."""
        if len(experts) > self.capacity:
            raise ValueError("An access got more experts than the cache has slots; compute in chunks.")
        self.unhold()
        self.current_layer = layer
        c = self.counters
        slots: list[int] = []
        hits: list[bool] = []
        # Pin every claimed expert of this access first, so that loading a missing one can never evict another expert
        # the same layer is about to use.
        for e in experts:
            key = (layer, e)
            s = self.slot_of.get(key)
            hits.append(s is not None)
            slots.append(-1 if s is None else s)
            if s is None:
                continue
            self._pin(s)
            if self._by_prefetch[s]:
                self._by_prefetch[s] = False
                c.prefetch_used += 1
            landed = self._landed[s]
            if landed:
                c.hits[key] += 1
            else:
                c.late[key] += 1  # neither a hit nor a miss
            loads.pinned(s, key, landed)
        missing = [e for e, hit in zip(experts, hits, strict=True) if not hit]
        if missing:
            host = {e for e, cpu in zip(missing, on_host(missing), strict=True) if cpu} if on_host else set()
            # Nothing changes the policy's mind between this access's claims (record_access comes after them): ask
            # for every victim they need at once — the Policy contract makes that the choice made one at a time.
            need = len(missing) - len(host) - len(self._free)
            victims = self._choose(need)[::-1] if need > 0 else []  # popped from the end: first victim first
            for i, e in enumerate(experts):
                if hits[i]:
                    continue
                key = (layer, e)
                if e in host:
                    c.misses[key] += 1
                    c.on_host[key] += 1
                    continue
                s = self._claim(key, victims, loads)
                self._pin(s)
                slots[i] = s
                c.misses[key] += 1
                loads.load(s, key)
        self.policy.record_access(layer, list(experts), hits)
        return slots

    def release(self, slots: Sequence[int]) -> None:
        """The access is done with `slots`: they stay pinned until the next access (or `unhold`)."""
        self._held.extend(slots)

    def unhold(self) -> None:
        """The previous access's slots are no longer in use (a new access, or a new forward pass)."""
        for s in self._held:
            self.unpin(s)
        self._held.clear()

    def unpin(self, s: int) -> None:
        self._pins[s] -= 1
        self._update(s)

    # ---- prefetches ----------------------------------------------------------------------------------------------
    def admit_prefetch(self, layer: int, expert: int) -> int | None:
        """Claim a slot for a prefetch of (layer, expert), evicting through the policy; None when it is claimed
        already or every slot is pinned or still loading (the prefetch is dropped, never waited for)."""
        key = (layer, expert)
        if key in self.slot_of or not (self._free or self._num_evictable):
            return None
        s = self._claim(key, [], None)
        self._by_prefetch[s] = True
        self.counters.prefetched[key] += 1
        return s

    def end_request(self) -> int:
        """Prefetched experts still unused when a request ends count as wasted (they stay resident); returns how
        many."""
        count = 0
        for s, unused in enumerate(self._by_prefetch):
            if unused:
                self._by_prefetch[s] = False
                count += 1
        self.counters.prefetch_wasted += count
        return count

    # ---- a copy ends ---------------------------------------------------------------------------------------------
    def land(self, s: int) -> None:
        """The copy into slot `s` (its current claim) is done: the expert is resident."""
        self._landed[s] = True
        self._num_landed += 1
        self.counters.bytes_moved += self.expert_bytes
        self._update(s)
        if self._num_landed == self.capacity == len(self.slot_of) == self.total:
            self.complete = True

    def vacate(self, s: int) -> None:
        """The copy into slot `s` will not land (a failed read, a load given up): the key is not resident and the
        slot is free again."""
        key = self._key[s]
        del self.slot_of[key]
        self.claimed[key] = False
        self._key[s], self._pins[s], self._by_prefetch[s] = None, 0, False
        self._free.append(s)

    # ---- internals -----------------------------------------------------------------------------------------------
    def _pin(self, s: int) -> None:
        self._pins[s] += 1
        self._update(s)

    def _update(self, s: int) -> None:
        """Keep slot `s`'s candidate flag equal to landed and unpinned."""
        now = self._landed[s] and self._pins[s] == 0
        if self._candidate[s] != now:
            key = self._key[s]
            self._candidate[s] = now
            self._evictable[key[0] * self._experts + key[1]] = now
            self._num_evictable += 1 if now else -1

    def _choose(self, count: int) -> list[ExpertKey]:
        if not self._num_evictable:
            return []
        return self.policy.choose_victims(self.candidates(), self.current_layer, min(count, self._num_evictable))

    def _claim(self, key: ExpertKey, victims: list[ExpertKey], loads: Loads | None) -> int:
        """A slot for `key`: a free one, else the next of `victims`, else one victim chosen now (waiting through
        `loads` while every slot is pinned or loading)."""
        if not self._free:
            if victims:
                victim = victims.pop()
            else:
                while not (self._free or self._num_evictable):
                    loads.wait_for_slot()
                victim = self._choose(1)[0] if not self._free else None
            if victim is not None:
                self._evict((int(victim[0]), int(victim[1])))
        s = self._free.pop()
        self._key[s], self._pins[s], self._by_prefetch[s], self._landed[s] = key, 0, False, False
        self.slot_of[key] = s
        self.claimed[key] = True
        return s

    def _evict(self, victim: ExpertKey) -> None:
        s = self.slot_of.pop(victim)
        self.claimed[victim] = False
        if self._by_prefetch[s]:
            self.counters.prefetch_wasted += 1
        self._evictable[victim[0] * self._experts + victim[1]] = False
        self._candidate[s] = False
        self._num_evictable -= 1
        self._num_landed -= 1
        self._key[s], self._landed[s], self._by_prefetch[s] = None, False, False
        self._free.append(s)
