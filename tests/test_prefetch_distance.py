from dataclasses import replace

import pytest

from fmoe_bench.presets import cost_model
from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.prefetch_distance import decode_layer_s, distance_for
from fmoe_local.runtime import Runtime

PROMPT = [{"role": "user", "content": "Tell me about the ocean and the waves."}]


def test_distance_covers_one_copy_plus_a_layer() -> None:
    assert distance_for(0.69e-3, 0.286e-3, 26) == 4  # 2.4 layer times → 3, plus one
    assert distance_for(1e-3, 1e-3, 26) == 2  # exactly one layer time
    assert distance_for(1e-6, 1e-3, 26) == 2
    assert distance_for(1.0, 1e-3, 32) == 31  # never past the last layer
    assert distance_for(1.0, 1e-3, 1) == 1


def test_presets_give_the_documented_distances() -> None:
    ds = cost_model("deepseek-v2-lite")
    mx = cost_model("mixtral-8x7b")
    assert distance_for(ds.load_s, ds.layer_time_s, 26) == 4
    assert distance_for(mx.load_s, mx.layer_time_s, 32) == 14


def test_impossible_times_are_refused() -> None:
    for load, layer in ((0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="positive"):
            distance_for(load, layer, 26)


def test_decode_layer_time_leaves_out_the_waits() -> None:
    assert decode_layer_s(1.0, 0.2, tokens=4, num_layers=10) == pytest.approx(0.02)  # 0.8 s over 40 layer runs
    assert decode_layer_s(1.0, 0.0, tokens=0, num_layers=10) is None  # no decode step measured
    assert decode_layer_s(1.0, 1.0, tokens=4, num_layers=10) is None  # nothing but waiting


def test_the_runtime_applies_the_replays_rule(tiny_model_dir) -> None:
    config = RuntimeConfig(device="cpu", cache_experts=3, miss_handling="copy", prefetch_distance_auto=True)
    config = config.with_changes(sampling=Sampling(greedy=True, max_new_tokens=6))
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        engine = runtime.engine
        runtime.generate(PROMPT)
        assert runtime.config.prefetch_distance == 3  # no GPU: no copy to plan for, d stays
        # As if a GPU were there: a copy far faster than any layer is planned one layer ahead, plus one.
        costs = engine.miss_costs
        engine.miss_costs = replace(costs, device="cuda", h2d_gbps=costs.expert_bytes * 1e3)  # 1 µs per copy
        runtime.generate(PROMPT)
        assert runtime.config.prefetch_distance == 2 and engine.policy.prefetch_distance == 2
        assert engine.map_store.prefetch_distance == 2
        # The same rule bench replay's auto applies: 2.5 layer times of copy → 3 layers, plus one.
        engine.miss_costs = replace(costs, device="cuda", h2d_gbps=costs.expert_bytes / 2.5e-3 / 1e9)
        engine.adapt_distance(1e-3)
        assert runtime.config.prefetch_distance == distance_for(2.5e-3, 1e-3, 4) == 3
        runtime.reconfigure(prefetch_distance=2)
        engine.adapt_distance(None)  # no decode measured: d stays as set
        assert runtime.config.prefetch_distance == 2
