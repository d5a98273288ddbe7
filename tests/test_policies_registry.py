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
