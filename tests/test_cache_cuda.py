"""The CUDA path of the cache: copies on a dedicated stream with events, pinned staging, same tokens as eager.

Skipped without a CUDA GPU; run it wherever one is available (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.runtime import Runtime

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("policy", ["fmoe", "lru", "speculative"])
def test_cuda_copy_stream_is_lossless_and_within_budget(family, policy, tiny_model_dir):
    model_dir = tiny_model_dir(family)
    config = RuntimeConfig(
        device="cuda",
        dtype="float32",
        cache_experts=3,
        policy=policy,
        sampling=Sampling(greedy=True, max_new_tokens=12),
    )
    with Runtime.load(model_dir, config) as runtime:
        engine = runtime.engine
        assert engine.cache._copier.cuda  # copies go on copy streams of their own
        prompt = [{"role": "user", "content": "Tell me about the ocean."}]
        ids = engine.encode_prompt(prompt)
        before = torch.cuda.memory_allocated()
        final = runtime.generate(prompt)
        # Nothing but activations and the KV cache grows: expert weights stay inside the preallocated slots.
        assert engine.cache.allocated_bytes() == 3 * engine.host.expert_bytes
        assert torch.cuda.memory_allocated() - before < 64 * 1024**2
    ref = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32).cuda()
    out = ref.generate(ids, do_sample=False, max_new_tokens=12, min_new_tokens=12)
    expected = out[0, ids.shape[1] :].tolist()
    assert final.token_ids == expected[: len(final.token_ids)]
    assert final.stats.misses > 0 and final.stats.bytes_moved > 0


@pytest.mark.parametrize("pinned_ram_gb", [None, 0.0])
def test_pinned_host_experts_are_copied_straight_and_give_the_same_tokens(pinned_ram_gb, tiny_model_dir):
    config = RuntimeConfig(
        device="cuda", dtype="float32", cache_experts=3, policy="lru", miss_handling="copy",
        pinned_ram_gb=pinned_ram_gb, sampling=Sampling(greedy=True, max_new_tokens=12),
    )  # fmt: skip
    prompt = [{"role": "user", "content": "Tell me about the ocean."}]
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        host = runtime.engine.host
        first = host.read(0, 0)
        assert all(t.is_pinned() for t in first.values()) == (pinned_ram_gb is None)
        assert runtime.engine.offload.pinned_bytes == host.pinned_bytes
        tokens = runtime.generate(prompt).token_ids
    with Runtime.load(tiny_model_dir("mixtral"), config.with_changes(pinned_ram_gb=0.0)) as runtime:
        assert runtime.generate(prompt).token_ids == tokens
