"""MoE-Infinity policy: EAM counting, nearest-EAM matching, proximity-weighted prefetch and cache priority."""

from __future__ import annotations

import numpy as np
import pytest

from fmoe_local.config import RuntimeConfig
from fmoe_local.policies.base import ModelShape
from fmoe_local.policies.moe_infinity import MoEInfinityPolicy

SHAPE = ModelShape(num_layers=3, num_experts=4, top_k=1)


def onehot(e: int) -> np.ndarray:
    p = np.full(4, 0.1, np.float32)
    p[e] = 0.7
    return p


def run_request(policy: MoEInfinityPolicy, request_id: int, per_layer: list[int], tokens: int = 1) -> None:
    policy.begin_request(request_id)
    for _ in range(tokens):
        policy.begin_iteration(None)
        for layer, e in enumerate(per_layer):
            policy.observe_layer(layer, onehot(e))
        policy.end_iteration()
    policy.end_request()


def make(capacity: int = 8) -> MoEInfinityPolicy:
    return MoEInfinityPolicy(SHAPE, RuntimeConfig(store_capacity=capacity))


def test_request_eam_goes_to_the_collection_at_end_request():
    policy = make()
    run_request(policy, 1, [0, 1, 2], tokens=2)
    assert len(policy) == 1
    slot, distance = policy.match(np.array([[2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 2, 0]], np.float32), layers=3)
    assert (slot, distance) == (0, pytest.approx(0.0, abs=1e-6))


def test_match_is_mean_per_layer_cosine_over_seen_layers():
    policy = make()
    policy.add_eam(np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1]], np.float32))
    query = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]], np.float32)
    # Layers 0 and 1 each have cosine 1/√2; layer 2 (not seen yet) is ignored.
    assert policy.match(query, layers=2) == (0, pytest.approx(1 - 1 / np.sqrt(2)))
    assert policy.match(query, layers=3) == (0, pytest.approx(1 - 2 / (3 * np.sqrt(2))))


def test_prefetch_follows_nearest_eam_with_layer_proximity():
    policy = make()
    run_request(policy, 1, [0, 1, 2])
    run_request(policy, 2, [3, 3, 3])
    policy.begin_request(3)
    assert policy.begin_iteration(None) == []  # nothing of this request seen yet
    out = policy.observe_layer(0, onehot(0))  # matches request 1
    # ratio 1 × (1 − (l − 0)/3): layer 1 → 2/3, layer 2 → 1/3.
    assert [(p.layer, p.expert, p.priority) for p in out] == [
        (1, 1, pytest.approx(2 / 3)),
        (2, 2, pytest.approx(1 / 3)),
    ]
    assert policy.observe_layer(2, onehot(2)) == []  # last layer: nothing after it


def test_prefetch_takes_at_most_2k_most_active_experts_per_layer():
    policy = make()
    policy.add_eam(np.array([[1, 0, 0, 0], [3, 2, 1, 1], [0, 0, 0, 0]], np.float32))
    policy.begin_request(1)
    out = policy.observe_layer(0, onehot(0))
    assert [(p.layer, p.expert, p.priority) for p in out] == [
        (1, 0, pytest.approx(3 / 7 * 2 / 3)),
        (1, 1, pytest.approx(2 / 7 * 2 / 3)),
    ]


def test_later_iterations_match_on_the_whole_request_so_far():
    policy = make()
    run_request(policy, 1, [0, 1, 2])
    policy.begin_request(2)
    policy.begin_iteration(None)
    for layer, e in enumerate([0, 1, 2]):
        policy.observe_layer(layer, onehot(e))
    policy.end_iteration()
    out = policy.begin_iteration(None)  # l_now = −1: proximity 1 − (l + 1)/3
    assert [(p.layer, p.expert, p.priority) for p in out] == [
        (0, 0, pytest.approx(2 / 3)),
        (1, 1, pytest.approx(1 / 3)),
        (2, 2, pytest.approx(0.0)),
    ]


def test_full_collection_replaces_least_matched():
    policy = make(capacity=2)
    a = policy.add_eam(np.array([[1, 0, 0, 0]] * 3, np.float32))
    b = policy.add_eam(np.array([[0, 1, 0, 0]] * 3, np.float32))
    policy.begin_request(1)
    policy.observe_layer(0, onehot(0))  # matches a once
    assert policy.add_eam(np.array([[0, 0, 1, 0]] * 3, np.float32)) == b
    # a has been matched once, the newcomer never: the newcomer goes next.
    assert policy.add_eam(np.array([[0, 0, 0, 1]] * 3, np.float32)) == b != a
    assert len(policy) == 2


def test_cache_priority_mixes_matched_and_own_ratios_with_proximity():
    policy = make()
    run_request(policy, 1, [0, 1, 2])
    policy.begin_request(2)
    policy.observe_layer(0, onehot(0))
    # (0,0): own 1, matched 1 → 1 × 1; (1,1): (0 + 1)/2 × 2/3; (2,2): (0 + 1)/2 × 1/3; (1,3): 0.
    candidates = [(0, 0), (1, 1), (2, 2), (1, 3)]
    order = []
    while candidates:
        victim = policy.choose_victims(candidates, current_layer=0)[0]
        order.append(victim)
        candidates.remove(victim)
    assert order == [(1, 3), (2, 2), (1, 1), (0, 0)]


def test_collection_grows_past_its_first_allocation_up_to_capacity():
    policy = make(capacity=100)
    rng = np.random.default_rng(0)
    eams = rng.integers(0, 3, size=(101, 3, 4)).astype(np.float32)
    slots = [policy.add_eam(e) for e in eams]
    assert slots[:100] == list(range(100)) and len(policy) == 100
    assert policy.match(eams[70], layers=3) == (70, pytest.approx(0.0, abs=1e-6))
