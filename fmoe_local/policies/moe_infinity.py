"""moe_infinity: request-level expert activation matrices (EAMs), after MoE-Infinity (Xue et al.).

Scope: the coarse-grained peer of fmoe. Per request it counts which experts were routed to (the iEAM, [L, J]);
finished requests' EAMs form a bounded collection (EAMC); after each layer the nearest past EAM (cosine over the
layers seen so far) drives prefetching of the following layers and the cache priority. It does NOT use semantic
embeddings or per-iteration maps (that is fmoe's refinement), and keeps its own EAMC in memory (not persisted).

Choices where the paper leaves room (checked against its public code, EfficientMoE/MoE-Infinity):
- counts: at observe_layer the router's top-K (of the token, or of a prefill's mean distribution) each add 1.
- distance: 1 − mean over seen layers of the per-layer cosine (rows with no counts contribute 0), as the code does.
- EAMC replacement when full: the EAM matched least often goes (ties: the oldest), as the code does.
- prefetch: for layers after the current one, the matched EAM's per-layer activation ratio × layer proximity
  (1 − (l − l_now)/L); at most 2K experts per layer (the most active) so a long request's EAM, where most experts
  have some count, does not flood the queue with experts that carry almost no mass.
- cache priority (evict the lowest): ratio × proximity, where ratio averages the matched EAM's and the request's own
  per-layer ratios and proximity is 1 for layers already run this iteration (next needed at the next token);
  ties go to the least recently used.

Kept precomputed because the replay calls these about 70K times per trace (numbers as the formulas above give them,
bit for bit): per stored EAM its prefetch list for every l_now (sorted once when the EAM is stored); per request
its per-layer ratio and unit rows, updated one row per observed layer.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from fmoe_local.config import RuntimeConfig
from fmoe_local.policies._common import RecencyPolicy, flat_codes, lowest, split_keys, top_k
from fmoe_local.policies.base import ExpertKey, ModelShape, Prefetch, PrefetchBatch


class MoEInfinityPolicy(RecencyPolicy):
    name = "moe_infinity"

    def __init__(self, shape: ModelShape, config: RuntimeConfig | None = None, map_store: object | None = None) -> None:
        super().__init__(shape, config, map_store)
        config = config or RuntimeConfig()
        L, J = shape.num_layers, shape.num_experts
        self.capacity = config.store_capacity
        # Two locks so that choose_victims (forward thread) never waits for an EAMC search: `_lock` guards the
        # request's state and is held only for O(L·J) copies; `_eamc_lock` guards the collection. choose_victims
        # reads one EAMC row without it: a row rewritten meanwhile only skews one eviction score.
        self._lock = threading.Lock()
        self._eamc_lock = threading.Lock()
        # Past requests' EAMs, kept only in the two normalised forms the policy reads. Grown on demand: one EAM
        # per request fills far slower than fmoe's per-iteration maps, with which it shares store_capacity.
        rows = min(self.capacity, 64)
        self._eamc_ratio = np.zeros((rows, L, J), np.float32)  # [C, L, J] rows summing to 1
        self._eamc_unit = np.zeros((rows, L, J), np.float32)  # [C, L, J] rows of unit norm (cosine)
        self._plans: list[_Plan | None] = [None] * rows  # per slot: its prefetch list, layer-major
        self._matched_count = np.zeros(rows, np.int64)
        self._stamps = np.zeros(rows, np.int64)
        self._n = 0
        self._next_stamp = 0
        self._ieam = np.zeros((L, J), np.float32)  # [L, J] this request's counts
        self._own = np.zeros((L, J), np.float32)  # [L, J] its per-layer ratios (rows of counts / row total)
        self._unit = np.zeros((L, J), np.float32)  # [L, J] its rows of unit norm (the match query)
        self._matched: int = -1
        self._layer_now = -1  # last layer observed in this iteration (−1 before the first)
        self._proximity_at = -2  # the current layer `_proximity` [L] was computed for (forward thread only)
        self._proximity = np.ones(L)

    # --- EAMC ------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    def add_eam(self, eam: np.ndarray) -> int:
        """Put a finished request's EAM into the collection; returns its slot."""
        eam = np.asarray(eam, np.float32)
        ratio, unit = _row_normalised(eam, order=1), _row_normalised(eam, order=2)
        plan = _Plan(ratio, 2 * self.shape.top_k)
        with self._eamc_lock:
            if self._n < self.capacity:
                if self._n == len(self._stamps):
                    self._grow(min(self.capacity, 2 * self._n))
                slot = self._n
                self._n += 1
            else:  # least matched, then oldest: lexsort's last key is primary
                slot = int(np.lexsort((self._stamps, self._matched_count))[0])
            self._eamc_ratio[slot] = ratio
            self._eamc_unit[slot] = unit
            self._plans[slot] = plan
            self._matched_count[slot] = 0
            self._stamps[slot] = self._next_stamp
            self._next_stamp += 1
        return slot

    def _grow(self, rows: int) -> None:
        def bigger(a: np.ndarray) -> np.ndarray:
            out = np.zeros((rows, *a.shape[1:]), a.dtype)
            out[: len(a)] = a
            return out

        self._eamc_ratio, self._eamc_unit = bigger(self._eamc_ratio), bigger(self._eamc_unit)
        self._matched_count, self._stamps = bigger(self._matched_count), bigger(self._stamps)
        self._plans += [None] * (rows - len(self._plans))

    def match(self, eam: np.ndarray, layers: int) -> tuple[int, float]:
        """Nearest stored EAM over the first `layers` layers: (slot, cosine distance); (−1, 1.0) when empty."""
        if layers <= 0:
            return -1, 1.0
        return self._match_unit(_row_normalised(np.asarray(eam, np.float32)[:layers], order=2), layers)

    def _match_unit(self, q: np.ndarray, layers: int) -> tuple[int, float]:
        """match() for a query whose first `layers` rows are already of unit norm."""
        with self._eamc_lock:
            n = self._n
            if n == 0 or layers <= 0:
                return -1, 1.0
            rows, L, J = self._eamc_unit.shape
            # A strided view of each EAM's first `layers` rows: no copy of the collection per search.
            flat = self._eamc_unit.reshape(rows, L * J)[:n, : layers * J]  # [n, l·J]
            sims = (flat @ np.ascontiguousarray(q[:layers]).reshape(-1)) / layers  # [n] mean per-layer cosine
            best = int(np.argmax(sims))
            return best, float(1.0 - sims[best])

    # --- lifecycle -------------------------------------------------------------------------------------------
    def begin_request(self, request_id: int) -> None:
        with self._lock:
            self._reset()

    def _reset(self) -> None:  # under self._lock
        self._ieam[:] = 0.0
        self._own[:] = 0.0
        self._unit[:] = 0.0
        self._matched = -1
        self._layer_now = -1

    def begin_iteration(self, semantic: np.ndarray | None) -> list[Prefetch]:
        with self._lock:
            self._layer_now = -1
            seen = self._unit.copy() if self._ieam.any() else None
        if seen is None:  # first forward pass of the request: nothing to match on
            return []
        # Earlier tokens of this request have touched every layer: match on all of them.
        return self._predict(seen, self.shape.num_layers, l_now=-1)

    def observe_layer(self, layer: int, probs: np.ndarray, lookahead: np.ndarray | None = None) -> list[Prefetch]:
        chosen = top_k(np.asarray(probs, np.float32).reshape(-1), self.shape.top_k)
        with self._lock:
            counts = self._ieam[layer]  # [J] view
            counts[chosen] += 1.0
            # The _refresh_rows formulas for one row that now has counts. Counts are small integers, so these sums
            # are exact in any order: the same numbers bit for bit.
            self._own[layer] = counts / counts.sum()
            self._unit[layer] = counts / np.sqrt(np.square(counts).sum())
            self._layer_now = layer
            seen = self._unit[: layer + 1].copy()
        if layer + 1 >= self.shape.num_layers:
            return []
        return self._predict(seen, layer + 1, l_now=layer)

    def observe_iteration(self, probs: np.ndarray, semantic: np.ndarray | None) -> None:
        """A whole forward pass to learn from with nothing to predict: the counts observe_layer would add."""
        chosen = np.argsort(-np.asarray(probs, np.float32), axis=1, kind="stable")[:, : self.shape.top_k]  # [L, K]
        with self._lock:
            self._ieam[np.arange(self.shape.num_layers)[:, None], chosen] += 1.0
            self._refresh_rows(slice(None))
            self._layer_now = self.shape.num_layers - 1

    def _refresh_rows(self, rows: slice) -> None:  # under self._lock
        """Recompute the request's ratio and unit rows after their counts changed."""
        counts = self._ieam[rows]
        totals = counts.sum(axis=1, keepdims=True)
        self._own[rows] = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
        self._unit[rows] = _row_normalised(counts, order=2)

    def end_iteration(self) -> None:
        pass

    def end_request(self) -> None:
        with self._lock:
            eam = self._ieam.copy()
            self._reset()
        if eam.any():  # a request stopped before its first layer has nothing to teach
            self.add_eam(eam)

    # --- prediction ------------------------------------------------------------------------------------------
    def _predict(self, seen: np.ndarray, layers: int, l_now: int) -> PrefetchBatch | list[Prefetch]:
        """Prefetches for the layers after `l_now` from the EAM nearest to `seen` ([≥ layers, J] unit rows)."""
        slot, _ = self._match_unit(seen, layers)
        if slot < 0:
            return []
        with self._eamc_lock:
            self._matched_count[slot] += 1
            plan = self._plans[slot]
        with self._lock:
            self._matched = slot
        return plan.after(l_now, self.shape.num_layers)

    # --- eviction --------------------------------------------------------------------------------------------
    def choose_victims(self, candidates: Sequence[ExpertKey], current_layer: int, count: int = 1) -> list[ExpertKey]:
        layers, experts = split_keys(candidates)
        codes = flat_codes(candidates, layers, experts, self.shape.num_experts)
        L = self.shape.num_layers
        with self._lock:
            own = self._own.ravel()[codes]  # the request's ratio
            matched = self._eamc_ratio[self._matched].ravel()[codes] if self._matched >= 0 else own
        ratio = 0.5 * (own + matched)
        if current_layer != self._proximity_at:
            later = np.arange(L)
            self._proximity = np.where(later <= current_layer, 1.0, 1.0 - (later - current_layer) / L)  # [L]
            self._proximity_at = current_layer
        score = ratio * self._proximity[layers]
        # Lowest score first, then least recently used.
        return lowest(candidates, layers, experts, self._last_use.ravel()[codes], score, count=count)


