"""Pieces several policies share: recency bookkeeping, "no prefetch" hooks, and the fMoE prefetch-set rule.

Scope: small helpers with no policy of their own. It does NOT pick what a policy prefetches or evicts; each policy
module composes these and says why.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from fmoe_local.config import RuntimeConfig
from fmoe_local.policies.base import CandidateKeys, ExpertKey, ModelShape, Policy, Prefetch


def prefetch_set(probs: np.ndarray, delta: float, k: int) -> np.ndarray:
    """Fewest highest-probability experts whose summed probability reaches `delta`, and at least `k` of them.

    `probs` [J] is taken as given (callers normalise it). Ties keep the lower expert index first. If the mass never
    reaches `delta` (a distribution summing below it), every expert with non-zero probability is taken.
    """
    # Array methods rather than np.* functions: this runs after every layer, and their Python wrappers cost more
    # than the work on J numbers.
    order = (-probs).argsort(kind="stable")  # [J] highest first
    csum = probs[order].cumsum()
    reach = int(csum.searchsorted(delta - 1e-7)) + 1  # first prefix whose sum ≥ δ (float slack for δ = 1)
    if reach > order.size:
        reach = int(np.count_nonzero(probs))
    return order[: min(order.size, max(k, reach))]


def normalised(probs: np.ndarray) -> np.ndarray | None:
    """probs / sum, or None when there is no mass (nothing to predict from)."""
    p = np.asarray(probs, np.float32)
    total = float(p.sum())
    return p / total if total > 0 else None


def predicted_use(rows: np.ndarray, k: int) -> np.ndarray:
    """[..., J] bool: each row's k most probable experts (all of a tie at the k-th), never a zero entry: the experts a
    predicted row says will run, whether a map holds full softmaxes or only top-k entries."""
    top = rows.shape[-1] - min(k, rows.shape[-1])  # the k-th largest's position in ascending order
    kth = rows.copy()
    kth.partition(top, axis=-1)  # in place: np.partition's wrapper costs more than the work on a few rows
    kth = kth[..., top : top + 1]
    return (rows >= kth) & (rows > 0)


def top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries, largest first (ties: lower index first)."""
    return np.argsort(-np.asarray(probs), kind="stable")[:k]


class RecencyPolicy(Policy):
    """No prefetching; evicts the least recently used candidate. Never-used candidates go first, in given order.

    Shared by lru, on_demand and speculative (which adds prefetches). record_access and choose_victims are
    serialised by the cache's lock (policies/base.py); begin_iteration/observe_layer touch nothing they read.
    """

    name = "lru"
    needs_lookahead = False

    def __init__(self, shape: ModelShape, config: RuntimeConfig | None = None, map_store: object | None = None) -> None:
        self.shape = shape
        self._tick = 0
        self._last_use = np.full((shape.num_layers, shape.num_experts), -1, np.int64)  # [L, J]

    def begin_request(self, request_id: int) -> None:
        pass

    def begin_iteration(self, semantic: np.ndarray | None) -> list[Prefetch]:
        return []

    def observe_layer(self, layer: int, probs: np.ndarray, lookahead: np.ndarray | None = None) -> list[Prefetch]:
        return []

    def record_access(self, layer: int, experts: Sequence[int], hits: Sequence[bool]) -> None:
        self._tick += 1
        self._last_use[layer, np.asarray(experts, np.int64)] = self._tick

    def choose_victims(self, candidates: Sequence[ExpertKey], current_layer: int, count: int = 1) -> list[ExpertKey]:
        layers, experts = split_keys(candidates)
        codes = flat_codes(candidates, layers, experts, self.shape.num_experts)
        return lowest(candidates, layers, experts, self._last_use.ravel()[codes], count=count)

    def end_iteration(self) -> None:
        pass

    def end_request(self) -> None:
        pass


def learn_pass(
    policy: Policy, probs: np.ndarray, semantic: np.ndarray | None, layers: Sequence[int] | None = None
) -> None:
    """A forward pass the policy only learns from, with nothing to prefetch (a complete cache, a replay's warm-up).

    `probs` [n, J] are the distributions of MoE layers `layers` (default: 0..n−1, every layer of the pass). Layers
    0..n−1 in order go to the policy's `observe_iteration`; otherwise its usual calls, prefetches dropped.
    """
    layers = list(range(len(probs))) if layers is None else list(layers)
    if layers == list(range(len(probs))):
        policy.observe_iteration(probs, semantic)
        return
    policy.begin_iteration(semantic)
    for row, layer in enumerate(layers):
        policy.observe_layer(layer, probs[row])
    policy.end_iteration()


