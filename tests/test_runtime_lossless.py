"""Lossless: the offloaded model generates exactly the greedy tokens of plain transformers (`eager` experts).

For every architecture, every policy and cache sizes {K, 3K, all}, switching policy, size and miss handling with
reconfigure() (so reconfiguration is exercised too), with the real background prefetcher: every policy copying its
misses, and fmoe and on_demand computing them on the CPU (`cpu`, and `auto`, which is `cpu` without a GPU);
cpu_moe always computes them on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fmoe_local.config import POLICIES, RuntimeConfig, Sampling
from fmoe_local.demo import demo_model_dir
from fmoe_local.runtime import Runtime
from tests.tiny import FAMILIES

PROMPTS = [
    [{"role": "user", "content": "Tell me about the ocean and the waves."}],
    [{"role": "user", "content": "def add(a, b): return a + b"}],
]
NEW_TOKENS = 10
# (policy, miss handling): every policy copying, the CPU path under the default policy and the no-prediction one.
RUNS = (
    [(p, "copy") for p in POLICIES if p != "cpu_moe"]
    + [(p, m) for p in ("fmoe", "on_demand") for m in ("cpu", "auto")]
    + [("cpu_moe", "auto")]
)


def eager_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32).eval()


def reference_tokens(model, prompt_ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(prompt_ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return out[0, prompt_ids.shape[1] :].tolist()


@pytest.mark.parametrize("family", [*FAMILIES, "demo"])
def test_greedy_tokens_equal_eager_for_every_policy_and_cache_size(family, tiny_model_dir):
    model_dir = demo_model_dir() if family == "demo" else tiny_model_dir(family)
    config = RuntimeConfig(device="cpu", cache_experts=1, sampling=Sampling(greedy=True, max_new_tokens=NEW_TOKENS))
    with Runtime.load(model_dir, config) as runtime:
        engine = runtime.engine
        # EOS would end one side early; the reference is forced to the same length, so ban nothing and compare
        # up to the first EOS of ours.
        k, total = engine.shape.top_k, engine.shape.num_layers * engine.shape.num_experts
        reference = eager_model(model_dir)  # loaded once: generate() keeps no state between prompts
        for prompt in PROMPTS:
            ids = engine.encode_prompt(prompt)
            expected = reference_tokens(reference, ids, NEW_TOKENS)
            for policy, misses in RUNS:
                # Every expert resident: no miss, so the policy and the miss handling decide nothing; once is enough.
                for slots in (k, 3 * k, total) if (policy, misses) == RUNS[0] else (k, 3 * k):
                    runtime.reconfigure(cache_experts=slots, policy=policy, miss_handling=misses)
                    final = runtime.generate(prompt)
                    got = final.token_ids
                    assert got == expected[: len(got)], f"{family} {policy} {misses} cache={slots}"
                    assert len(got) == NEW_TOKENS or got[-1] in engine.eos_ids
                    on_host = runtime.info.miss_handling == "cpu" or misses != "copy"
                    if slots == k:  # the CPU path really ran (or really did not)
                        assert (final.stats.on_host > 0) == on_host, f"{family} {policy} {misses}"


def test_cache_never_exceeds_budget_after_any_layer(tiny_model_dir):
    model_dir = tiny_model_dir("mixtral")
    config = RuntimeConfig(device="cpu", cache_experts=3, sampling=Sampling(greedy=True, max_new_tokens=6))
    with Runtime.load(model_dir, config) as runtime:
        engine = runtime.engine
        seen = []

        def check(module, inputs, output):
            cache = engine.cache
            seen.append(cache.resident_bytes())
            assert cache.resident_bytes() <= cache.budget_bytes
            assert cache.allocated_bytes() <= 3 * engine.host.expert_bytes

        handles = [ref.block.register_forward_hook(check) for ref in engine.moe_layers]
        try:
            # The prompt's prefill needs every expert of a layer: more than the 3 slots, so it runs in chunks.
            runtime.generate([{"role": "user", "content": "A long prompt about many different topics " * 4}])
        finally:
            for h in handles:
                h.remove()
        assert len(seen) >= 6 * engine.shape.num_layers
        # Expert weights never live anywhere on the device but in the slots: the fused parameters stay on meta.
        for ref in engine.moe_layers:
            assert all(p.device.type == "meta" for p in ref.experts.parameters())


def test_stop_ends_generation_within_a_token(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3_moe")
    config = RuntimeConfig(device="cpu", cache_experts=4, sampling=Sampling(greedy=True, max_new_tokens=5000))
    with Runtime.load(model_dir, config) as runtime:
        request = runtime.submit([{"role": "user", "content": "Keep talking."}])
        deltas = 0
        for _event in request:
            deltas += 1
            if deltas == 5:
                request.cancel()
                break
        assert request.result(timeout=30).stats.tokens <= 6  # within a token of the cancel
        # The next request runs normally afterwards.
        final = runtime.generate([{"role": "user", "content": "Hello"}], Sampling(greedy=True, max_new_tokens=3))
        assert final.reason in ("length", "stop", "context") and final.stats.tokens <= 3


def test_stop_reports_cancelled_and_no_forward_pass_starts_after_it(tiny_model_dir):
    model_dir = tiny_model_dir("olmoe")
    config = RuntimeConfig(device="cpu", cache_experts=4, sampling=Sampling(greedy=True, max_new_tokens=5000))
    with Runtime.load(model_dir, config) as runtime:
        stopped = []
        started_after_stop = []
        embedding = runtime.engine.model.get_input_embeddings()
        handle = embedding.register_forward_hook(lambda *a: started_after_stop.append(1) if stopped else None)
        final = None
        try:
            request = runtime.submit([{"role": "user", "content": "Keep talking."}])
            for event in request:
                if hasattr(event, "token_id") and not stopped:
                    stopped.append(1)
                    request.cancel()
                final = event
        finally:
            handle.remove()
        assert final.reason == "cancelled"
        # Within one token: a forward pass that was already starting may run, no other.
        assert len(started_after_stop) <= 1
        assert final.stats.tokens < 5000


def test_reconfigure_changes_cache_and_residency_stays_in_budget(tiny_model_dir):
    model_dir = tiny_model_dir("deepseek_v2")
    config = RuntimeConfig(device="cpu", cache_experts=12, sampling=Sampling(greedy=True, max_new_tokens=4))
    with Runtime.load(model_dir, config) as runtime:
        runtime.generate([{"role": "user", "content": "Warm the cache up with something."}])
        assert runtime.engine.cache.capacity == 12
        new = runtime.reconfigure(cache_experts=2, prefetch_distance=1)
        assert new.cache_experts == 2 and new.prefetch_distance == 1
        final = runtime.generate([{"role": "user", "content": "And now with a small cache."}])
        cache = runtime.engine.cache
        assert cache.capacity == 2 and cache.resident_bytes() <= 2 * runtime.engine.host.expert_bytes
        assert final.stats.misses > 0
        assert runtime.info.cache_experts == 2


def test_reset_cache_makes_the_next_request_start_cold(tiny_model_dir):
    # A cache with room for every expert and no prefetching: a repeated prompt hits everything it loaded the first
    # time, until reset_cache() empties the cache and the same loads happen again.
    model_dir = tiny_model_dir("mixtral")
    config = RuntimeConfig(
        device="cpu", policy="on_demand", miss_handling="copy", sampling=Sampling(greedy=True, max_new_tokens=4)
    )
    prompt = [{"role": "user", "content": "Warm the cache up with something."}]
    with Runtime.load(model_dir, config) as runtime:
        shape = runtime.engine.shape
        runtime.reconfigure(cache_experts=shape.num_layers * shape.num_experts)
        first = runtime.generate(prompt).stats
        again = runtime.generate(prompt).stats
        runtime.reset_cache()
        assert runtime.engine.cache.resident() == []
        cold = runtime.generate(prompt).stats
    assert first.misses > 0 and again.misses == 0
    assert cold.misses == first.misses and cold.layer_misses == first.layer_misses


def test_clear_maps_waits_for_the_running_request_then_forgets_every_map(tiny_model_dir):
    # Clearing under a running request would pull the store from under the matcher's searches; it waits instead,
    # so the maps the request stored are forgotten too, and the next request learns afresh.
    import threading

    config = RuntimeConfig(device="cpu", cache_experts=4, sampling=Sampling(greedy=True, max_new_tokens=12))
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        store = runtime.engine.map_store
        stream = iter(runtime.submit([{"role": "user", "content": "Tell me about the ocean and the waves."}]))
        next(stream)  # the request is running
        clearing = threading.Thread(target=runtime.clear_maps)
        clearing.start()
        final = list(stream)[-1]
        clearing.join(timeout=30)
        assert not clearing.is_alive() and final.reason in ("length", "stop", "context")
        assert len(store) == 0
        runtime.generate([{"role": "user", "content": "Something new."}])
        assert len(store) > 0


def test_invalid_reconfigure_is_explained(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), RuntimeConfig(device="cpu", cache_experts=2)) as runtime:
        with pytest.raises(ValueError, match="Prefetch distance"):
            runtime.reconfigure(prefetch_distance=0)
        with pytest.raises(ValueError, match="Unknown policy"):
            runtime.reconfigure(policy="psychic")


def test_no_thread_left_after_close(tiny_model_dir):
    import threading

    before = {t.name for t in threading.enumerate()}
    runtime = Runtime.load(tiny_model_dir("mixtral"), RuntimeConfig(device="cpu", cache_experts=4))
    runtime.generate([{"role": "user", "content": "Hi"}], Sampling(greedy=True, max_new_tokens=3))
    assert any(t.name.startswith("fmoe-") for t in threading.enumerate())
    runtime.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("fmoe-") and t.name not in before]
    assert left == []


def test_stats_are_consistent(tiny_model_dir):
    config = RuntimeConfig(device="cpu", cache_experts=3, sampling=Sampling(greedy=True, max_new_tokens=5))
    with Runtime.load(tiny_model_dir("qwen2_moe"), config) as runtime:
        final = runtime.generate([{"role": "user", "content": "Count the stars."}])
        s = final.stats
        assert s.tokens == len(final.token_ids) - (1 if final.reason == "stop" else 0)
        assert s.hits + s.misses == sum(map(sum, s.layer_hits)) + sum(map(sum, s.layer_misses))
        assert s.misses > 0 and s.bytes_moved >= (s.misses - s.on_host) * runtime.engine.host.expert_bytes
        assert 0.0 <= s.hit_rate <= 1.0 and s.ttft_s > 0
        assert len(s.per_layer_hit_rate) == runtime.engine.shape.num_layers
