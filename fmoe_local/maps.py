"""Expert maps and the map store the fMoE matcher searches.

Scope: `MapStore`: capacity with redundancy-based replacement (RDY), dedup, the two cosine searches and their
query caches, and successor links (map_links.py); records in expert_map.py, the probability arrays in
trajectory_index.py, embeddings and their sketch in semantic_index.py. It
does NOT decide what to prefetch (policies/fmoe.py), touch SQLite, or run a thread: it is safe to call from several.

Array legend: C capacity, n maps stored (slots 0..n-1, always contiguous), L MoE layers, J experts, h embed dim.

A full store replaces the most redundant map of its older half (`_most_redundant_old`), a measured departure
from the paper's rule over all maps: with that rule, a new topic's maps replaced each other while the old topic's
stayed (docs/bench.md, "Generalising"). Dedup rule: a new map whose
RDY against a stored map is ≥ `dedup_threshold` (0.999 by default) replaces that map, even in a store not full.
RDY mixes both cosines, so this fires only when both the routing (≥ ~0.999) and the prompt embedding (≥ ~0.99 at
d/L = 3/26) are near-identical — e.g. a repeated prompt, or a decode loop repeating one token.

Sketched semantic side (h > `sketch_dim`; what is exact: semantic_index.py): RDY is estimated from sketch cosines
(its trajectory part is always exact), made exact on the `sketch_candidates` highest estimates, and the replaced
slot is the argmax among those; the dedup threshold is compared with exact values only.

Slot −1 with score 0.0 is the answer of a search with nothing to match.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
from typing import TYPE_CHECKING

import numpy as np

from fmoe_local.config import RuntimeConfig
from fmoe_local.expert_map import ExpertMap, MapPersistence
from fmoe_local.map_links import SuccessorLinks
from fmoe_local.semantic_index import SemanticIndex
from fmoe_local.trajectory_index import BLOCK_ELEMS, TrajectoryIndex

if TYPE_CHECKING:  # policies/ imports this module (fmoe); a runtime import back would be circular
    from fmoe_local.policies.base import ModelShape

__all__ = ["ExpertMap", "MapPersistence", "MapStore"]  # the records are imported from here too

log = logging.getLogger(__name__)

_EPS = 1e-12


class MapStore:
    def __init__(
        self,
        shape: ModelShape,
        capacity: int,
        prefetch_distance: int,
        persistence: MapPersistence | None = None,
        dedup_threshold: float = 0.999,
        sketch_dim: int = RuntimeConfig.sketch_dim,
        sketch_candidates: int = RuntimeConfig.sketch_candidates,
    ) -> None:
        if capacity < 1:
            raise ValueError("The map store needs room for at least one expert map.")
        if prefetch_distance < 1:
            raise ValueError("Prefetch distance must be at least 1 layer.")
        self.shape = shape
        self.prefetch_distance = prefetch_distance
        self.dedup_threshold = dedup_threshold
        self._persistence = persistence
        self._links = SuccessorLinks(capacity)
        # Reentrant: reconfigure/load_from write slots through the same helpers add() uses.
        self._lock = threading.RLock()
        self._n = 0
        self._next_stamp = 0
        self._version = 0  # bumped on every write: invalidates the incremental trajectory cache
        self._traj_cache: tuple[np.ndarray, np.ndarray, int] | None = None  # (query prefix, dots, version)
        self._sem_cache: tuple[np.ndarray, np.ndarray, int] | None = None  # (query, cosines, version)
        self._traj = TrajectoryIndex(shape.num_layers, shape.num_experts, capacity)
        self._semantic = SemanticIndex(shape.embed_dim, capacity, sketch_dim, sketch_candidates, BLOCK_ELEMS)
        self._capacity = capacity
        self._request_ids = np.zeros(capacity, np.int64)
        self._stamps = np.zeros(capacity, np.int64)  # insertion order: which maps to keep when shrinking
        self._revisions = np.zeros(capacity, np.int64)  # the `_version` each slot was last written at

    @classmethod
    def for_config(
        cls, shape: ModelShape, config: RuntimeConfig, persistence: MapPersistence | None = None
    ) -> MapStore:
        """The store a runtime with these settings uses (capacity, d, semantic sketch)."""
        return cls(
            shape,
            config.store_capacity,
            config.prefetch_distance,
            persistence,
            sketch_dim=config.sketch_dim,
            sketch_candidates=config.sketch_candidates,
        )

    # --- sizes -----------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return self._n

    def _alloc(self, capacity: int) -> None:
        # Every array first, on copies of the indexes, then all are swapped in: a capacity too big for memory
        # (MemoryError) leaves the store as it was, not claiming slots its arrays lack.
        traj, semantic = copy.copy(self._traj), copy.copy(self._semantic)
        traj.alloc(capacity)
        semantic.alloc(capacity)
        ids, stamps, revisions = (np.zeros(capacity, np.int64) for _ in range(3))
        self._traj, self._semantic, self._request_ids, self._stamps = traj, semantic, ids, stamps
        self._revisions = revisions
        self._capacity = capacity

    # --- reading ---------------------------------------------------------------------------------------------
    def probs(self, slot: int) -> np.ndarray:
        """A copy of the stored map's [L, J] probabilities."""
        with self._lock:
            self._check_slot(slot)
            return self._traj.probs(slot)

    def get(self, slot: int) -> ExpertMap:
        with self._lock:
            self._check_slot(slot)
            return ExpertMap(self.probs(slot), self._semantic.get(slot), int(self._request_ids[slot]))

    def revision(self, slot: int) -> int:
        """A number that changes whenever `slot` is written (never repeated): a reader may keep what it derived from
        a slot's map for as long as its revision stays the same."""
        with self._lock:
            self._check_slot(slot)
            return int(self._revisions[slot])

    def chain(self, slot: int, length: int) -> list[tuple[int, int]]:
        """(slot, revision) of `slot` and the maps linked after it (its successor, that one's successor, ...), at most
        `length` in all: the walk `successor` makes one step at a time, under one lock. Empty for a slot not stored
        (as `successor` answers −1 for one)."""
        with self._lock:
            out: list[tuple[int, int]] = []
            while len(out) < length and 0 <= slot < self._n:
                out.append((slot, int(self._revisions[slot])))
                slot = self._links.get(slot, self._n)
            return out

    def successor(self, slot: int) -> int:
        """The slot of the map stored right after `slot` in its request (a prediction of what follows), or −1."""
        with self._lock:
            return self._links.get(slot, self._n)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self._n:
            raise IndexError(f"Map slot {slot} is empty; the store holds {self._n} maps.")

    def match_semantic(self, semantic: np.ndarray | None) -> tuple[int, float]:
        """Best stored map by cosine of semantic embeddings; maps stored without one never match.

        The score is the exact cosine; with a sketch the slot is the exact best when it is among the sketch's
        candidates (module docstring).
        """
        if semantic is None or self.shape.embed_dim == 0:
            return -1, 0.0
        q = self._as_semantic(semantic)
        qn = float(np.linalg.norm(q))
        with self._lock:
            n = self._n
            if n == 0 or qn == 0.0 or not self._semantic.has(n).any():
                return -1, 0.0
            best, score, cos = self._semantic.search(q, n)
            self._sem_cache = (q.copy(), cos, self._version)
            return best, score

    def match_trajectory(self, partial: np.ndarray) -> tuple[int, float]:
        """Best stored map by cosine of the concatenated first l layers ([l, J] given) with the same slice.

        Incremental: when `partial` extends the previous query (the matcher's usual pattern within one
        iteration) and no map was written since, only the new layers are multiplied.
        """
        q = np.asarray(partial, np.float32)
        L, J = self.shape.num_layers, self.shape.num_experts
        if q.ndim != 2 or q.shape[1] != J or not 1 <= q.shape[0] <= L:
            raise ValueError(f"A trajectory is [l, {J}] with 1 ≤ l ≤ {L}; got {q.shape}.")
        depth = q.shape[0]
        with self._lock:
            n = self._n
            if n == 0:
                return -1, 0.0
            start, dots = 0, None
            cache = self._traj_cache
            if cache is not None and cache[2] == self._version:
                prev, prev_dots = cache[0], cache[1]
                if prev.shape[0] <= depth and (prev == q[: prev.shape[0]]).all():
                    start, dots = prev.shape[0], prev_dots
            if dots is None:
                dots = np.zeros(n, np.float32)
            for i in range(start, depth):
                dots = dots + self._traj.layer_dots(i, q[i], n)  # a new array: the cached one stays as it was
            self._traj_cache = (q.copy(), dots, self._version)
            qn = math.sqrt(np.square(q, dtype=np.float64).sum())
            if qn == 0.0:
                return 0, 0.0
            scores = dots * self._traj.inv_norms(depth, n)  # cosine × ‖q‖: the same argmax
            best = int(scores.argmax())
            return best, float(scores[best]) / qn

    # --- writing ---------------------------------------------------------------------------------------------
    def add(self, expert_map: ExpertMap, after: int = -1) -> int:
        """Store a map; returns its slot (a new one, or the replaced most-redundant/near-identical one). `after`: the
        slot of the map stored before this one in its request, which is then linked to this one."""
        probs, sem = self._validate(expert_map)
        with self._lock:
            slot = self._choose_slot(probs, sem)
            if slot == self._n:
                self._n += 1
            self._write(slot, probs, sem, expert_map.request_id)
            if self._persistence is not None:
                self._persistence.put(slot, ExpertMap(probs, sem, expert_map.request_id))
            if self._links.record(after, slot, self._n) and self._persistence is not None:
                self._persistence.put_link(after, slot)
            return slot

    def redundancy(self, probs: np.ndarray, semantic: np.ndarray | None) -> np.ndarray:
        """[n] RDY of a candidate map against every stored map: d/L·score_sem + (L−d)/L·score_traj.

        Where either side lacks a semantic embedding, score_traj stands in for score_sem. With a sketch, score_sem
        is the sketch estimate except on the `sketch_candidates` highest RDYs, which are exact.
        """
        return self._redundancy(probs, semantic)[0]

    def most_redundant(self, probs: np.ndarray, semantic: np.ndarray | None) -> tuple[int, float]:
        """(slot, exact RDY) of the stored map most like a new one (what dedup replaces); (−1, 0.0) on an empty store.
        With a sketch it is the exact argmax whenever that map is among the candidates (module docstring)."""
        with self._lock:
            if self._n == 0:
                return -1, 0.0
            rdy, cand = self._redundancy(probs, semantic)
            if cand is None:
                best = int(np.argmax(rdy))
            else:
                best = int(cand[np.argmax(rdy[cand])])
            return best, float(rdy[best])

    def _redundancy(self, probs: np.ndarray, semantic: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """(RDY [n], the slots where it is exact, or None when it is exact everywhere)."""
        L = self.shape.num_layers
        q = np.asarray(probs, np.float32)
        with self._lock:
            n = self._n
            # The iteration's own searches usually computed these dots already: its last trajectory match (all L
            # layers of this very map) and its semantic match (the same embedding), with no write since.
            dots = self._cached_dots(self._traj_cache, q)
            if dots is None:
                dots = np.zeros(n, np.float32)
                for i in range(L):
                    dots += self._traj.layer_dots(i, q[i], n)
            qn = float(np.sqrt(np.square(q, dtype=np.float64).sum()))
            s_traj = dots * self._traj.inv_norms(L, n) / max(qn, _EPS)
            s_sem, qs = s_traj, None
            if semantic is not None and self.shape.embed_dim > 0:
                qs = self._as_semantic(semantic)
                if float(np.linalg.norm(qs)) > 0:
                    cos = self._cached_dots(self._sem_cache, qs)  # the pass's semantic search, if it was this one
                    if cos is None:
                        cos = self._semantic.cosines(qs, n)
                    s_sem = np.where(self._semantic.has(n), cos, s_traj)
                else:
                    qs = None
            w = min(self.prefetch_distance, L) / L
            rdy = w * s_sem + (1.0 - w) * s_traj
            if qs is None or not self._semantic.sketched:
                return rdy, None
            cand = self._semantic.shortlist(rdy)  # [m]: estimated RDY → exact RDY on these
            exact = np.where(self._semantic.has(n)[cand], self._semantic.exact(qs, cand), s_traj[cand])
            rdy[cand] = w * exact + (1.0 - w) * s_traj[cand]
            return rdy, cand

    def _cached_dots(self, cache: tuple[np.ndarray, np.ndarray, int] | None, q: np.ndarray) -> np.ndarray | None:
        if cache is None or cache[2] != self._version or cache[0].shape != q.shape or cache[1].size != self._n:
            return None
        return cache[1] if np.array_equal(cache[0], q) else None

    def _choose_slot(self, probs: np.ndarray, sem: np.ndarray | None) -> int:
        if self._n == 0:
            return 0
        rdy, cand = self._redundancy(probs, sem)  # once: dedup and a full store's choice both read it
        near = np.arange(self._n) if cand is None else cand
        best = int(near[np.argmax(rdy[near])])  # = most_redundant's slot
        if rdy[best] >= self.dedup_threshold:
            return best
        if self._n < self._capacity:
            return self._n
        return self._most_redundant_old(rdy, cand)

    def _most_redundant_old(self, rdy: np.ndarray, cand: np.ndarray | None) -> int:
        """A full store's victim: the most redundant map of the older half (by insertion), not of all (the paper's):
        there a new topic's maps replaced each other while the old topic's stayed, and after 4000 maps of one shared
        trace fmoe fell 7 points below an empty store on the other (docs/bench.md, "Generalising")."""
        stamps, k = self._stamps[: self._n], max(1, self._n // 2)
        old = stamps <= np.partition(stamps, k - 1)[k - 1]  # [n] the k oldest (stamps are distinct); C = 1: the map
        pool = np.flatnonzero(old)
        if cand is not None and old[cand].any():  # RDY is exact there (module docstring)
            pool = cand[old[cand]]
        return int(pool[np.argmax(rdy[pool])])

    def _write(self, slot: int, probs: np.ndarray, sem: np.ndarray | None, request_id: int) -> None:
        self._traj.write(slot, probs)
        self._semantic.write(slot, sem)
        self._request_ids[slot] = request_id
        self._stamps[slot] = self._next_stamp
        self._next_stamp += 1
        self._version += 1
        self._revisions[slot] = self._version

    def _validate(self, expert_map: ExpertMap) -> tuple[np.ndarray, np.ndarray | None]:
        L, J = self.shape.num_layers, self.shape.num_experts
        probs = np.asarray(expert_map.probs, np.float32)
        if probs.shape != (L, J):
            raise ValueError(f"An expert map for this model is [{L}, {J}]; got {probs.shape}.")
        sem = None
        if expert_map.semantic is not None and self.shape.embed_dim > 0:
            sem = self._as_semantic(expert_map.semantic)
        return probs, sem

    def _as_semantic(self, semantic: np.ndarray) -> np.ndarray:
        s = np.asarray(semantic, np.float32).reshape(-1)
        if s.shape[0] != self.shape.embed_dim:
            raise ValueError(
                f"A semantic embedding for this model has {self.shape.embed_dim} values; got {s.shape[0]}."
            )
        return s

    # --- lifecycle -------------------------------------------------------------------------------------------
    def clear(self) -> None:
        with self._lock:
            self._n = 0
            self._links.clear()
            self._version += 1
            self._traj_cache = None
            if self._persistence is not None:
                self._persistence.clear()

    def reconfigure(self, capacity: int | None = None, prefetch_distance: int | None = None) -> None:
        """Change C and/or d at runtime. Shrinking below len() keeps the newest maps (renumbered with their links,
        rewritten)."""
        with self._lock:
            if prefetch_distance is not None:
                if prefetch_distance < 1:
                    raise ValueError("Prefetch distance must be at least 1 layer.")
                self.prefetch_distance = prefetch_distance
            if capacity is None or capacity == self._capacity:
                return
            if capacity < 1:
                raise ValueError("The map store needs room for at least one expert map.")
            old = [self.get(s) for s in range(self._n)]
            old_stamps, links, keep = self._stamps[: self._n].copy(), self._links.targets(self._n), np.arange(self._n)
            renumbered = len(old) > capacity
            if renumbered:
                keep = np.sort(np.argsort(-old_stamps, kind="stable")[:capacity])  # newest, in slot order
                old, old_stamps = [old[i] for i in keep], old_stamps[keep]
            new_links = copy.copy(self._links)
            new_links.reset(capacity, keep, links[keep])  # allocated before anything changes, as in _alloc
            self._alloc(capacity)
            self._links, self._n = new_links, 0
            for m in old:
                self._write(self._n, *self._validate(m), m.request_id)
                self._n += 1
            self._stamps[: self._n] = old_stamps  # keep the true age order, not the rewrite order
            self._semantic.flush()  # the sketch of every map in one batch, not at the next search
            self._traj_cache = None
            if renumbered:
                self._rewrite_persistence()

    def load_from(self, persistence: MapPersistence | None = None) -> int:
        """Fill the store from persistence (and keep using it). Returns the number of maps loaded.

        Maps of another shape are skipped, links to maps not kept dropped; if slots on disk are not exactly 0..k-1
        (or exceed the capacity), maps and links are renumbered and the disk copy rewritten: slots stay the identity.
        """
        with self._lock:
            if persistence is not None:
                self._persistence = persistence
            if self._persistence is None:
                return 0
            entries: dict[int, tuple[ExpertMap, int]] = {}
            skipped = 0
            for slot, m, *link in self._persistence.load():
                try:
                    self._validate(m)
                except ValueError:
                    skipped += 1
                    continue
                entries[int(slot)] = m, int(link[0]) if link else -1
            if skipped:
                log.warning("Skipped %d stored expert maps of another model shape.", skipped)
            slots = sorted(entries)[: self._capacity]
            self._n = 0
            for s in slots:
                m = entries[s][0]
                self._write(self._n, *self._validate(m), m.request_id)
                self._n += 1
            dangling = self._links.reset(self._capacity, np.array(slots), [entries[s][1] for s in slots])
            self._semantic.flush()  # the sketch of every map in one batch, not at the next search
            self._traj_cache = None
            if skipped or dangling or slots != list(range(len(slots))) or len(entries) > len(slots):
                self._rewrite_persistence()
            return self._n

    def _rewrite_persistence(self) -> None:
        if self._persistence is None:
            return
        links = self._links.targets(self._n)
        self._persistence.replace_all([(s, self.get(s), int(links[s])) for s in range(self._n)])
