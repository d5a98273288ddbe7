"""fmoe: the fMoE policy — prefetch from the most similar past expert map, evict the latest predicted next use.

Scope: the paper's rules (DESIGN.md) over the Policy interface: semantic search at the start of an iteration,
trajectory search after each observed layer, δ-sized prefetch sets, the prefetch priority, eviction by
predicted next use, and feeding finished maps to the MapStore. It does NOT search arrays itself (maps.py), copy weights
(prefetcher.py) or own the cache.

Layer indices (0-based here, 1-based in the paper). The paper predicts layers 1..d from the semantic match and,
"at layer l", layer l+d from the trajectory 1..l−1. Here:
- begin_iteration (nothing observed yet, "l_now = −1") predicts layers 0..d−1 from the semantic match (or, after
  the request's first iteration, from a successor link: below);
- observe_layer(l) (the router of layer l has run, so the trajectory is 0..l) predicts layer l+d.
Every layer ≥ d is thus predicted exactly d layers before it runs, with no gap at the switch; compared to the
paper the trajectory also includes the current layer's gate, which our router hook already has at that point.
Prefetch priority p/(l − l_now) therefore divides by l+1 (semantic) or d (trajectory), never by 0.

Predicted distributions are normalised to sum 1 before δ is applied, so δ means a share of the predicted mass
whether a map holds full softmaxes or only top-k entries (recordings from other tools).

Eviction: evict the expert whose predicted next use is farthest away (Belady's rule on a prediction; it beat the
paper's 1/(p·freq) with mis-prefetched first, docs/bench.md "Tuning", session 3). Time is counted in layer steps:
a layer still to run this iteration runs again in l − l_now steps, one that ran in L − (l_now − l), then every L
steps. Per (layer, expert) the next use is predicted at:
- the layer's next run, if the expert is in the top-K of p_{l}, the newest estimate for that run: for layers this
  iteration has not run yet, the latest trajectory match's row (every remaining layer, not only l+d: a map matched
  on layers 0..l predicts layer l+5 about as well as l+1), or the semantic / fallback prediction before the first
  match, a uniform 1/J (every expert predicted) before anything was seen; for layers already run, which the NEXT
  iteration runs next, the current best match's successor (the map stored right after it in its own request, see
  "Successor links"), without one the observed distribution (decode steps partly repeat);
- else the first later run whose map along the successor chain (the match's successor, that map's successor, …,
  up to `chain_horizon(J, K)` runs in all, successor_chain.py) has the expert in its top-K: a past request that
  routed like this one goes on routing like the next iterations of this one;
- else, past the runs the chain covers, after the expected wait 1/rate runs, rate = (freq + 1) / (runs + 2) the
  layer's use rate of the expert (freq: its accesses since the policy was built, every request; runs: forward
  passes that ran the layer).
Only the top-K of a predicted row counts (an expert is in it or not): whether a map holds full softmaxes or
top-k entries only, that is the map's prediction of which experts run. The paper's (ExpertFlow's) mis-prefetched-
first rule (experts prefetched for a layer that ran without using them go first) is dropped: with next-use times
their chance of use is already in the key. Those choices were measured (docs/bench.md, session 3), the horizon's
dependence on J/K in session 9.

Successor links: when the policy stores a map it names the slot of the request's previous map, and the store links
that one to the new one (MapStore.successor; kept, renumbered and saved with the maps, rules in map_links.py, so the
user's history keeps its links across restarts). The successor of the map most similar to the current iteration is
a prediction of the next iteration.
It sets the eviction p of layers already run, its own successors the later runs (above), and, at the start of an
iteration, predicts layers 0..d−1 from the successor of the previous iteration's final (all-layer) match, with
δ = 1 − that match's score. The semantic match is used for a request's first iteration, or when the match has no
successor.

Prefetch priority: the target layer first, then p / (l − l_now). Copies leave one at a time at the link's rate;
when the queue backs up, a copy for a layer that runs sooner than one copy time is late anyway, while the farthest
target (l_now + d, just planned) can still land in time; when the link keeps up the order changes little. Within
a layer the paper's p / (l − l_now) orders the copies.

Match confidence sets the mix (blend.py): every row a map predicts (prefetch and eviction alike) is blended with
the layer's last observed routing, at the weight whose top-K has held the most used experts so far (w = 1, the map
alone, until recency has done better: early in a new user's first request, on the shared traces).

Empty store, or no semantic embedding: predict a layer from its last observed distribution (the previous
iteration's routing, which decode steps largely repeat) with δ = 0, i.e. its top-K; before anything was observed,
predict nothing and let misses load on demand.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from fmoe_local.config import RuntimeConfig
from fmoe_local.maps import ExpertMap, MapStore
from fmoe_local.policies._common import flat_codes, lowest, normalised, predicted_use, prefetch_set, split_keys
from fmoe_local.policies.base import ExpertKey, ModelShape, Policy, Prefetch, PrefetchBatch
from fmoe_local.policies.blend import MixChoice, blend
from fmoe_local.policies.successor_chain import chain_horizon, runs_until_predicted


class FMoEPolicy(Policy):
    name = "fmoe"
    needs_lookahead = False

    def __init__(
        self, shape: ModelShape, config: RuntimeConfig | None = None, map_store: MapStore | None = None
    ) -> None:
        config = config or RuntimeConfig()
        self.shape = shape
        self._horizon = chain_horizon(shape.num_experts, shape.top_k)
        self.prefetch_distance = config.prefetch_distance
        if map_store is None:
            map_store = MapStore.for_config(shape, config)
        elif map_store.prefetch_distance != config.prefetch_distance:
            map_store.reconfigure(prefetch_distance=config.prefetch_distance)
        self.store = map_store
        self._store_capacity = map_store.capacity  # a resize may renumber slots (reconfigure)
        L, J = shape.num_layers, shape.num_experts
        # Held only for O(L·J) bookkeeping: record_access/choose_victims (forward or prefetcher thread, under the cache's
        # lock) never wait on a search.
        self._lock = threading.Lock()
        self._p_est = np.full((L, J), 1.0 / J, np.float32)  # [L, J] newest p per layer (eviction)
        self._last_seen = np.zeros((L, J), np.float32)  # [L, J] last observed distribution per layer (fallback)
        self._has_seen = np.zeros(L, bool)
        self._freq = np.zeros((L, J), np.float32)  # [L, J] accesses since the policy was built
        self._runs = np.zeros(L, np.float32)  # [L] forward passes that ran each layer (freq / runs = use rate)
        self._last_access = -1  # the layer of the latest record_access (forward thread only)
        # [2, L, J] eviction key = predicted time of next use in layer steps, up to a shift common to all
        # candidates; [0] for a layer still to run this iteration, [1] for one that ran. Kept up to date row by
        # row as p, freq and the chain change: an eviction reads it instead of recomputing hundreds of candidates.
        self._evict = np.empty((2, L, J), np.float64)
        # [2, L, 1] the key of a use at the next run: layer l still to run is next run l steps from layer 0,
        # one that ran L + l steps (the shift common to every candidate, current_layer, is left out).
        self._offset = (np.arange(2)[:, None, None] * L + np.arange(L)[None, :, None]).astype(np.float64)
        self._p_use = np.zeros((L, J), bool)  # [L, J] p_est's top-K: predicted to be used at the next run
        self._stale = np.ones(L, bool)  # [L] layers whose eviction keys need recomputing
        self._p_stale = np.ones(L, bool)  # [L] layers whose p_use needs recomputing
        # A chain is rebuilt whenever the match changes, mostly from the same few dozen maps and chains: kept per
        # slot (probs and top-K, while the slot's revision stays; read and written by `_follow` and `_successor`
        # only, on the matcher's thread) and per chain (its eviction keys; under self._lock), a few of each.
        self._slot_maps: OrderedDict[int, tuple[int, np.ndarray, np.ndarray]] = OrderedDict()
        self._chain_keys: OrderedDict[tuple, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._chain_key: tuple | None = None  # ((slot, revision), ...) of the chain eviction reads now
        # Which match and mix the eviction p of the layers still to run came from (`_estimate_next_use`): bumped
        # whenever the chain's head changes or p_est is written from anything else.
        self._head_epoch = 0
        self._estimated: tuple[int, float, int] | None = None  # (head epoch, weight, layer) of the latest estimate
        self._estimate = np.zeros((L, J), np.float32)  # [L, J] that estimate's rows, normalised (p_est before others)
        self._estimate_ok = np.zeros(L, bool)  # [L] rows the estimate had mass for
        self._reset_chain()
        # Match confidence sets the mix (blend.py): every row a map predicts is blended with the layer's last routing
        # at the weight that has predicted best so far; the map's row per layer is kept until the layer runs, to
        # score the candidates against what it used.
        self._mix = MixChoice(shape.top_k)
        self._map_row = np.zeros((L, J), np.float32)  # [L, J] the map's latest prediction of each layer's next run
        self._map_has = np.zeros(L, bool)
        self._request_id = 0
        self._prev_slot = -1  # where this request's previous iteration was stored (−1: none, or it stopped)
        self._final: tuple[int, float] = (-1, 0.0)  # the previous iteration's all-layer match (slot, score)
        self._reset_iteration(None)

    # --- runtime settings ------------------------------------------------------------------------------------
    def reconfigure(self, prefetch_distance: int | None = None, store_capacity: int | None = None) -> bool:
        if prefetch_distance is not None and prefetch_distance < 1:
            raise ValueError("Prefetch distance must be at least 1 layer.")
        self.store.reconfigure(capacity=store_capacity, prefetch_distance=prefetch_distance)
        if prefetch_distance is not None:
            self.prefetch_distance = prefetch_distance
        # A resize (here, or by the engine before this call) may renumber slots: the ones held here are void (the
        # store renumbers its links itself).
        if self._store_capacity != self.store.capacity:
            self._store_capacity = self.store.capacity
            with self._lock:
                self._prev_slot, self._final = -1, (-1, 0.0)
                self._reset_chain()
        return True

    # --- request / iteration lifecycle -----------------------------------------------------------------------
    def begin_request(self, request_id: int) -> None:
        with self._lock:
            self._request_id = request_id
            self._prev_slot, self._final = -1, (-1, 0.0)
            self._reset_iteration(None)
            self._reset_chain()

    def _reset_iteration(self, semantic: np.ndarray | None) -> None:
        L, J = self.shape.num_layers, self.shape.num_experts
        self._live = np.zeros((L, J), np.float32)  # [L, J] this iteration's observed trajectory
        self._observed = np.zeros(L, bool)
        self._semantic = semantic

    def begin_iteration(self, semantic: np.ndarray | None) -> Sequence[Prefetch]:
        sem = None if semantic is None else np.asarray(semantic, np.float32).reshape(-1).copy()
        with self._lock:
            self._reset_iteration(sem)
            final, self._final = self._final, (-1, 0.0)
            # The chain's successor is this iteration's map now; read it again at the first match (a link may have
            # been added, a slot rewritten).
            self._set_chain(self._chain[1:], self._chain_key[1:])
            self._new_head(None)
        first = min(self.prefetch_distance, self.shape.num_layers)
        successor = self._successor(final[0])
        if successor is not None:  # the previous iteration's routing says more than the semantic match here
            slot, score, predicted = final[0], final[1], successor
        else:
            slot, score = self.store.match_semantic(sem) if sem is not None else (-1, 0.0)
            predicted = self.store.probs(slot) if slot >= 0 else None
        out: list[Prefetch] = []
        if predicted is not None:
            with self._lock:
                rows = self._mixed(0, predicted[:first])
            for layer in range(first):
                out += self._plan(layer, rows[layer], _delta(score), l_now=-1)
        else:
            for layer in range(first):
                out += self._fallback(layer, l_now=-1)
        return out

    def observe_layer(self, layer: int, probs: np.ndarray, lookahead: np.ndarray | None = None) -> Sequence[Prefetch]:
        p = np.asarray(probs, np.float32).reshape(-1)
        with self._lock:
            if self._map_has[layer] and self._has_seen[layer]:
                self._mix.score(self._map_row[layer], self._last_seen[layer], predicted_use(p, self.shape.top_k))
            self._map_has[layer] = False
            self._live[layer] = p
            self._observed[layer] = True
            observed = normalised(p)
            if observed is not None:
                self._set_p(layer, observed)
            self._last_seen[layer] = p
            self._has_seen[layer] = True
            trajectory = self._live[: layer + 1].copy()  # [l+1, J]
        L, target = self.shape.num_layers, layer + self.prefetch_distance
        slot, score = self.store.match_trajectory(trajectory)  # also past the last target: eviction uses it
        if slot < 0:
            return self._fallback(target, l_now=layer) if target < L else []
        matched, successor = self._follow(slot)
        self._estimate_next_use(layer, matched, successor)
        if layer == L - 1:
            with self._lock:
                self._final = (slot, score)
        if target >= L:
            return []
        with self._lock:
            # The target's row was just estimated, from the same match and mix, for eviction (p_est holds it already).
            p = self._estimate[target].copy() if self._estimate_ok[target] else None
        return self._plan_normalised(target, p, _delta(score), l_now=layer) if p is not None else []

    def end_iteration(self) -> None:
        with self._lock:
            complete = bool(self._observed.all())
            expert_map = ExpertMap(self._live.copy(), self._semantic, self._request_id) if complete else None
            prev = self._prev_slot
        if expert_map is None:  # a stopped iteration has no full map: nothing to learn from, no link to make
            with self._lock:
                self._prev_slot, self._final = -1, (-1, 0.0)
            return
        slot = self.store.add(expert_map, after=prev)
        with self._lock:
            self._prev_slot = slot

    def end_request(self) -> None:
        with self._lock:
            self._reset_iteration(None)

    def observe_iteration(self, probs: np.ndarray, semantic: np.ndarray | None) -> None:
        """A whole forward pass to learn from with nothing to predict (a complete cache, or a replay's warm-up):
        what begin_iteration + observe_layer for every layer + end_iteration leave behind, without the searches
        (so no all-layer match is remembered for the next iteration's successor prediction)."""
        p = np.asarray(probs, np.float32)
        sem = None if semantic is None else np.asarray(semantic, np.float32).reshape(-1).copy()
        with self._lock:
            self._reset_iteration(sem)
            self._live[:] = p
            self._observed[:] = True
            self._set_estimates(0, p)
            self._last_seen[:] = p
            self._has_seen[:] = True
            self._final = (-1, 0.0)
            self._reset_chain()
        self.end_iteration()

    # --- prediction ------------------------------------------------------------------------------------------
    def _successor(self, slot: int) -> np.ndarray | None:
        """[L, J] the map stored after `slot` in its request, if a link is known (a prediction of what follows);
        read-only (kept per slot: it was in the chain of the match at `slot`)."""
        after = self.store.chain(slot, 2)[1:]
        return self._slot_map(*after[0])[0] if after else None

    def _follow(self, slot: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The match's map and its successor; also makes the chain from `slot` the one eviction looks ahead with.
        The arrays returned are read-only (kept per slot)."""
        if self._chain_head is not None and self._chain_head[0] == slot:  # unchanged since the last layer
            return self._chain_head[1], self._chain_head[2]
        key = tuple(self.store.chain(slot, self._horizon + 1))  # (slot, revision): the match, its successor, ...
        maps = [self._slot_map(s, revision) for s, revision in key]  # (probs [L, J], top-K [L, J] bool) each
        successor = maps[1][0] if len(maps) > 1 else None
        with self._lock:
            self._set_chain([use for _, use in maps], key)
            self._new_head((slot, maps[0][0], successor))
        return maps[0][0], successor

    def _slot_map(self, slot: int, revision: int) -> tuple[np.ndarray, np.ndarray]:
        """(probs [L, J], top-K [L, J] bool) of a stored map, read again only when the slot was rewritten."""
        kept = self._slot_maps.get(slot)
        if kept is not None and kept[0] == revision:
            self._slot_maps.move_to_end(slot)
            return kept[1], kept[2]
        probs = self.store.probs(slot)
        use = predicted_use(probs, self.shape.top_k)
        probs.flags.writeable = use.flags.writeable = False
        self._slot_maps[slot] = (revision, probs, use)
        if len(self._slot_maps) > 4 * (self._horizon + 1):  # a few chains' worth
            self._slot_maps.popitem(last=False)
        return probs, use

    def _new_head(self, head: tuple[int, np.ndarray, np.ndarray | None] | None) -> None:  # under self._lock
        self._chain_head = head
        self._head_epoch += 1

    def _reset_chain(self) -> None:  # under self._lock (or before the policy is shared)
        self._new_head(None)
        self._set_chain([], ())

    def _set_chain(self, chain: Sequence[np.ndarray], key: tuple) -> None:  # under self._lock
        """chain: m [L, J] bool, predicted use in the current iteration's map (row 0) and the m − 1 after it; key:
        their (slot, revision) pairs.

        Kept per case (still to run, ran; successor_chain.py): the key of an expert that p_est does not predict, as
        `_base` (the first later run the chain predicts, else the runs it covers) plus `_past` (1 where the chain
        predicts none, to be scaled by the expected wait at the use rate).
        """
        chain, key = chain[: self._horizon + 1], key[: self._horizon + 1]
        self._chain = chain
        if key == self._chain_key:
            return
        self._chain_key = key
        kept = self._chain_keys.get(key)
        if kept is None:
            L, J = self.shape.num_layers, self.shape.num_experts
            stacked = np.stack(chain) if len(chain) else np.zeros((0, L, J), bool)
            runs, past = runs_until_predicted(stacked, self._horizon)
            kept = self._chain_keys[key] = (self._offset + L * runs, past)
            if len(self._chain_keys) > 16:
                self._chain_keys.popitem(last=False)
        else:
            self._chain_keys.move_to_end(key)
        self._base, self._past = kept
        self._refresh_evict(slice(None), p_changed=False)

    def _estimate_next_use(self, layer: int, matched: np.ndarray, successor: np.ndarray | None) -> None:
        """Eviction p after `layer` ran: the match for layers still to run, its successor for those that ran."""
        first = 0 if successor is not None else layer + 1  # without a successor, run layers keep the observed p
        with self._lock:
            weight = self._mix.weight
            if self._estimated == (self._head_epoch, weight, layer - 1):
                # The same match and mix as one layer ago: only this layer's row moved (to the successor, blended with
                # the routing just observed); without a successor, none did.
                if successor is not None:
                    self._set_estimate(layer, self._mixed(layer, successor[layer : layer + 1])[0])
            else:
                rows = matched[first:].copy()  # [L − first, J]
                if successor is not None:
                    rows[: layer + 1] = successor[: layer + 1]
                self._set_estimates(first, self._mixed(first, rows))
            self._estimated = (self._head_epoch, weight, layer)

    def _mixed(self, first: int, rows: np.ndarray) -> np.ndarray:  # under self._lock
        """A map's prediction rows for layers first.. blended with those layers' last routing (blend.py), and kept
        as the map's prediction to score the mix with when each layer runs."""
        layers = slice(first, first + rows.shape[0])
        self._map_row[layers] = rows
        self._map_has[layers] = True
        weight = self._mix.weight
        if weight >= 1.0:  # the map has predicted best so far (always, after a new user's first requests)
            return rows
        prior = np.where(self._has_seen[layers, None], self._last_seen[layers], 0.0)
        return blend(rows, prior, weight)

    def _set_estimates(self, first: int, rows: np.ndarray) -> None:  # under self._lock
        """p_est of layers first.. = these rows normalised to sum 1; a row with no mass (a layer the map never
        reached) keeps the previous estimate."""
        sums = rows.sum(1)
        known = sums > 0
        self._estimate_ok[first : first + known.size] = known
        layers = first + known.nonzero()[0]
        rows = rows[known] / sums[known, None]
        self._estimate[layers] = rows
        # Within an iteration the match is mostly the same map as one layer earlier: only the rows that moved need
        # their keys recomputed at the next eviction.
        moved = (self._p_est[layers] != rows).any(1)
        if moved.any():
            self._p_est[layers[moved]] = rows[moved]
            self._refresh_evict(layers[moved])

    def _set_estimate(self, layer: int, row: np.ndarray) -> None:  # under self._lock
        """`_set_estimates` of one row, without the block's indexing (the usual case: one layer moved)."""
        p = normalised(row)
        self._estimate_ok[layer] = p is not None
        if p is not None:
            self._estimate[layer] = p
            self._set_p(layer, p)

    def _plan(self, layer: int, predicted: np.ndarray, delta: float, l_now: int) -> Sequence[Prefetch]:
        p = normalised(predicted)
        if p is None:
            return []
        with self._lock:
            self._set_p(layer, p)
        return self._plan_normalised(layer, p, delta, l_now)

    def _plan_normalised(self, layer: int, p: np.ndarray, delta: float, l_now: int) -> Sequence[Prefetch]:
        chosen = prefetch_set(p, delta, self.shape.top_k)
        distance = layer - l_now
        # Target layer first (module docstring); p/distance ≤ 1 is scaled into [0, 0.5] so it only orders a layer.
        priority = layer + 0.5 * p[chosen].astype(np.float64) / distance
        return PrefetchBatch(np.full(chosen.size, layer), chosen, priority)

    def _refresh_evict(
        self, rows: int | slice | np.ndarray, p_changed: bool = True
    ) -> None:  # under self._lock (or in __init__)
        """Mark these layers' eviction keys stale after p (`p_changed`), freq or the chain changed.

        Recomputed when an eviction reads them (`_fresh_keys`): the offline warm-up, and every layer between two
        evictions, then cost nothing.
        """
        self._stale[rows] = True
        if p_changed:
            self._p_stale[rows] = True

    def _fresh_keys(self) -> np.ndarray:  # under self._lock
        """[2, L, J] the eviction keys, the stale layers recomputed: the predicted next use, in layer steps.

        Runs after the next one: 0 when p_est predicts use, else the chain's first predicting run, else (past the
        chain) the runs it covers plus the expected wait 1/rate at the use rate freq / runs (Laplace-smoothed).
        """
        if self._stale.any():
            rows = self._stale.nonzero()[0]
            p_rows = self._p_stale.nonzero()[0]
            if p_rows.size:
                self._p_use[p_rows] = predicted_use(self._p_est[p_rows], self.shape.top_k)
            wait = np.maximum((self._runs[rows, None] + 2.0) / (self._freq[rows] + 1.0), 1.0)  # [r, J] 1/rate
            later = self._base[:, rows] + (self.shape.num_layers * wait) * self._past[:, rows]  # [2, r, J]
            self._evict[:, rows] = np.where(self._p_use[rows], self._offset[:, rows], later)
            self._stale[:] = False
            self._p_stale[:] = False
        return self._evict

    def _set_p(self, layer: int, p: np.ndarray) -> None:  # under self._lock
        self._p_est[layer] = p
        self._refresh_evict(layer)

    def _fallback(self, layer: int, l_now: int) -> Sequence[Prefetch]:
        with self._lock:
            self._head_epoch += 1  # p_est[layer] from the observed routing, not from the estimate
            if not self._has_seen[layer]:
                return []
            last = self._last_seen[layer].copy()
        return self._plan(layer, last, 0.0, l_now)

    # --- forward-thread hooks --------------------------------------------------------------------------------
    def record_access(self, layer: int, experts: Sequence[int], hits: Sequence[bool]) -> None:
        idx = np.asarray(experts, np.int64)
        with self._lock:
            self._freq[layer, idx] += 1.0
            # A new run of this layer: the forward thread has moved on from another layer since (a long prefill
            # reports one layer in consecutive chunks). Decided here, on the forward thread: a flag reset by
            # begin_iteration would race with it, since the prefetcher thread runs a varying number of layers
            # behind. With a single MoE layer every report counts.
            if layer != self._last_access or self.shape.num_layers == 1:
                self._runs[layer] += 1.0
            self._last_access = layer
            self._refresh_evict(layer, p_changed=False)

    def choose_victims(self, candidates: Sequence[ExpertKey], current_layer: int, count: int = 1) -> list[ExpertKey]:
        layers, experts = split_keys(candidates)
        L, J = self.shape.num_layers, self.shape.num_experts
        # Key [0] for layers still to run this iteration, [1] for the layers that ran (current_layer included).
        flat = np.where(layers > current_layer, 0, L * J) + flat_codes(candidates, layers, experts, J)
        with self._lock:
            when = self._fresh_keys().reshape(-1)[flat]
        return lowest(candidates, layers, experts, -when, count=count)  # the latest predicted next use first


def _delta(score: float) -> float:
    return min(max(1.0 - score, 0.0), 1.0)
