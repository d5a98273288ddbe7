"""The policy registry: every configured name builds a Policy; fmoe gets (or makes) its map store."""

from __future__ import annotations

import pytest

from fmoe_local.config import POLICIES, RuntimeConfig
from fmoe_local.maps import MapStore
from fmoe_local.policies import REGISTRY, make_policy
from fmoe_local.policies.base import ModelShape, Policy

SHAPE = ModelShape(num_layers=3, num_experts=8, top_k=2, embed_dim=4)


def test_every_configured_policy_is_registered_and_builds():
    assert set(POLICIES) <= set(REGISTRY)
    for name in POLICIES:
        policy = make_policy(name, SHAPE, RuntimeConfig(policy=name), None)
        assert isinstance(policy, Policy)
        assert policy.name == name


def test_fmoe_uses_the_given_store_or_sizes_its_own_from_config():
    store = MapStore(SHAPE, capacity=7, prefetch_distance=1)
    policy = make_policy("fmoe", SHAPE, RuntimeConfig(prefetch_distance=2), store)
    assert policy.store is store and store.prefetch_distance == 2
    own = make_policy("fmoe", SHAPE, RuntimeConfig(store_capacity=5), None)
    assert own.store.capacity == 5


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="Choose one of: fmoe, .*on_demand"):
        make_policy("belady", SHAPE, RuntimeConfig(), None)


@pytest.mark.parametrize("name", POLICIES)
def test_several_victims_at_once_are_the_victims_one_at_a_time(name: str) -> None:
    """The contract that lets the replay ask once per layer while the runtime's cache asks per miss."""
    import numpy as np

    rng = np.random.default_rng(1)
    policy = make_policy(name, SHAPE, RuntimeConfig(policy=name, prefetch_distance=1), None)
    for request in range(3):  # give every policy some history: accesses, maps, an EAM
        policy.begin_request(request)
        for _ in range(4):
            policy.begin_iteration(rng.standard_normal(4).astype(np.float32))
            for layer in range(SHAPE.num_layers):
                probs = rng.dirichlet(np.full(8, 0.3)).astype(np.float32)
                policy.observe_layer(layer, probs, probs)
                experts = np.argsort(-probs)[:2].tolist()
                policy.record_access(layer, experts, [bool(rng.integers(2)) for _ in experts])
            policy.end_iteration()
        policy.end_request()
    policy.begin_request(9)
    policy.begin_iteration(rng.standard_normal(4).astype(np.float32))
    policy.observe_layer(0, rng.dirichlet(np.full(8, 0.3)).astype(np.float32))
    keys = [(layer, e) for layer in range(3) for e in range(8)]
    candidates = [keys[i] for i in rng.permutation(len(keys))[:15]]
    at_once = policy.choose_victims(candidates, 0, 6)
    one_by_one, left = [], list(candidates)
    for _ in range(6):
        victim = policy.choose_victims(left, 0, 1)[0]
        one_by_one.append(victim)
        left.remove(victim)
    assert at_once == one_by_one and len(set(at_once)) == 6


@pytest.mark.parametrize("name", POLICIES)
def test_observe_iteration_learns_what_the_layer_by_layer_calls_learn(name: str) -> None:
    import numpy as np

    rng = np.random.default_rng(2)
    config = RuntimeConfig(policy=name, prefetch_distance=1)
    whole = make_policy(name, SHAPE, config, None)
    stepwise = make_policy(name, SHAPE, config, None)
    for request in range(3):
        for p in (whole, stepwise):
            p.begin_request(request)
        for _ in range(3):
            probs = rng.dirichlet(np.full(8, 0.3), size=SHAPE.num_layers).astype(np.float32)  # [L, J]
            semantic = rng.standard_normal(4).astype(np.float32)
            whole.observe_iteration(probs, semantic)
            stepwise.begin_iteration(semantic)
            for layer in range(SHAPE.num_layers):
                stepwise.observe_layer(layer, probs[layer])
            stepwise.end_iteration()
        for p in (whole, stepwise):
            p.end_request()
    if name == "fmoe":
        assert len(whole.store) == len(stepwise.store) > 0
        for slot in range(len(whole.store)):
            np.testing.assert_array_equal(whole.store.probs(slot), stepwise.store.probs(slot))
    keys = [(layer, e) for layer in range(3) for e in range(8)]
    for p in (whole, stepwise):
        p.begin_request(7)
    semantic = rng.standard_normal(4).astype(np.float32)
    assert list(whole.begin_iteration(semantic)) == list(stepwise.begin_iteration(semantic))
    probs = rng.dirichlet(np.full(8, 0.3)).astype(np.float32)
    assert list(whole.observe_layer(0, probs)) == list(stepwise.observe_layer(0, probs))
    assert whole.choose_victims(keys, 0, len(keys)) == stepwise.choose_victims(keys, 0, len(keys))
