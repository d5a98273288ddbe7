"""policies/_common.py: the shared tie-breaking and prefetch-set helpers."""

from __future__ import annotations

import numpy as np
import pytest

from fmoe_local.policies._common import flat_codes, lowest, prefetch_set, split_keys
from fmoe_local.policies.base import CandidateKeys


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


@pytest.mark.parametrize("seed", range(20))
def test_lowest_on_ordered_candidate_arrays_matches_the_tuple_list(seed: int) -> None:
    """The replay's candidates (ascending arrays, ties broken by position) choose what a shuffled list would."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    codes = np.sort(rng.choice(26 * 64, size=n, replace=False))
    ordered = CandidateKeys(codes // 64, codes % 64, in_order=True, codes=codes)
    shuffled = [ordered[int(i)] for i in rng.permutation(n)]
    # A bool key that is all True half the time (fmoe's "not mis-prefetched"), a timestamp with ties, a float.
    flag = np.ones(n, bool) if seed % 2 else rng.random(n) > 0.1
    stamp, score = rng.integers(-1, 20, n), rng.integers(0, 4, n) / 4.0
    layers, experts = split_keys(shuffled)
    by_code = {int(c): i for i, c in enumerate(codes)}
    to_shuffled = np.array([by_code[lay * 64 + e] for lay, e in shuffled])  # shuffled position → ordered position
    for ks in [(stamp,), (stamp, score), (score, flag), (stamp, score, flag)]:
        for count in (1, 2, 3, 7, n):
            want = lowest(shuffled, layers, experts, *(k[to_shuffled] for k in ks), count=count)
            assert lowest(ordered, ordered.layers, ordered.experts, *ks, count=count) == want


def test_flat_codes_index_a_raveled_layer_by_expert_array() -> None:
    candidates = [(2, 5), (0, 1), (1, 7)]
    layers, experts = split_keys(candidates)
    grid = np.arange(3 * 8).reshape(3, 8)
    assert grid.ravel()[flat_codes(candidates, layers, experts, 8)].tolist() == [21, 1, 15]
    arrays = CandidateKeys(layers, experts, codes=np.array([21, 1, 15]))
    assert flat_codes(arrays, layers, experts, 8).tolist() == [21, 1, 15]


def test_prefetch_set_takes_at_least_k_and_reaches_delta() -> None:
    p = np.array([0.5, 0.1, 0.3, 0.1], np.float32)
    assert prefetch_set(p, 0.0, 1).tolist() == [0]
    assert prefetch_set(p, 0.75, 1).tolist() == [0, 2]
    assert prefetch_set(p, 0.85, 1).tolist() == [0, 2, 1]  # tie 0.1/0.1: lower index first
    assert prefetch_set(p, 0.2, 3).tolist() == [0, 2, 1]
