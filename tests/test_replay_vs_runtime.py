"""The replay benchmark and the live runtime agree: the same routing gives the same hits and misses.

A tiny model's run is recorded (--record-trace) with the matcher and copies inline (synchronous mode, so nothing
depends on thread timing), then replayed through the same policy with unlimited bandwidth.
"""

from __future__ import annotations

import pytest

from fmoe_bench.presets import cost_model
from fmoe_bench.replay import build_schedule, replay
from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.policies import make_policy
from fmoe_local.runtime import Runtime
from fmoe_local.traces import load_trace

PROMPTS = ["Tell me about the ocean.", "Write a poem about the moon.", "Tell me about the sea and its waves."]


CASES = [(policy, slots) for policy in ("fmoe", "moe_infinity", "lru", "lfu", "on_demand") for slots in (5, 12)]


@pytest.mark.parametrize("policy, slots", CASES)
def test_replay_gives_the_runtime_hit_counts(policy, slots, tiny_model_dir, tmp_path):
    trace_path = tmp_path / "run.npz"
    config = RuntimeConfig(
        device="cpu",
        cache_experts=slots,
        miss_handling="copy",
        policy=policy,
        prefetch_distance=1,
        synchronous_prefetch=True,
        record_trace=str(trace_path),
        sampling=Sampling(greedy=True, max_new_tokens=8),
    )
    hits = misses = 0
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        shape = runtime.engine.shape
        for prompt in PROMPTS:
            stats = runtime.generate([{"role": "user", "content": prompt}]).stats
            hits, misses = hits + stats.hits, misses + stats.misses

    trace = load_trace(trace_path)
    schedule = build_schedule(trace, semantic_mode="running_mean")
    cost = cost_model("mixtral-8x7b", bandwidth_gbs=1e9)  # every queued copy lands before the next layer
    result = replay(schedule, make_policy(policy, shape, config), slots, cost, mode="online")
    assert (result.hits, result.misses) == (hits, misses)
    assert misses > 0