class _Plan:
    """One stored EAM's prefetch list: per layer its `cap` most active experts (ties: lower index), most active
    first, layer by layer; `after(l_now)` is the tail for the layers after l_now, weighted by proximity."""

    def __init__(self, ratio: np.ndarray, cap: int) -> None:
        chosen = np.argsort(-ratio, axis=1, kind="stable")[:, :cap]  # [L, cap]
        values = np.take_along_axis(ratio, chosen, axis=1)
        active = values > 0
        self.layers = np.broadcast_to(np.arange(ratio.shape[0])[:, None], chosen.shape)[active]  # [n]
        self.experts = chosen[active].astype(np.int64)
        self.values = values[active]  # float32, as the ratio
        self.start = np.concatenate([[0], np.cumsum(active.sum(1))])  # [L + 1] first entry of each layer

    def after(self, l_now: int, num_layers: int) -> PrefetchBatch:
        s = int(self.start[l_now + 1])
        layers = self.layers[s:]
        proximity = 1.0 - (layers - l_now) / num_layers
        return PrefetchBatch(layers, self.experts[s:], self.values[s:] * proximity)


def _row_normalised(m: np.ndarray, order: int) -> np.ndarray:
    """Rows scaled to unit L1 (order=1) or L2 (order=2) norm; all-zero rows stay zero."""
    norms = np.abs(m).sum(-1, keepdims=True) if order == 1 else np.sqrt(np.square(m).sum(-1, keepdims=True))
    return np.divide(m, norms, out=np.zeros_like(m, dtype=np.float32), where=norms > 0)
