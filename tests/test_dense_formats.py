"""Dense formats: which linear layers are packed, the `auto` rule, the refusals, and lossless — with dense_format
int8 and int4 on a CPU device the offloaded model generates exactly the greedy tokens of transformers eager whose
dense linear weights AND routed experts are replaced by their dequantised values (`unpack(pack(w))`, the weights the
runtime's products compute with), for every family.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from fmoe_local import dense_formats, expert_formats
from fmoe_local.architectures import architecture_for
from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.dense_formats import PackedLinear
from fmoe_local.loading import load_model
from fmoe_local.runtime import Runtime
from tests.test_runtime_quantized import NEW_TOKENS, PROMPT, dequantise_experts
from tests.tiny import FAMILIES

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@torch.no_grad()
def dequantise_dense(model: nn.Module, fmt: str) -> list[str]:
    """Replace the weight of every linear layer a packed dense format packs with `unpack(pack(w))` in `fmt`; returns
    their names. A tied output head gets a weight of its own (the runtime packs a copy, the input table stays)."""
    arch = architecture_for(model.config)
    names = []
    for name, linear in dense_formats.candidates(model, arch, arch.moe_layers(model)).items():
        out_f, in_f = linear.weight.shape
        if not dense_formats.packs(fmt, out_f, in_f):
            continue
        param = expert_formats.PackedParam(fmt, (out_f, in_f))
        parts = expert_formats.pack(param, linear.weight, linear.weight.dtype)
        linear.weight = nn.Parameter(expert_formats.unpack(param, parts, linear.weight.dtype), requires_grad=False)
        names.append(name)
    return names


@torch.no_grad()
def reference_tokens(model_dir, fmt: str, ids: torch.Tensor, tied: bool = False) -> tuple[list[int], list[str]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32).eval()
    table = model.get_input_embeddings().weight.clone()
    dequantise_experts(model, fmt)
    names = dequantise_dense(model, fmt)
    if tied:  # the input table stays unpacked: only the head reads the dequantised copy
        assert torch.equal(model.get_input_embeddings().weight, table)
    out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return out[0, ids.shape[1] :].tolist(), names


def _config(fmt: str, tmp_path, **changes) -> RuntimeConfig:
    """A CPU load with experts and dense weights in `fmt` (`changes` override)."""
    config = RuntimeConfig(
        device="cpu",
        cache_experts=1,
        expert_format=fmt,
        dense_format=fmt,
        quant_cache_dir=str(tmp_path),
        sampling=Sampling(greedy=True, max_new_tokens=NEW_TOKENS),
    )
    return config.with_changes(**changes)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_dense_layers_give_eager_s_tokens_on_the_dequantised_weights(family, fmt, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir(family)
    with Runtime.load(model_dir, _config(fmt, tmp_path)) as runtime:
        engine = runtime.engine
        assert runtime.info.dense_format == fmt
        ids = engine.encode_prompt(PROMPT)
        expected, names = reference_tokens(model_dir, fmt, ids)
        packed = [n for n, m in engine.model.named_modules() if isinstance(m, PackedLinear)]
        assert packed == names and "lm_head" in packed  # the reference dequantised exactly what the runtime packs
        for policy, misses in (("on_demand", "cpu"), ("fmoe", "copy")):
            runtime.reconfigure(cache_experts=engine.shape.top_k, policy=policy, miss_handling=misses)
            final = runtime.generate(PROMPT)
            assert final.token_ids == expected[: len(final.token_ids)], f"{family} {fmt} {policy} {misses}"
            assert len(final.token_ids) == NEW_TOKENS or final.token_ids[-1] in engine.eos_ids


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_tied_head_is_packed_as_its_own_copy_and_the_input_table_stays(fmt, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("mixtral", tied=True)
    with Runtime.load(model_dir, _config(fmt, tmp_path)) as runtime:
        model = runtime.engine.model
        table = model.get_input_embeddings().weight
        assert isinstance(model.get_output_embeddings(), PackedLinear)
        assert table.dtype == torch.float32 and table.shape == (model.config.vocab_size, model.config.hidden_size)
        expected, _ = reference_tokens(model_dir, fmt, runtime.engine.encode_prompt(PROMPT), tied=True)
        runtime.reconfigure(cache_experts=runtime.engine.shape.top_k, policy="on_demand", miss_handling="cpu")
        final = runtime.generate(PROMPT)
        assert final.token_ids == expected[: len(final.token_ids)]


def test_routers_gates_embeddings_and_norms_stay_and_the_rest_is_packed(tiny_model_dir, tmp_path):
    # Qwen2-MoE has them all: attention with biases, a shared expert and its one-logit gate, a router, an untied head.
    loaded = load_model(tiny_model_dir("qwen2_moe"), _config("int8", tmp_path), CPU)
    model = loaded.model
    assert loaded.dense_format == "int8"
    block = model.model.layers[0].mlp
    for module in (block.gate, block.shared_expert_gate, model.model.embed_tokens, model.model.norm):
        assert not isinstance(module, PackedLinear)
    attn = model.model.layers[0].self_attn
    for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, block.shared_expert.down_proj, model.lm_head):
        assert isinstance(module, PackedLinear) and module.q.dtype == torch.int8
    assert attn.q_proj.bias is not None  # Qwen2's attention biases are kept, in the compute dtype


def test_int4_leaves_a_weight_its_product_cannot_take_unpacked(tiny_model_dir, tmp_path):
    # Qwen2-MoE's tiny shared expert: down_proj is [64, 48], and 48 is no multiple of the 32-weight group.
    loaded = load_model(tiny_model_dir("qwen2_moe"), _config("int4", tmp_path), CPU)
    shared = loaded.model.model.layers[0].mlp.shared_expert
    assert isinstance(shared.gate_proj, PackedLinear) and type(shared.down_proj) is nn.Linear


def test_packed_dense_weights_count_at_their_stored_size(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("olmoe")
    sizes = {}
    for fmt in ("bf16", "int8", "int4"):
        with Runtime.load(model_dir, _config("bf16", tmp_path, dense_format=fmt)) as runtime:
            sizes[fmt] = runtime.info.resident_bytes
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    linears = [m.weight for n, m in plain.named_modules() if type(m) is nn.Linear]  # OLMoE's router is no nn.Linear
    dense = sum(w.numel() * 4 for w in linears)
    int8 = sum(w.numel() + 4 * w.shape[0] for w in linears)  # int8 codes and a float32 scale per row
    int4 = sum(
        w.numel() // 2 + (w.shape[1] // 64) * w.shape[0] * 2 * 4 for w in linears
    )  # codes, float32 (scale, zero)
    assert sizes["int8"] == sizes["bf16"] - dense + int8
    assert sizes["int4"] == sizes["bf16"] - dense + int4


def test_auto_follows_int8_and_int4_experts_on_a_cpu_only():
    for fmt in ("int8", "int4"):
        assert dense_formats.resolve("auto", CPU, fmt) == fmt
        assert dense_formats.resolve("auto", CUDA, fmt) == "bf16"
    for fmt in ("bf16", "nf4", "mxfp4"):
        assert dense_formats.resolve("auto", CPU, fmt) == "bf16"
    assert dense_formats.resolve("bf16", CPU, "int8") == "bf16"
    assert dense_formats.resolve("int4", CPU, "bf16") == "int4"


def test_auto_packs_the_dense_layers_of_a_cpu_load_with_int8_experts(tiny_model_dir, tmp_path):
    config = _config("int8", tmp_path, dense_format="auto")
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        assert runtime.info.dense_format == "int8"
        assert isinstance(runtime.engine.model.lm_head, PackedLinear)
    with Runtime.load(tiny_model_dir("mixtral"), _config("bf16", tmp_path, dense_format="auto")) as runtime:
        assert runtime.info.dense_format == "bf16" and type(runtime.engine.model.lm_head) is nn.Linear


def test_an_unknown_dense_format_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="Unknown dense format 'q3'") as caught:
        RuntimeConfig(dense_format="q3").validate()
    assert all(word in str(caught.value) for word in ("auto", "bf16", "int8", "int4"))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_packed_dense_format_on_a_gpu_is_refused_before_any_weight_is_read(fmt, tiny_model_dir, tmp_path):
    # torch.device("cuda") needs no GPU to exist: the refusal comes before anything is put on it.
    with pytest.raises(ValueError, match=f"Dense format {fmt} runs on a CPU device only") as caught:
        load_model(tiny_model_dir("mixtral"), _config(fmt, tmp_path), CUDA)
    assert "auto or bf16" in str(caught.value)


def test_a_weight_the_model_keeps_in_float32_is_left_as_it_is(tiny_model_dir, tmp_path):
    # None of the families keeps a linear layer in float32 today; the rule is transformers' (hf_internals.keep_in_fp32).
    loaded = load_model(tiny_model_dir("olmoe"), _config("int8", tmp_path, dense_format="bf16"), CPU)
    model = loaded.model
    report = dense_formats.quantise(model, loaded.arch, loaded.moe_layers, "int8", lambda n: n == "lm_head.weight")
    assert type(model.lm_head) is nn.Linear and report.kept == {"lm_head": "kept in float32 by the model"}
    assert isinstance(model.model.layers[0].self_attn.q_proj, PackedLinear) and "lm_head" not in report.packed
