"""How the fmoe policy reads a successor chain for eviction: how many runs ahead, and the first run predicting each
expert.

Scope: arithmetic on [m, L, J] bool chains (row 0: the current iteration's matched map's top-K, row r: the map r
links later in its own request, policies/fmoe.py "Successor links"). No state and no map store: fmoe.py owns the
chain and turns these runs into eviction keys.
"""

from __future__ import annotations

import numpy as np


def chain_horizon(num_experts: int, top_k: int) -> int:
    """Runs of a layer, the next one included, whose use the successor chain predicts: ⌈1.5 · J / K⌉.

    A chain of top-K rows names J / K runs' worth of different experts; a few runs past that, the first run that
    names an expert says more about chance than about the past request. This gives 16 for 64 experts top-6 (the
    length session 3 measured best there) and 6 for 8 experts top-2 (docs/bench.md, session 9).
    """
    if num_experts < 1 or top_k < 1:
        raise ValueError("A model needs at least one expert and top-k of at least 1.")
    return -(-3 * num_experts // (2 * top_k))


def runs_until_predicted(chain: np.ndarray, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """Per case (0: a layer still to run this iteration, 1: one that ran), per (layer, expert): the runs after the
    next one until the first the chain predicts it, else the runs the chain covers; and 1.0 where it predicts none.

    A layer still to run is next run by this iteration (row 0), then by the iterations of rows 1, 2, …; a layer
    that ran is next run by the iteration of row 1, then rows 2, …. Only the first `horizon` runs count.
    Returns two [2, L, J] float64 arrays.
    """
    _, L, J = chain.shape
    runs = np.zeros((2, L, J), np.float64)
    past = np.ones((2, L, J), np.float64)
    for case in (0, 1):
        rows = chain[case + 1 : case + horizon]  # runs 1 .. horizon − 1 after the next
        if rows.shape[0]:
            hit = rows.any(0)
            runs[case] = np.where(hit, rows.argmax(0) + 1, rows.shape[0])
            past[case] = ~hit
    return runs, past