def lowest(
    candidates: Sequence[ExpertKey], layers: np.ndarray, experts: np.ndarray, *keys: np.ndarray, count: int = 1
) -> list[ExpertKey]:
    """The `count` candidates with the smallest `keys`, smallest first (the last key is the most significant, as
    in np.lexsort).

    Exact ties go to the smallest (layer, expert), so a choice never depends on the order the cache lists its
    candidates in: a caller (a test, a policy wrapping another) may list them in any order.
    The result is np.lexsort's first rows without sorting everything: this runs for every eviction, about a
    million times per replayed trace. Candidates known to come in (layer, expert) order (`CandidateKeys.in_order`,
    the cache's, slot_table.py) break ties by position, so one victim under a single key is one argmin.
    """
    n = len(layers)
    need = min(count, n)
    if need <= 0:
        return []
    in_order = isinstance(candidates, CandidateKeys) and candidates.in_order
    if need == 1:
        return [candidates[_first(keys, layers, experts, in_order)]]
    ordered: list[np.ndarray | None] = [*reversed(keys), None]  # most significant first; None: (layer, expert)
    picked: list[int] = []
    idx: np.ndarray | None = None  # the candidates still in the running (None: all of them)
    for level, key in enumerate(ordered):
        k = _at(key, idx, layers, experts, in_order)
        bound = np.partition(k, need - 1)[need - 1]
        head = k <= bound
        if level == len(ordered) - 1 or np.count_nonzero(head) <= 2 * need + 8:
            # Few enough: sort everything up to the need-th smallest, ties included, on all remaining keys.
            sel = _within(idx, head.nonzero()[0])
            picked += sel[_lexsort(sel, ordered[level:], layers, experts, in_order)[:need]].tolist()
            break
        # Many ties at `bound` (a bool key, a shared timestamp): the ones below it are in, then narrow the ties.
        tied = k == bound
        if np.count_nonzero(tied) == k.size:  # all tie (a bool key nobody sets): the next key decides
            continue
        below = _within(idx, (k < bound).nonzero()[0])
        picked += below[_lexsort(below, ordered[level:], layers, experts, in_order)].tolist()
        need -= below.size
        idx = _within(idx, tied.nonzero()[0])
    return [candidates[i] for i in picked]


def _within(idx: np.ndarray | None, pos: np.ndarray) -> np.ndarray:
    """Candidate indices of positions `pos` in the subset `idx` (None: all candidates)."""
    return pos if idx is None else idx[pos]


def _at(
    key: np.ndarray | None, idx: np.ndarray | None, layers: np.ndarray, experts: np.ndarray, in_order: bool
) -> np.ndarray:
    """`key` at the candidates `idx` (None: all); key None is the (layer, expert) order."""
    if key is None:
        return _order_key(idx, layers, experts, in_order)
    return key if idx is None else key[idx]


def _lexsort(idx: np.ndarray, ordered: list, layers: np.ndarray, experts: np.ndarray, in_order: bool) -> np.ndarray:
    """Positions in `idx` sorting it by `ordered` (most significant first, None = (layer, expert))."""
    if idx.size <= 1:
        return np.arange(idx.size)
    return np.lexsort([_at(key, idx, layers, experts, in_order) for key in reversed(ordered)])


def _first(keys: tuple[np.ndarray, ...], layers: np.ndarray, experts: np.ndarray, in_order: bool) -> int:
    """Position of the smallest candidate: narrowed key by key (most significant first) until one is left."""
    idx: np.ndarray | None = None  # the candidates still tied (None: all of them)
    for level in range(len(keys) - 1, -1, -1):
        k = keys[level] if idx is None else keys[level][idx]
        pos = int(np.argmin(k))  # the first of the smallest: the smallest position among ties
        if in_order and level == 0:
            return pos if idx is None else int(idx[pos])
        tied = k == k[pos]
        ties = np.count_nonzero(tied)
        if ties == 1:
            return pos if idx is None else int(idx[pos])
        if ties < k.size:  # else all tie (a bool key nobody sets): the next key decides among the same ones
            idx = _within(idx, tied.nonzero()[0])
    pos = int(np.argmin(_order_key(idx, layers, experts, in_order)))  # distinct: one smallest
    return pos if idx is None else int(idx[pos])


def _order_key(idx: np.ndarray | None, layers: np.ndarray, experts: np.ndarray, in_order: bool) -> np.ndarray:
    """The (layer, expert) order of the candidates `idx` (None: all) as one distinct integer each."""
    if in_order:  # positions are in (layer, expert) order already
        return np.arange(layers.size) if idx is None else idx
    lay, exp = (layers, experts) if idx is None else (layers[idx], experts[idx])
    return lay * 1_048_576 + exp  # J < 2^20


def flat_codes(
    candidates: Sequence[ExpertKey], layers: np.ndarray, experts: np.ndarray, num_experts: int
) -> np.ndarray:
    """layer · J + expert of each candidate: indices into a raveled [L, J] array (one gather instead of two)."""
    codes = candidates.codes if isinstance(candidates, CandidateKeys) else None
    return codes if codes is not None else layers * num_experts + experts


def split_keys(candidates: Sequence[ExpertKey]) -> tuple[np.ndarray, np.ndarray]:
    """Candidates as two int arrays (layers, experts), for vectorised priority lookups."""
    if isinstance(candidates, CandidateKeys):  # the cache's candidates are arrays already
        return candidates.layers, candidates.experts
    if hasattr(candidates, "__array__"):
        keys = np.asarray(candidates, dtype=np.int64).reshape(-1, 2)
    else:
        flat = itertools.chain.from_iterable(candidates)  # twice as fast as np.asarray on a list of tuples
        keys = np.fromiter(flat, np.int64, count=2 * len(candidates)).reshape(-1, 2)  # [n, 2]
    return keys[:, 0], keys[:, 1]
