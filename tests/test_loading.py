"""load_model against transformers' own from_pretrained (eager experts) on every tiny family."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from fmoe_local.config import RuntimeConfig
from fmoe_local.loading import load_model
from tests.tiny import FAMILIES


def _reference(model_dir, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=dtype)


def _assert_matches_reference(loaded, ref):
    """Non-expert tensors equal (values and dtypes), experts on meta, host rows equal the fused rows."""
    mine = loaded.model.state_dict()
    expert_names = {f"model.layers.{r.layer_index}.mlp.experts." for r in loaded.moe_layers}
    for name, expected in ref.state_dict().items():
        got = mine[name]
        if name.startswith(tuple(expert_names)):
            assert got.device.type == "meta", name
            continue
        assert got.dtype == expected.dtype, name
        assert torch.equal(got, expected), name
    for name, expected in ref.named_buffers():
        got = dict(loaded.model.named_buffers())[name]
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
    for r in loaded.moe_layers:
        experts = ref.model.layers[r.layer_index].mlp.experts
        for e in range(loaded.host.num_experts):
            rows = loaded.host.read(r.moe_index, e)
            assert rows.keys() == set(loaded.arch.expert_param_names)
            for name, row in rows.items():
                assert torch.equal(row, getattr(experts, name)[e]), (r.moe_index, e, name)


def _materialise_experts(loaded):
    """Fill the meta experts parameters from the host store (what the runtime's cache does slot by slot)."""
    for r in loaded.moe_layers:
        rows = [loaded.host.read(r.moe_index, e) for e in range(loaded.host.num_experts)]
        fused = {name: torch.stack([row[name] for row in rows]) for name in rows[0]}
        r.experts.load_state_dict(fused, assign=True)
    loaded.model.set_experts_implementation("eager")


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_model_equals_from_pretrained(tiny_model_dir, family):
    d = tiny_model_dir(family)
    loaded = load_model(d, RuntimeConfig(), "cpu", None)
    ref = _reference(d)
    assert loaded.dtype == torch.float32 and loaded.unexpected_keys == []
    assert loaded.arch.model_type == family
    _assert_matches_reference(loaded, ref)
    # With the experts filled in from the host store, the model computes exactly what transformers computes.
    _materialise_experts(loaded)
    ids = torch.randint(0, ref.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, ref(ids).logits)
    loaded.host.close()


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_sharded_checkpoints(tiny_model_dir, family):
    d = tiny_model_dir(family, sharded=True, dtype=torch.bfloat16)
    assert (d / "model.safetensors.index.json").exists()
    loaded = load_model(d, RuntimeConfig(), "cpu", None)
    assert loaded.dtype == torch.bfloat16  # None keeps the checkpoint's dtype
    _assert_matches_reference(loaded, _reference(d, torch.bfloat16))


@pytest.mark.parametrize(
    ("family", "dtype", "kept_fp32"),
    [
        ("deepseek_v3", torch.bfloat16, "model.layers.1.mlp.gate.e_score_correction_bias"),  # strict keep-in-fp32
        ("gpt_oss", torch.float16, "model.norm.weight"),  # keep-in-fp32 applies to fp16 only
    ],
)
def test_compute_dtype_follows_transformers_keep_in_fp32_rules(tiny_model_dir, family, dtype, kept_fp32):
    d = tiny_model_dir(family)
    loaded = load_model(d, RuntimeConfig(), "cpu", dtype)
    ref = _reference(d, dtype)
    assert loaded.model.state_dict()[kept_fp32].dtype == torch.float32
    assert loaded.model.model.embed_tokens.weight.dtype == dtype
    _assert_matches_reference(loaded, ref)
    assert all(t.dtype == dtype for t in loaded.host.read(0, 0).values())


def test_tied_word_embeddings(tiny_model_dir):
    d = tiny_model_dir("qwen3_moe", tied=True)
    loaded = load_model(d, RuntimeConfig(), "cpu", None)
    model = loaded.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _assert_matches_reference(loaded, _reference(d))


def test_disk_tier_through_load_model(tiny_model_dir):
    d = tiny_model_dir("deepseek_v2", sharded=True)
    loaded = load_model(d, RuntimeConfig(host_ram_gb=0.0), "cpu", None)
    assert loaded.host.ram_experts == 0
    _assert_matches_reference(loaded, _reference(d))


def test_tokenizer_and_layers_are_ready_to_use(tiny_model_dir):
    loaded = load_model(tiny_model_dir("olmoe"), RuntimeConfig(), "cpu", None)
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == f"{tok.bos_token}<|user|>\nHi{tok.eos_token}\n<|assistant|>\n"
    assert tok.eos_token_id == loaded.model.config.eos_token_id
    assert [r.moe_index for r in loaded.moe_layers] == [0, 1, 2]
    assert loaded.host.num_layers == len(loaded.moe_layers)
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_generation_config_is_read_from_the_checkpoint(tiny_model_dir, tmp_path):
    d = tmp_path / "stops"
    shutil.copytree(tiny_model_dir("phimoe"), d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 5]  # an end-of-turn token besides eos, as chat models ship
    (d / "generation_config.json").write_text(json.dumps(gen))
    loaded = load_model(d, RuntimeConfig(), "cpu", None)
    assert loaded.model.generation_config.eos_token_id == [2, 5]


def _mxfp4_gpt_oss(src, dst):
    """Rewrite a tiny GPT-OSS checkpoint with MXFP4-packed experts, as the official release ships them."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    dense = {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, in_dim, out_dim = tensors.pop(key).shape  # [E, in, out]
        blocks = torch.randint(0, 256, (e, out_dim, in_dim // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(122, 128, (e, out_dim, in_dim // 32), dtype=torch.uint8, generator=gen)
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        dense[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transformers' own decoder
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dense


def test_gpt_oss_mxfp4_experts_are_dequantised(tiny_model_dir, tmp_path):
    d = tmp_path / "mxfp4"
    dense = _mxfp4_gpt_oss(tiny_model_dir("gpt_oss"), d)
    # bf16 asks for dense experts (auto keeps them packed: tests/test_packed_host.py).
    loaded = load_model(d, RuntimeConfig(host_ram_gb=0.0, expert_format="bf16"), "cpu", torch.float32)
    for r in loaded.moe_layers:
        prefix = f"model.layers.{r.layer_index}.mlp.experts."
        for e in range(loaded.host.num_experts):
            rows = loaded.host.read(r.moe_index, e)
            assert torch.equal(rows["gate_up_proj"], dense[prefix + "gate_up_proj"][e])
            assert torch.equal(rows["down_proj"], dense[prefix + "down_proj"][e])
    assert loaded.host.param_shapes["gate_up_proj"] == (64, 64)


def test_dense_model_is_refused(tmp_path):
    LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=300).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        load_model(tmp_path, RuntimeConfig(), "cpu", None)


def test_other_quantizations_are_refused(tiny_model_dir, tmp_path):
    d = tmp_path / "awq"
    shutil.copytree(tiny_model_dir("mixtral"), d)
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized \\(awq\\).*bf16"):
        load_model(d, RuntimeConfig(), "cpu", None)


def test_incomplete_checkpoint_is_explained(tiny_model_dir, tmp_path):
    d = tmp_path / "broken"
    shutil.copytree(tiny_model_dir("olmoe"), d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 weights.*q_proj.*download the model again"):
        load_model(d, RuntimeConfig(), "cpu", None)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, RuntimeConfig(), "cpu", None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_resident_weights_go_straight_to_the_gpu(tiny_model_dir, family):
    d = tiny_model_dir(family, dtype=torch.bfloat16)
    loaded = load_model(d, RuntimeConfig(), "cuda", torch.bfloat16)
    ref = _reference(d, torch.bfloat16)
    mine = loaded.model.state_dict()
    for name, expected in ref.state_dict().items():
        got = mine[name]
        if got.device.type == "meta":
            continue
        assert got.device.type == "cuda", name
        assert torch.equal(got.cpu(), expected), name
    assert all(t.device.type == "cpu" for t in loaded.host.read(0, 0).values())
    _materialise_experts(loaded)
    for r in loaded.moe_layers:
        r.experts.to("cuda")
    ids = torch.randint(0, ref.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = loaded.model(ids.cuda()).logits.float().cpu()
        expected = ref.cuda()(ids.cuda()).logits.float().cpu()
    torch.testing.assert_close(got, expected)


def test_checkpoint_dtype_is_what_the_weights_are_stored_in(tiny_model_dir):
    from fmoe_local.loading import checkpoint_dtype

    assert checkpoint_dtype(tiny_model_dir("mixtral", dtype=torch.bfloat16)) == torch.bfloat16
    assert checkpoint_dtype(tiny_model_dir("mixtral")) == torch.float32


@pytest.mark.parametrize(
    ("expert_format", "dense_format", "lacking", "names"),
    [("int4", "auto", "int4", "choose 8-bit (int8)"), ("int8", "int4", "int4", "choose 8-bit (int8)")],
)
def test_a_packed_format_this_torch_cannot_multiply_on_the_cpu_is_refused_at_load(
    tiny_model_dir, tmp_path, monkeypatch, request, expert_format, dense_format, lacking, names
):
    """A torch build or CPU without the int4 product: the load says so and names the format that runs, before any
    expert is quantised (no copy on disk), instead of failing at the first token."""
    from fmoe_local import expert_formats

    def missing(self, x, bias):
        raise RuntimeError("Could not run 'aten::_weight_int4pack_mm_for_cpu' with arguments from the 'CPU' backend.")

    monkeypatch.setattr(expert_formats.Int4Weight, "linear", missing)
    expert_formats.product_runs.cache_clear()  # asked once per process: this test's build lacks the int4 product
    request.addfinalizer(expert_formats.product_runs.cache_clear)
    config = RuntimeConfig(expert_format=expert_format, dense_format=dense_format, quant_cache_dir=str(tmp_path / "q"))
    with pytest.raises(ValueError, match=r"no CPU product for 4-bit int4 \(int4\) weights") as refused:
        load_model(tiny_model_dir("mixtral"), config, "cpu", torch.bfloat16)
    assert names in str(refused.value)
    assert not (tmp_path / "q").exists() or not any((tmp_path / "q").rglob("*.safetensors"))


def test_the_cpu_products_this_build_has_are_found():
    from fmoe_local import expert_formats

    for fmt in expert_formats.PRODUCTS:
        for dtype in (torch.float32, torch.bfloat16):
            assert expert_formats.product_runs(fmt, dtype)
    assert not expert_formats.product_runs("nf4", torch.float32)  # no product: dequantised per use
