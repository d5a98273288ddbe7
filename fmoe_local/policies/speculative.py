"""speculative: prefetch layer l+1's experts from layer l+1's router applied to layer l's hidden state; LRU.

Scope: the lookahead-gate family (e.g. speculative expert prefetching in Pre-gated MoE / AdapMoE style): residual
streams change little between adjacent layers, so the next router on the current hidden state guesses the next
layer's choice. It needs the runtime to compute `lookahead` (needs_lookahead=True); without one it prefetches
nothing. It does NOT keep any history across iterations besides LRU recency.
"""

from __future__ import annotations

import numpy as np

from fmoe_local.policies._common import RecencyPolicy, top_k
from fmoe_local.policies.base import Prefetch


class SpeculativePolicy(RecencyPolicy):
    name = "speculative"
    needs_lookahead = True

    def observe_layer(self, layer: int, probs: np.ndarray, lookahead: np.ndarray | None = None) -> list[Prefetch]:
        target = layer + 1
        if lookahead is None or target >= self.shape.num_layers:
            return []
        guess = np.asarray(lookahead, np.float32).reshape(-1)  # [J]
        return [Prefetch(target, int(j), float(guess[j])) for j in top_k(guess, self.shape.top_k)]
