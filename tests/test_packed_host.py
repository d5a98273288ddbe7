"""Packed host stores: GPT-OSS's MXFP4 experts stay packed in RAM and in the slots, dequantised only where computed."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.host import SafetensorsFile
from fmoe_local.runtime import Runtime
from tests.test_loading import _mxfp4_gpt_oss

PROMPT = [{"role": "user", "content": "Tell me about the ocean and the waves."}]


def test_gpt_oss_mxfp4_stays_packed_in_host_ram_and_in_the_slots(tiny_model_dir, tmp_path):
    d = tmp_path / "mxfp4"
    dense = _mxfp4_gpt_oss(tiny_model_dir("gpt_oss"), d)
    checkpoint = SafetensorsFile(d / "model.safetensors")
    config = RuntimeConfig(device="cpu", cache_experts=2, sampling=Sampling(greedy=True, max_new_tokens=8))
    with Runtime.load(d, config) as runtime:
        host, cache = runtime.engine.host, runtime.engine.cache
        assert runtime.info.expert_format == "mxfp4"
        total = host.num_layers * host.num_experts
        assert host.ram_experts == total
        # RAM holds the checkpoint's packed bytes (4.25 bits per weight + fp32 biases), not dense weights.
        dense_bytes = sum(torch.Size(s).numel() * 4 for s in host.dense_shapes.values())
        assert host.ram_bytes() == total * host.expert_bytes
        assert host.expert_bytes < dense_bytes / 6
        for ref in runtime.engine.moe_layers:
            prefix = f"model.layers.{ref.layer_index}.mlp.experts."
            for e in range(host.num_experts):
                stored = host.read(ref.moe_index, e)
                assert stored["gate_up_proj.blocks"].dtype == torch.uint8
                assert torch.equal(stored["down_proj.blocks"], checkpoint.get_row(prefix + "down_proj_blocks", e))
                assert torch.equal(stored["down_proj.scales"], checkpoint.get_row(prefix + "down_proj_scales", e))
                # Dequantised where computed: transformers' own MXFP4 decoder's values, exactly.
                view = host.view(stored)
                assert torch.equal(view["gate_up_proj"], dense[prefix + "gate_up_proj"][e])
                assert torch.equal(view["down_proj"], dense[prefix + "down_proj"][e])
        assert cache.tensors["gate_up_proj.blocks"].dtype == torch.uint8
        assert cache.allocated_bytes() == 2 * host.expert_bytes
        ids = runtime.engine.encode_prompt(PROMPT)
        got = {}
        for misses in ("copy", "cpu"):
            runtime.reconfigure(miss_handling=misses)
            got[misses] = runtime.generate(PROMPT).token_ids
    checkpoint.close()
    # The reference: transformers eager with the experts transformers' decoder gives.
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("gpt_oss"), experts_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                getattr(layer.mlp.experts, name).copy_(dense[f"model.layers.{i}.mlp.experts.{name}"])
    expected = model.generate(ids, do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, ids.shape[1] :].tolist()
    for misses, tokens in got.items():
        assert tokens == expected[: len(tokens)], misses
