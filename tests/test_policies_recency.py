"""lru, on_demand, lfu and speculative: eviction order and what they (do not) prefetch."""

from __future__ import annotations

import numpy as np
import pytest

from fmoe_local.policies.base import ModelShape, Prefetch
from fmoe_local.policies.lfu import LFUPolicy
from fmoe_local.policies.lru import LRUPolicy
from fmoe_local.policies.on_demand import OnDemandPolicy
from fmoe_local.policies.speculative import SpeculativePolicy

SHAPE = ModelShape(num_layers=3, num_experts=8, top_k=2)


def evict_all(policy, candidates, current_layer=0):
    candidates, order = list(candidates), []
    while candidates:
        victim = policy.choose_victims(candidates, current_layer)[0]
        order.append(victim)
        candidates.remove(victim)
    return order


@pytest.mark.parametrize("cls", [LRUPolicy, OnDemandPolicy])
def test_recency_policies_evict_least_recent_and_never_prefetch(cls):
    policy = cls(SHAPE)
    policy.begin_request(0)
    assert policy.begin_iteration(np.ones(4, np.float32)) == []
    assert policy.observe_layer(0, np.full(8, 1 / 8, np.float32)) == []
    policy.record_access(0, [1, 2], [False, False])
    policy.record_access(1, [3], [False])
    policy.record_access(0, [1], [True])
    # (2,7) never used → first; then (0,2) at tick 1, (1,3) at tick 2, (0,1) at tick 3.
    assert evict_all(policy, [(0, 1), (0, 2), (1, 3), (2, 7)]) == [(2, 7), (0, 2), (1, 3), (0, 1)]


def test_lfu_evicts_fewest_uses_then_oldest():
    policy = LFUPolicy(SHAPE)
    policy.record_access(0, [0, 1], [False, False])  # tick 1
    policy.record_access(0, [0], [True])  # tick 2: (0,0) used twice
    policy.record_access(1, [5], [False])  # tick 3
    policy.record_access(1, [5], [True])  # tick 4: (1,5) used twice, more recently than (0,0)
    policy.record_access(2, [2], [False])  # tick 5: once, newest
    order = evict_all(policy, [(0, 0), (0, 1), (1, 5), (2, 2), (2, 6)])
    assert order == [(2, 6), (0, 1), (2, 2), (0, 0), (1, 5)]


def test_speculative_prefetches_next_layer_top_k_from_lookahead():
    policy = SpeculativePolicy(SHAPE)
    assert policy.needs_lookahead
    guess = np.array([0.05, 0.4, 0.05, 0.3, 0.1, 0.05, 0.05, 0.0], np.float32)
    out = policy.observe_layer(0, np.full(8, 1 / 8, np.float32), lookahead=guess)
    assert out == [Prefetch(1, 1, pytest.approx(0.4)), Prefetch(1, 3, pytest.approx(0.3))]
    assert policy.observe_layer(1, np.full(8, 1 / 8, np.float32), lookahead=None) == []
    assert policy.observe_layer(2, np.full(8, 1 / 8, np.float32), lookahead=guess) == []  # no layer 3
    policy.record_access(1, [1], [True])
    assert policy.choose_victims([(1, 1), (2, 0)], current_layer=1)[0] == (2, 0)
