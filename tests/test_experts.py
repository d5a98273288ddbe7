"""experts.py computes every MoE layer bit for bit as transformers' `eager` experts loop does.

Both paths are exercised: the single-token (decode) path and the general one (several tokens, or more experts than
the cache has slots, which computes in chunks), with misses copied into slots or computed from the host copy. Inputs are random routings, so the check does not depend on what a
tiny model happens to route to.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fmoe_local.config import RuntimeConfig
from fmoe_local.engine import Engine
from tests.tiny import FAMILIES


def random_routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])  # [T, K]
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)  # [T, K]
    return index, weights


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("slots", [1, None])  # one slot: more experts than slots; None: every expert fits
@pytest.mark.parametrize("misses", ["copy", "cpu"])
def test_offloaded_experts_equal_eager_bitwise(family, slots, misses, tiny_model_dir):
    model_dir = tiny_model_dir(family)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32)
    config = RuntimeConfig(
        device="cpu", cache_experts=slots or 10**6, policy="lru", synchronous_prefetch=True, miss_handling=misses
    )
    engine = Engine.build(model_dir, config)
    try:
        shape = engine.shape
        accesses = 0
        with torch.inference_mode():
            for ref in engine.moe_layers:
                eager = plain.get_submodule(engine.arch.experts_prefix(ref.layer_index))
                for tokens in (1, 1, 5):
                    x = torch.randn(tokens, shape.embed_dim)
                    index, weights = random_routing(tokens, shape.num_experts, shape.top_k, seed=ref.moe_index)
                    expected = eager(x, index, weights)
                    accesses += len(set(index.view(-1).tolist()))
                    got = ref.experts(x, index, weights)
                    assert torch.equal(got, expected), f"{family} layer {ref.moe_index} T={tokens}"
        counters = engine.counters
        assert int(counters.hits.sum() + counters.misses.sum()) == accesses  # every expert use is accounted
        on_host = int(counters.on_host.sum())
        assert on_host == (int(counters.misses.sum()) if misses == "cpu" else 0) and counters.misses.sum() > 0
    finally:
        engine.close()
