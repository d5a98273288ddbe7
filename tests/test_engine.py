"""engine: what a settings change does to the policy."""

from __future__ import annotations

from fmoe_local.config import RuntimeConfig
from fmoe_local.runtime import Runtime


def test_a_distance_change_retunes_a_policy_that_can_and_replaces_one_that_cannot(tiny_model_dir):
    config = RuntimeConfig(device="cpu", cache_experts=4, miss_handling="copy", policy="fmoe", prefetch_distance=1)
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        fmoe = runtime.engine.policy
        runtime.reconfigure(prefetch_distance=2)
        assert runtime.engine.policy is fmoe and fmoe.prefetch_distance == 2  # retuned: it keeps what it learned
        runtime.reconfigure(policy="lru")
        lru = runtime.engine.policy
        assert lru.reconfigure(prefetch_distance=3) is False  # Policy's default: it cannot retune
        runtime.reconfigure(prefetch_distance=3)
        assert runtime.engine.policy is not lru and runtime.engine.policy.name == "lru"  # so it is made anew
