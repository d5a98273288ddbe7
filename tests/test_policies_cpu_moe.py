"""cpu_moe (llama.cpp's --n-cpu-moe): whole last layers kept on the device, every other expert computed on the CPU,
nothing but the kept layers ever copied."""

from __future__ import annotations

import numpy as np

from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.policies import make_policy
from fmoe_local.policies.base import ModelShape
from fmoe_local.runtime import Runtime

SHAPE = ModelShape(num_layers=4, num_experts=8, top_k=2)


def test_the_cache_keeps_as_many_whole_layers_as_fit_the_last_ones_first():
    policy = make_policy("cpu_moe", SHAPE, RuntimeConfig(policy="cpu_moe"))
    assert policy.miss_handling == "cpu"
    for slots, layers in ((0, []), (7, []), (8, [3]), (23, [2, 3]), (32, [0, 1, 2, 3]), (99, [0, 1, 2, 3])):
        policy.set_capacity(slots)
        assert policy.resident_layers == layers, slots


def test_it_asks_for_each_kept_expert_until_it_has_been_a_hit():
    policy = make_policy("cpu_moe", SHAPE, RuntimeConfig(policy="cpu_moe"))
    policy.set_capacity(16)
    asked = {(p.layer, p.expert) for p in policy.begin_iteration(None)}
    assert asked == {(layer, e) for layer in (2, 3) for e in range(8)}
    policy.record_access(3, [0, 1], [True, False])  # 3/0 was there; 3/1 not yet (its copy has not landed)
    policy.record_access(1, [4], [False])  # not kept: nothing changes
    again = {(p.layer, p.expert) for p in policy.begin_iteration(None)}
    assert again == asked - {(3, 0)}
    assert list(policy.observe_layer(0, np.full(8, 1 / 8, np.float32))) == []
    policy.set_capacity(16)  # a new cache (reset, resize): ask again for everything
    assert len(policy.begin_iteration(None)) == 16


def test_a_learning_pass_that_calls_everything_a_hit_does_not_stop_the_next_request_from_asking():
    # The replay's offline warm-up (and a complete cache's pass) report every access as a hit with nothing copied.
    policy = make_policy("cpu_moe", SHAPE, RuntimeConfig(policy="cpu_moe"))
    policy.set_capacity(8)
    policy.begin_request(1)
    policy.record_access(3, list(range(8)), [True] * 8)
    assert len(policy.begin_iteration(None)) == 0
    policy.end_request()
    policy.begin_request(2)
    assert {(p.layer, p.expert) for p in policy.begin_iteration(None)} == {(3, e) for e in range(8)}


def test_victims_come_from_layers_it_does_not_keep_first():
    policy = make_policy("cpu_moe", SHAPE, RuntimeConfig(policy="cpu_moe"))
    policy.set_capacity(8)  # keeps layer 3
    policy.record_access(0, [5], [False])  # (0, 5) used more recently than the never-used (3, 1)
    victims = policy.choose_victims([(3, 1), (0, 5), (3, 0)], current_layer=1, count=3)
    assert victims == [(0, 5), (3, 0), (3, 1)]


def test_in_the_runtime_only_the_kept_layers_are_copied_and_every_other_expert_runs_on_the_cpu(tiny_model_dir):
    model = tiny_model_dir("mixtral")  # 4 MoE layers × 8 experts
    config = RuntimeConfig(
        device="cpu",
        cache_experts=16,
        policy="cpu_moe",
        miss_handling="copy",  # overridden: cpu_moe never copies a miss
        synchronous_prefetch=True,
        sampling=Sampling(greedy=True, max_new_tokens=6),
    )
    prompt = [{"role": "user", "content": "Tell me about the ocean and the waves."}]
    with Runtime.load(model, config) as runtime:
        assert runtime.info.miss_handling == "cpu"
        first = runtime.generate(prompt).stats
        second = runtime.generate(prompt).stats
        engine = runtime.engine
        resident = set(engine.cache.resident())
    assert resident == {(layer, e) for layer in (2, 3) for e in range(8)}
    assert first.bytes_moved == 16 * engine.host.expert_bytes and second.bytes_moved == 0
    for stats in (first, second):
        assert stats.misses == stats.on_host > 0
        hits = np.asarray(stats.layer_hits)
        misses = np.asarray(stats.layer_misses)
        assert hits[:2].sum() == 0 and misses[2:].sum() == 0  # layers 0, 1 on the CPU; 2, 3 on the device
