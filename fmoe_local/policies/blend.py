"""Match confidence sets the mix: a matched map's prediction blended with the layer's recent routing.

Scope: one rule the fmoe policy (policies/fmoe.py) applies to every row a map predicts — what it prefetches and what
it expects at a layer's next run. It does NOT search maps or order evictions.

Why: a new user's store holds a handful of maps, and its best match may predict worse than the routing a store-less
policy would assume, the layer's last observed distribution (consecutive decode steps largely repeat their
routing). The prediction used is w · map + (1 − w) · recent, and w is chosen by how the candidates have actually
predicted so far: after every layer run, each candidate mix in MIX_WEIGHTS is scored by how many of the experts
the layer used were in its top-K, and the best so far is used (ties go to the larger weight, so the paper's rule,
w = 1, holds until recency has done better). No threshold and nothing fitted to a trace: the measured record of
the matches decides. On the shared traces the map pulls ahead within the first request (docs/bench.md, "Session 8"),
after which the prediction is the map's alone.
"""

from __future__ import annotations

import numpy as np

from fmoe_local.policies._common import predicted_use

MIX_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)  # candidate w: the recent routing only … the map only


def blend(predicted: np.ndarray, prior: np.ndarray, weight: float) -> np.ndarray:
    """[..., J] weight · predicted + (1 − weight) · prior, each row normalised to sum 1 first.

    A row with no mass on one side is the other side's row (nothing to mix with); weight 1 returns `predicted` as
    it is.
    """
    if weight >= 1.0:
        return predicted
    predicted, prior = np.asarray(predicted, np.float32), np.asarray(prior, np.float32)
    p_sum, q_sum = predicted.sum(-1, keepdims=True), prior.sum(-1, keepdims=True)
    if (p_sum > 0).all() and (q_sum > 0).all():  # the usual case: both sides have mass in every row
        return weight * (predicted / p_sum) + (1.0 - weight) * (prior / q_sum)
    p, q = _unit_rows(predicted), _unit_rows(prior)
    p_has, q_has = p_sum > 0, q_sum > 0
    mixed = weight * p + (1.0 - weight) * q
    return np.where(p_has & q_has, mixed, np.where(p_has, p, q)).astype(np.float32)


class MixChoice:
    """The weight of the map in `blend`: the candidate whose top-K has held the most of the experts used so far."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self._weights = np.asarray(MIX_WEIGHTS, np.float32)
        self._w_map, self._w_prior = self._weights[:, None], 1.0 - self._weights[:, None]  # [W, 1] each
        self._held = np.zeros(len(MIX_WEIGHTS))  # [W] used experts each candidate's top-K held, all layers together
        self._weight = self._best()  # read for every predicted row, changed only by `score`

    @property
    def weight(self) -> float:
        return self._weight

    def _best(self) -> float:
        held = self._held.tolist()  # 5 numbers: plain Python is quicker than numpy here
        best = len(held) - 1 - held[::-1].index(max(held))  # ties: the larger weight (the map)
        return float(self._weights[best])

    def score(self, predicted: np.ndarray, prior: np.ndarray, used: np.ndarray) -> None:
        """One layer run: `predicted` [J] the map's row for it, `prior` [J] the layer's previous routing, `used` [J]
        bool the experts it ran. Rows without mass are not scored (one side had nothing to say)."""
        predicted, prior = np.asarray(predicted, np.float32), np.asarray(prior, np.float32)
        p_sum, q_sum = predicted.sum(), prior.sum()
        if not (p_sum > 0 and q_sum > 0):
            return
        p, q = predicted / p_sum, prior / q_sum  # _unit_rows of a row with mass
        mixes = self._w_map * p + self._w_prior * q  # [W, J]
        self._held += (predicted_use(mixes, self.top_k) & used).sum(1)
        self._weight = self._best()


def _unit_rows(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, np.float32)
    sums = rows.sum(-1, keepdims=True)
    return np.divide(rows, sums, out=np.zeros_like(rows), where=sums > 0)
