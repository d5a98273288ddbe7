"""PrefetchQueue: the prefetches a forward pass still wants, highest priority first.

Scope: ordering and staleness only — which (layer, expert) the copy engine should take next. The runtime's prefetcher
(prefetcher.py) and the replay's simulated cache (fmoe_bench/simcache.py) both take work from this one class, so their
hit counts agree by construction. It does NOT know residency, copy anything, or lock: callers hold their own lock.

Rules:
- At most one entry per (layer, expert): asking again keeps the higher priority (on a tie, the earlier request).
  Policies re-predict the same experts after every layer; a heap of tuples kept every copy, and moe_infinity's
  ~300 per layer made the queue the replay's slowest part.
- Only the newest forward pass's entries count: pushing for a newer iteration drops the older ones, pushing for an
  older one is ignored, and an entry for a layer the forward pass has reached is never handed out.
- `pop` returns the highest priority; ties go to the entry requested first.

Arrays: L MoE layers, J experts; priority −inf marks "nothing pending".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fmoe_local.policies.base import ExpertKey, Prefetch, prefetch_arrays

_NONE = -np.inf


class PrefetchQueue:
    def __init__(self, num_layers: int, num_experts: int) -> None:
        self._priority = np.full((num_layers, num_experts), _NONE)  # [L, J]
        self._order = np.zeros((num_layers, num_experts), np.int64)  # [L, J] when the kept entry was requested
        self._scratch = np.zeros(num_layers * num_experts, np.int64)  # [L·J] push's duplicate check
        self._next = 0
        self._count = 0
        self.iteration = -1

    def __len__(self) -> int:
        return self._count

    def clear(self) -> None:
        if self._count:
            self._priority.fill(_NONE)
            self._count = 0

    def push(self, iteration: int, prefetches: Sequence[Prefetch]) -> None:
        if iteration < self.iteration:
            return  # a forward pass that is already over
        if iteration > self.iteration:
            self.clear()
            self.iteration = iteration
        if not len(prefetches):
            return
        layers, experts, priorities = prefetch_arrays(prefetches)
        codes = layers * self._priority.shape[1] + experts
        order = np.arange(self._next, self._next + codes.size)
        self._next += codes.size
        if codes.size > 1:
            # The same expert twice in one batch (rare) must keep request order; writing each position into a
            # scratch cell reads back another position wherever a code repeats.
            self._scratch[codes] = order
            if (self._scratch[codes] != order).any():
                for i in range(codes.size):
                    self._put(codes[i : i + 1], priorities[i : i + 1], order[i : i + 1])
                return
        self._put(codes, priorities, order)

    def _put(self, codes: np.ndarray, priorities: np.ndarray, order: np.ndarray) -> None:
        flat = self._priority.reshape(-1)
        current = flat[codes]
        better = priorities > current  # equal: the earlier request stays
        self._count += int(np.count_nonzero(current[better] == _NONE))
        codes = codes[better]
        flat[codes] = priorities[better]
        self._order.reshape(-1)[codes] = order[better]

    def pop(self, iteration: int, current_layer: int, resident: np.ndarray | None = None) -> ExpertKey | None:
        """Take the best entry of `iteration` for a layer after `current_layer`; None when there is none.

        `resident` [L, J] bool: experts already in (or being copied into) the cache; their entries are dropped
        rather than handed out one by one to be skipped.
        """
        if iteration != self.iteration:  # the queue holds an older forward pass only: all of it is stale
            self.clear()
            self.iteration = max(self.iteration, iteration)
            return None
        if not self._count:
            return None
        # Entries that can never be handed out — for a layer the forward pass reached, or already resident — are
        # forgotten, so len() means "work to do".
        live = self._priority != _NONE  # [L, J]
        drop = live & resident if resident is not None else np.zeros_like(live)
        if current_layer >= 0:
            drop[: current_layer + 1] = live[: current_layer + 1]
        dropped = int(np.count_nonzero(drop))
        if dropped:
            self._priority[drop] = _NONE
            self._count -= dropped
            if not self._count:
                return None
        flat = self._priority.reshape(-1)
        best = int(np.argmax(flat))
        tied = np.flatnonzero(flat == flat[best])
        if tied.size > 1:
            best = int(tied[np.argmin(self._order.reshape(-1)[tied])])
        flat[best] = _NONE
        self._count -= 1
        layer, expert = divmod(best, self._priority.shape[1])
        return layer, expert
