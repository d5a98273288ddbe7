"""Lossless for quantised experts: with int8, int4 and nf4 the offloaded model generates exactly the greedy tokens of
transformers eager run on the same dequantised weights — for every family, fmoe and on_demand, a cache of K
experts and one of all of them, misses copied and computed on the CPU.

The reference replaces every routed expert row of a plain transformers model with `unpack(pack(row))`, the weights
the runtime computes with; the non-expert weights stay as they are: these tests load with dense_format bf16, the
experts alone (tests/test_dense_formats.py packs the dense layers too, as `auto` does on a CPU device).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from fmoe_local import expert_formats, hf_internals
from fmoe_local.architectures import architecture_for
from fmoe_local.attention import use_our_attention
from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.runtime import Runtime
from tests.tiny import FAMILIES

PROMPT = [{"role": "user", "content": "Tell me about the ocean and the waves."}]
NEW_TOKENS = 8


@torch.no_grad()
def dequantised_reference(model_dir, fmt: str, prompt_ids: torch.Tensor, n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32)
    model.eval()
    dequantise_experts(model, fmt)
    out = model.generate(prompt_ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return out[0, prompt_ids.shape[1] :].tolist()


@torch.no_grad()
def dequantise_experts(model: torch.nn.Module, fmt: str, dtype: torch.dtype = torch.float32) -> None:
    """Replace every routed expert row of `model` with `unpack(pack(row))` in `fmt`: the weights the runtime uses
    when it computes in `dtype` (int4's scales and zeros are stored in it)."""
    arch = architecture_for(model.config)
    for ref in arch.moe_layers(model):
        experts = ref.experts
        shapes = {name: tuple(getattr(experts, name).shape[1:]) for name in arch.expert_param_names}
        params = expert_formats.layout(fmt, shapes, hf_internals.is_transposed(experts))
        for name, param in params.items():
            weight = getattr(experts, name)
            for e in range(weight.shape[0]):
                stored = expert_formats.pack_expert({name: param}, {name: weight[e]}, dtype)
                weight[e] = expert_formats.PackedRows(stored, {name: param}, dtype)[name]


@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantised_greedy_tokens_equal_eager_on_the_dequantised_weights(family, fmt, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir(family)
    config = RuntimeConfig(
        device="cpu",
        cache_experts=1,
        expert_format=fmt,
        dense_format="bf16",
        quant_cache_dir=str(tmp_path),
        sampling=Sampling(greedy=True, max_new_tokens=NEW_TOKENS),
    )
    with Runtime.load(model_dir, config) as runtime:
        engine = runtime.engine
        assert runtime.info.expert_format == fmt
        # On a CPU device int8 and int4 are multiplied by torch's weight-only kernels, not dequantised; GPT-OSS's
        # [in, out] rows have no such product and dequantise.
        assert engine.host.products == (fmt in ("int8", "int4") and family != "gpt_oss")
        ids = engine.encode_prompt(PROMPT)
        expected = dequantised_reference(model_dir, fmt, ids, NEW_TOKENS)
        k, total = engine.shape.top_k, engine.shape.num_layers * engine.shape.num_experts
        for policy in ("fmoe", "on_demand"):
            for misses in ("copy", "cpu"):
                for slots in (k, total):
                    runtime.reconfigure(cache_experts=slots, policy=policy, miss_handling=misses)
                    final = runtime.generate(PROMPT)
                    got = final.token_ids
                    assert got == expected[: len(got)], f"{family} {fmt} {policy} {misses} cache={slots}"
                    assert len(got) == NEW_TOKENS or got[-1] in engine.eos_ids
                    if slots == k:  # the path under test really ran
                        assert (final.stats.on_host > 0) == (misses == "cpu")
                        assert final.stats.misses > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_blocks_on_a_cpu_device_give_eager_s_tokens_on_the_dequantised_weights(family, tiny_model_dir, tmp_path):
    """The probe's alternative for int8 in float32 (cpu_experts.INT8_BLOCKS_ON_CPU), forced through saved figures
    that name it, as a machine where it measured faster would load."""
    from dataclasses import replace

    from fmoe_local.cpu_experts import INT8_BLOCKS_ON_CPU

    model_dir = tiny_model_dir(family)
    config = RuntimeConfig(
        device="cpu",
        cache_experts=1,
        expert_format="int8",
        dense_format="bf16",
        miss_handling="cpu",
        policy="on_demand",
        quant_cache_dir=str(tmp_path),
        sampling=Sampling(greedy=True, max_new_tokens=NEW_TOKENS),
    )
    with Runtime.load(model_dir, config) as runtime:
        saved = replace(runtime.miss_costs, cpu_kernel=INT8_BLOCKS_ON_CPU.name)
    with Runtime.load(model_dir, config, miss_costs=saved) as runtime:
        engine = runtime.engine
        assert engine.offload.host_kernel is INT8_BLOCKS_ON_CPU
        expected = dequantised_reference(model_dir, "int8", engine.encode_prompt(PROMPT), NEW_TOKENS)
        final = runtime.generate(PROMPT)
        assert final.token_ids == expected[: len(final.token_ids)] and final.stats.on_host > 0


def test_quantised_output_differs_from_the_unquantised_model_but_only_slightly(tiny_model_dir, tmp_path):
    # Guards the reference above against comparing a model with itself: nf4 really changes the weights.
    model_dir = tiny_model_dir("mixtral")
    full = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32)
    config = RuntimeConfig(device="cpu", expert_format="nf4", quant_cache_dir=str(tmp_path))
    with Runtime.load(model_dir, config) as runtime:
        host = runtime.engine.host
        dense = host.view(host.read(0, 0))["gate_up_proj"]
        original = full.model.layers[0].mlp.experts.gate_up_proj[0]
        assert not torch.equal(dense, original)
        assert (dense - original).abs().max() < 0.25 * original.abs().max()


@torch.no_grad()
def assert_eager_s_tokens_in_bf16(model: torch.nn.Module, ids: torch.Tensor, got: list[int], what: str) -> None:
    """Each token of `got` is eager's greedy choice after the tokens before it, or within two bf16 steps of that
    choice's logit: a tie at bf16's precision, which the runtime's products (bf16 activations, float32 sums) and
    eager's bf16 products may break either way. Eager's logits come from one pass over the prompt and `got`."""
    logits = model(torch.cat([ids, torch.tensor([got], dtype=ids.dtype)], dim=1)).logits[0].float()
    for i, token in enumerate(got):
        row = logits[ids.shape[1] - 1 + i]
        best = row.max().item()
        step = 2.0 ** (math.floor(math.log2(max(abs(best), 2.0**-126))) - 7)  # bf16's spacing at the best logit
        assert row[token].item() >= best - 2 * step, (
            f"{what}: token {i} is {token}, {best - row[token].item():.4g} below eager's best"
        )


# GPT-OSS's [in, out] rows have no weight-only product (they dequantise, as before): not what this test is about.
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt_oss"])
def test_packed_experts_computed_in_bf16_give_eager_s_tokens_in_bf16(family, fmt, tiny_model_dir, tmp_path):
    """What `dtype` auto gives a bf16 model with int8/int4 experts on a CPU whose products are faster with bf16
    activations (dtype_verdicts.resolve_dtype): torch's products with bf16 activations, against eager in bf16 on the
    same dequantised weights — misses computed on the CPU and copied into slots."""
    model_dir = tiny_model_dir(family, dtype=torch.bfloat16)
    config = RuntimeConfig(
        device="cpu",
        dtype="bfloat16",
        cache_experts=1,
        expert_format=fmt,
        dense_format="bf16",
        quant_cache_dir=str(tmp_path),
        sampling=Sampling(greedy=True, max_new_tokens=NEW_TOKENS),
    )
    with Runtime.load(model_dir, config) as runtime:
        engine = runtime.engine
        assert engine.dtype == torch.bfloat16 and engine.host.products
        ids = engine.encode_prompt(PROMPT)
        with torch.no_grad():
            model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32)
            dequantise_experts(model.eval(), fmt, torch.bfloat16)
            model = model.to(torch.bfloat16)
            # The runtime's attention, so that only the experts differ: in bf16, DeepSeek's values on the flash kernel
            # (attention.py) and on transformers' math path round apart (tests/test_attention.py compares the two).
            use_our_attention(model)
        for policy, misses in (("on_demand", "cpu"), ("fmoe", "copy")):
            runtime.reconfigure(cache_experts=engine.shape.top_k, policy=policy, miss_handling=misses)
            final = runtime.generate(PROMPT)
            assert_eager_s_tokens_in_bf16(model, ids, final.token_ids, f"{family} {fmt} {policy} {misses}")
            assert len(final.token_ids) == NEW_TOKENS or final.token_ids[-1] in engine.eos_ids
            assert (final.stats.on_host > 0) == (misses == "cpu") and final.stats.misses > 0
