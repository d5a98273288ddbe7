"""Architecture facts checked against the real transformers modules of each tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2MoeConfig

from fmoe_local.architectures import SUPPORTED, ConcatRows, FusedRow, Mxfp4Row, architecture_for
from tests.tiny import FAMILIES, NUM_EXPERTS, TOP_K

EXPECTED_MOE_LAYERS = {
    "mixtral": [0, 1, 2, 3],
    "qwen2_moe": [0, 1, 2],
    "qwen3_moe": [0, 2, 3],  # mlp_only_layers=[1]
    "olmoe": [0, 1, 2],
    "phimoe": [0, 1, 2],
    "deepseek_v2": [1, 2],  # first_k_dense_replace=1
    "deepseek_v3": [1, 2],
    "gpt_oss": [0, 1],
}


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = AutoModelForCausalLM.from_pretrained(tiny_model_dir(family), experts_implementation="eager")
        return cache[family]

    return get


def test_supported_families_cover_the_brief():
    assert set(SUPPORTED) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_layers_point_at_the_modules_the_model_uses(reference, family):
    model = reference(family)
    arch = architecture_for(model.config)
    assert arch.num_experts(model.config) == NUM_EXPERTS
    assert arch.top_k(model.config) == TOP_K
    refs = arch.moe_layers(model)
    assert [r.layer_index for r in refs] == EXPECTED_MOE_LAYERS[family]
    assert [r.moe_index for r in refs] == list(range(len(refs)))
    for ref in refs:
        layer = model.model.layers[ref.layer_index]
        assert ref.block is layer.mlp
        assert ref.experts is layer.mlp.experts and ref.router.weight.shape == (NUM_EXPERTS, 64)
        for name in arch.expert_param_names:
            assert getattr(ref.experts, name).shape[0] == NUM_EXPERTS
    # The dense layers really are dense: no experts module there.
    dense = set(range(model.config.num_hidden_layers)) - set(EXPECTED_MOE_LAYERS[family])
    assert all(not hasattr(model.model.layers[i].mlp, "experts") for i in dense)


@pytest.mark.parametrize("family", FAMILIES)
def test_gates_are_every_module_whose_output_weighs_experts(reference, family):
    # What a packed dense format must never pack: every nn.Linear of a MoE block that yields one logit per expert
    # (the router) or per shared expert (Qwen2-MoE's shared_expert_gate) is in `gates`, and nothing else is.
    model = reference(family)
    arch = architecture_for(model.config)
    for ref in arch.moe_layers(model):
        gates = arch.gates(ref)
        assert gates[0] is ref.router
        shared = getattr(ref.block, "shared_expert_gate", None)
        assert gates[1:] == ([shared] if shared is not None else [])
        assert all(g.weight.shape[0] in (NUM_EXPERTS, 1) for g in gates)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_probs_are_a_distribution_consistent_with_the_routers_choice(reference, family):
    model = reference(family)
    arch = architecture_for(model.config)
    refs = arch.moe_layers(model)
    outputs = {}
    handles = [r.router.register_forward_hook(lambda m, i, o, k=r.moe_index: outputs.__setitem__(k, o)) for r in refs]
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    for k, out in outputs.items():
        probs = arch.router_probs(out)
        assert probs.shape == (12, NUM_EXPERTS) and probs.dtype == torch.float32
        torch.testing.assert_close(probs.sum(-1), torch.ones(12))
        assert (probs >= 0).all()
        chosen = out[2].reshape(12, -1)  # the router's own top-k indices
        if family == "deepseek_v3":
            # Selection is group-limited and bias-corrected, but the weights are the chosen normalised sigmoids.
            picked = probs.gather(1, chosen)
            expected = picked / picked.sum(-1, keepdim=True) * model.config.routed_scaling_factor
            torch.testing.assert_close(out[1].reshape(12, -1), expected)
        elif family == "phimoe":
            # Sparsemixer: the first choice is the most probable expert, the second is picked among the rest.
            assert torch.equal(chosen[:, 0], probs.argmax(-1)), f"layer {k}"
        else:
            top = probs.topk(chosen.shape[1], dim=-1).indices
            assert torch.equal(top.sort(-1).values, chosen.sort(-1).values), f"layer {k}"
        # Routing is not degenerate in the tiny models: tokens disagree on their favourite expert.
        assert probs.argmax(-1).unique().numel() > 1


def test_deepseek_v3_probs_are_normalised_sigmoids():
    arch = architecture_for(AutoConfig.for_model("deepseek_v3", n_routed_experts=4, first_k_dense_replace=0))
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    expected = torch.sigmoid(logits) / torch.sigmoid(logits).sum()
    torch.testing.assert_close(arch.router_probs((logits, None, None)), expected)
    # A softmax family on the same logits gives a different distribution.
    mixtral = architecture_for(AutoConfig.for_model("mixtral"))
    torch.testing.assert_close(mixtral.router_probs(logits), torch.softmax(logits, -1))


def test_qwen_sparse_step_and_mlp_only_layers():
    cfg = Qwen2MoeConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], num_experts=4)
    assert architecture_for(cfg).moe_layer_indices(cfg) == [1, 5]


def test_expert_sources_follow_the_checkpoint_layout():
    mixtral = architecture_for(AutoConfig.for_model("mixtral"))
    per_expert = {f"model.layers.2.block_sparse_moe.experts.5.{w}.weight" for w in ("w1", "w2", "w3")}
    src = mixtral.expert_sources(2, 5, per_expert)
    assert src["gate_up_proj"] == ConcatRows(
        ("model.layers.2.block_sparse_moe.experts.5.w1.weight", "model.layers.2.block_sparse_moe.experts.5.w3.weight")
    )
    assert src["down_proj"] == ConcatRows(("model.layers.2.block_sparse_moe.experts.5.w2.weight",))
    fused = {"model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"}
    assert mixtral.expert_sources(2, 5, fused)["down_proj"] == FusedRow("model.layers.2.mlp.experts.down_proj", 5)

    gpt = architecture_for(AutoConfig.for_model("gpt_oss"))
    prefix = "model.layers.0.mlp.experts."
    keys = {prefix + k for k in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias")}
    keys |= {prefix + k for k in ("down_proj_blocks", "down_proj_scales", "down_proj_bias")}
    src = gpt.expert_sources(0, 3, keys)
    assert src["gate_up_proj"] == Mxfp4Row(prefix + "gate_up_proj_blocks", prefix + "gate_up_proj_scales", 3)
    assert src["down_proj_bias"] == FusedRow(prefix + "down_proj_bias", 3)
    with pytest.raises(ValueError, match="download the model again"):
        gpt.expert_sources(0, 3, {prefix + "gate_up_proj"})


def test_dense_model_is_refused_with_a_sentence_naming_the_families():
    with pytest.raises(ValueError, match="not a Mixture-of-Experts") as err:
        architecture_for(LlamaConfig())
    assert "mixtral" in str(err.value) and "deepseek_v3" in str(err.value)
    with pytest.raises(ValueError, match="has no MoE layers"):
        architecture_for(Qwen2MoeConfig(num_experts=0))


def test_unknown_moe_family_is_refused():
    cfg = AutoConfig.for_model("jamba")
    with pytest.raises(ValueError, match="not supported yet"):
        architecture_for(cfg)
