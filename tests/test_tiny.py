"""The tiny checkpoints other tests rely on: they must look like real downloads."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.tiny import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_is_a_loadable_checkpoint(tiny_model_dir, family):
    d = tiny_model_dir(family)
    config = AutoConfig.from_pretrained(d)
    assert config.model_type == family
    assert config.hidden_size == 64
    assert (d / "model.safetensors").exists()
    tok = AutoTokenizer.from_pretrained(d)
    text = "Write a short poem about the sea."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert max(ids) < config.vocab_size
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    assert prompt.startswith(tok.bos_token) and prompt.endswith("<|assistant|>\n")
    assert config.eos_token_id == tok.eos_token_id


def test_sharded_checkpoint_has_index_and_several_shards(tiny_model_dir):
    d = tiny_model_dir("mixtral", sharded=True, dtype=torch.bfloat16)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert all((d / s).exists() for s in shards)
    assert not (d / "model.safetensors").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_does_not_loop_on_one_token(tiny_model_dir, family):
    d = tiny_model_dir(family)
    model = AutoModelForCausalLM.from_pretrained(d, experts_implementation="eager")
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok("Write a short poem about the sea.", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 12 and len(set(new)) >= 4, new
