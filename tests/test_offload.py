"""Offload: the one owner of the cache, the prefetcher, the policy's calls and the miss handling.

Driven through a runtime on a tiny model (the real loading path), since what matters is that a settings change made
through the Offload reaches every piece it owns, and that the forward pass gets what it asks for.
"""

from __future__ import annotations

import pytest

from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.copier import Interrupted
from fmoe_local.policies import make_policy
from fmoe_local.runtime import Runtime

PROMPT = [{"role": "user", "content": "Tell me about the ocean and the waves."}]


def _config(**changes) -> RuntimeConfig:
    base = RuntimeConfig(device="cpu", cache_experts=4, miss_handling="copy", synchronous_prefetch=True)
    return base.with_changes(sampling=Sampling(greedy=True, max_new_tokens=4), **changes)


def test_a_new_policy_reaches_the_cache_the_matcher_and_the_miss_handling(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="lru")) as runtime:
        engine = runtime.engine
        offload = engine.offload
        assert offload.miss_handling == "copy"
        policy = make_policy("cpu_moe", engine.shape, runtime.config, engine.map_store)
        offload.set_policy(policy)
        assert offload.policy is policy and engine.cache.policy is policy and engine.policy is policy
        assert offload.miss_handling == "cpu"  # cpu_moe forces its own
        layers_kept = offload.capacity // engine.shape.num_experts
        assert len(policy.resident_layers) == layers_kept  # it was told the cache's size
        stats = runtime.generate(PROMPT).stats
        assert stats.misses > 0 and stats.on_host == stats.misses  # every miss computed on the CPU, none copied


def test_miss_handling_changes_reach_the_forward_pass(tiny_model_dir):
    with Runtime.load(tiny_model_dir("olmoe"), _config(policy="on_demand")) as runtime:
        copied = runtime.generate(PROMPT)
        assert copied.stats.misses > 0 and copied.stats.on_host == 0 and copied.stats.bytes_moved > 0
        runtime.reconfigure(miss_handling="cpu")
        assert runtime.engine.offload.miss_handling == "cpu"
        runtime.reset_cache()
        on_cpu = runtime.generate(PROMPT)
        assert on_cpu.stats.misses > 0 and on_cpu.stats.on_host == on_cpu.stats.misses
        assert on_cpu.stats.bytes_moved == 0 and on_cpu.stats.host_s > 0
        assert on_cpu.token_ids == copied.token_ids  # on a CPU device both paths run the same ops


def test_a_resize_gives_a_cold_cache_of_the_new_size_that_the_policy_is_told(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="cpu_moe")) as runtime:
        offload = runtime.engine.offload
        J = runtime.engine.shape.num_experts
        runtime.generate(PROMPT)
        offload.resize(2 * J)
        assert offload.capacity == 2 * J and offload.resident() == []
        assert len(offload.policy.resident_layers) == 2
        assert runtime.generate(PROMPT).error == ""


def test_after_stop_the_next_layer_asks_for_nothing(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="lru")) as runtime:
        offload = runtime.engine.offload
        offload.interrupt.set()
        try:
            with pytest.raises(Interrupted):
                offload.acquire(0, [0, 1])
            assert offload.resident() == [] and runtime.engine.counters.misses.sum() == 0
        finally:
            offload.interrupt.clear()
        offload.release([-1, -1])  # host experts hold no slot: nothing to release
        assert runtime.generate(PROMPT).error == ""


def test_the_pinned_ram_budget_is_half_the_machine_unless_set_and_never_negative(tiny_model_dir):
    from fmoe_local import hardware
    from fmoe_local.engine import pinned_budget

    assert pinned_budget(RuntimeConfig()) == hardware.ram_bytes()[0] // 2
    assert pinned_budget(RuntimeConfig(pinned_ram_gb=1.5)) == int(1.5 * 1024**3)
    assert pinned_budget(RuntimeConfig(pinned_ram_gb=0.0)) == 0
    with pytest.raises(ValueError, match="pinned RAM to 0 GB"):
        RuntimeConfig(pinned_ram_gb=-1.0).validate()
    with Runtime.load(tiny_model_dir("olmoe"), _config()) as runtime:  # a CPU device copies nothing: pins nothing
        assert runtime.engine.offload.pinned_bytes == 0 == runtime.engine.host.pinned_bytes
