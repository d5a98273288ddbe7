"""policies/_common.py: the shared tie-breaking and prefetch-set helpers."""

from __future__ import annotations

import numpy as np
import pytest

from fmoe_local.policies._common import lowest, prefetch_set, split_keys


@pytest.mark.parametrize("seed", range(40))
def test_lowest_is_lexsorts_first_rows_whatever_the_candidate_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 48))
    keys = rng.choice(np.arange(8 * 6), size=n, replace=False)
    candidates = [(int(k) // 6, int(k) % 6) for k in keys]  # distinct (layer, expert), shuffled
    layers, experts = split_keys(candidates)
    # Few distinct values so that ties on every key are common; bool and float keys as the policies pass them.
    primary = rng.integers(0, 2, n).astype(bool)
    secondary = rng.integers(0, 3, n).astype(np.float32) / 3.0
    tertiary = rng.integers(-1, 2, n)
    for ks in [(tertiary,), (secondary, primary), (tertiary, secondary, primary), ()]:
        order = np.lexsort((experts, layers, *ks))
        for count in (1, 2, 5, n):
            expected = [candidates[int(i)] for i in order[:count]]
            assert lowest(candidates, layers, experts, *ks, count=count) == expected


def test_prefetch_set_takes_at_least_k_and_reaches_delta() -> None:
    p = np.array([0.5, 0.1, 0.3, 0.1], np.float32)
    assert prefetch_set(p, 0.0, 1).tolist() == [0]
    assert prefetch_set(p, 0.75, 1).tolist() == [0, 2]
    assert prefetch_set(p, 0.85, 1).tolist() == [0, 2, 1]  # tie 0.1/0.1: lower index first
    assert prefetch_set(p, 0.2, 3).tolist() == [0, 2, 1]
