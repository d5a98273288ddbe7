"""A checkpoint quantised with bitsandbytes 4-bit (nf4, double quantisation), written the way those files are: every
Linear weight but lm_head replaced by what a `Params4bit` saves (codes + packed quant state). Its experts are read packed, per expert (never
dequantised on load), and the offloaded model equals transformers eager on bitsandbytes' own dequantised weights."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.loading import load_model
from fmoe_local.runtime import Runtime

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
PROMPT = [{"role": "user", "content": "Tell me about the ocean and the waves."}]
QUANT_CONFIG = {
    "quant_method": "bitsandbytes",
    "load_in_4bit": True,
    "load_in_8bit": False,
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": True,
    "bnb_4bit_compute_dtype": "float32",
    "llm_int8_skip_modules": ["lm_head"],
}


def nf4_formula(q: torch.Tensor, state) -> torch.Tensor:
    """bitsandbytes' nf4 dequantisation written out from its QuantState: level[code] · block absmax, the absmax itself
    double-quantised. (bitsandbytes 0.50's own CPU dequantize_4bit returns wrong values for some shapes, e.g.
    [64, 96] — far from the weights it quantised — so the reference does not call it.)"""
    absmax = state.absmax
    if state.nested:
        per_block = state.state2.absmax.repeat_interleave(state.state2.blocksize)[: absmax.numel()]
        absmax = state.state2.code[absmax.long()] * per_block + state.offset
    flat = q.reshape(-1)
    codes = torch.stack([flat >> 4, flat & 0x0F], dim=-1).reshape(-1).long()
    return (state.code[codes].view(-1, state.blocksize) * absmax[:, None]).reshape(state.shape)


def write_bnb_checkpoint(src, dst):
    """Quantise every 2-D Linear weight of `src` (not embeddings, not lm_head) as bitsandbytes saves it; returns
    {key: bitsandbytes' dequantised weight} and writes the dense reference checkpoint to `dst`/reference."""
    import bitsandbytes.functional as bnbf

    shutil.copytree(src, dst)
    shutil.copytree(src, dst / "reference")
    tensors = load_file(dst / "model.safetensors")
    reference = dict(tensors)
    for key in [k for k in tensors if k.endswith(".weight") and tensors[k].dim() == 2]:
        if "embed_tokens" in key or key.startswith("lm_head"):
            continue
        # What Params4bit._save_to_state_dict writes: the codes as `weight`, the state under `weight.<name>`.
        # (Not Linear4bit on the CPU: it repacks the codes in memory for its own kernel.)
        w = tensors.pop(key)
        q, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        tensors[key] = q
        for name, t in state.as_dict(packed=True).items():
            tensors[f"{key}.{name}"] = t
        reference[key] = nf4_formula(q, state)
        assert (reference[key] - w).abs().max() <= 0.25 * w.abs().max()  # the formula really undoes the quantisation
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, str(dst / "reference" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIG
    (dst / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bnb_4bit_checkpoint_is_read_packed_per_expert_and_equals_eager(family, tiny_model_dir, tmp_path):
    d = tmp_path / "bnb"
    stored = write_bnb_checkpoint(tiny_model_dir(family), d)
    config = RuntimeConfig(
        device="cpu",
        cache_experts=2,
        quant_cache_dir=str(tmp_path / "q"),
        sampling=Sampling(greedy=True, max_new_tokens=8),
    )
    with Runtime.load(d, config) as runtime:
        host = runtime.engine.host
        assert runtime.info.expert_format == "nf4" and host.quant_cache is None  # nothing quantised, nothing cached
        assert not (tmp_path / "q").exists()
        ref = runtime.engine.moe_layers[0]
        down = f"model.layers.{ref.layer_index}.{runtime.engine.arch.ckpt_block}.experts.3."
        down += runtime.engine.arch.down_projs[0] + ".weight"
        assert torch.equal(host.read(0, 3)["down_proj.q"], stored[down].reshape(-1))  # the file's own bytes
        ids = runtime.engine.encode_prompt(PROMPT)
        got = {}
        for misses in ("copy", "cpu"):
            runtime.reconfigure(miss_handling=misses)
            got[misses] = runtime.generate(PROMPT).token_ids
    model = AutoModelForCausalLM.from_pretrained(d / "reference", experts_implementation="eager", dtype=torch.float32)
    expected = model.generate(ids, do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, ids.shape[1] :].tolist()
    for misses, tokens in got.items():
        assert tokens == expected[: len(tokens)], misses


def test_bnb_checkpoint_read_unquantised_on_request(tiny_model_dir, tmp_path):
    d = tmp_path / "bnb"
    write_bnb_checkpoint(tiny_model_dir("olmoe"), d)
    loaded = load_model(d, RuntimeConfig(expert_format="bf16"), "cpu", torch.float32)
    reference = load_model(d / "reference", RuntimeConfig(), "cpu", torch.float32)
    assert torch.equal(loaded.host.read(1, 5)["gate_up_proj"], reference.host.read(1, 5)["gate_up_proj"])
    q_proj = loaded.model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q_proj, reference.model.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize(
    ("change", "named"),
    [({"load_in_4bit": False, "load_in_8bit": True}, "8-bit"), ({"bnb_4bit_quant_type": "fp4"}, "4-bit fp4")],
)
def test_bnb_layouts_we_do_not_read_are_refused_naming_those_we_do(change, named, tiny_model_dir, tmp_path):
    d = tmp_path / "other"
    shutil.copytree(tiny_model_dir("mixtral"), d)
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIG | change
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{named}.*We read bitsandbytes 4-bit nf4"):
        load_model(d, RuntimeConfig(), "cpu", None)
