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


@pytest.mark.parametrize("shape", [(64, 128), (48, 96), (4096, 1024)])
def test_int4_cuda_product_computes_the_dequantised_weights(shape):
    # A cache hit in int4 with bf16 activations goes through torch's CUDA int4 product on the slot's portable bytes;
    # it must compute the weights every other path dequantises (bf16 products: rounding apart).
    from fmoe_local import expert_formats as ef

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, shape[1], generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    param = ef.layout("int4", {"w": shape})["w"]
    stored = {f"w.{k}": v.cuda() for k, v in ef.pack(param, w, torch.bfloat16).items()}
    dense = ef.unpack(param, {k[2:]: v for k, v in stored.items()}, torch.bfloat16)
    ef.to_cuda_layout({"w": param}, stored, torch.bfloat16)  # what the copier's landing does to a slot
    weight = ef.PackedRows(stored, {"w": param}, torch.bfloat16)["w"]
    assert isinstance(weight, ef.Int4CudaWeight)
    expected = torch.nn.functional.linear(x.float(), dense.float())
    got = weight.linear(x, None)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert (got.float() - expected).abs().max() <= 0.02 * expected.abs().max()


def test_int4_experts_on_the_gpu_use_the_cuda_product_and_decode(tiny_model_dir, tmp_path):
    from fmoe_local import expert_formats as ef
    from fmoe_local.offload import SlotRows

    config = RuntimeConfig(
        device="cuda", dtype="bfloat16", cache_experts=3, policy="lru", miss_handling="copy", expert_format="int4",
        quant_cache_dir=str(tmp_path / "q"), sampling=Sampling(greedy=True, max_new_tokens=12),
    )  # fmt: skip
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        final = runtime.generate([{"role": "user", "content": "Tell me about the ocean."}])
        engine = runtime.engine
        key = engine.cache._slots.key_of(0)
        slot = engine.host.view(SlotRows(engine.cache.tensors, 0))
        ram = engine.host.view(engine.host.read(*key))  # the portable bytes the copy started from
        products = {}
        for name in slot:
            if isinstance(slot[name], ef.Int4CudaWeight):
                x = torch.randn(2, slot[name].q.shape[1] * 2, device="cuda", dtype=torch.bfloat16)
                products[name] = (slot[name].linear(x, None).float(), torch.nn.functional.linear(x, ram[name].cuda()))
    assert final.reason != "error" and len(final.token_ids) == 12 and final.stats.misses > 0
    assert products  # the slot's int4 rows are multiplied by torch's CUDA product...
    for got, expected in products.values():  # ...on the layout the copy's landing made of this very expert
        assert (got - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()
