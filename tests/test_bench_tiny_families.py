"""The tiny per-family configs shared by the tests and `bench quality --families`: one per supported family."""

from __future__ import annotations

import pytest

from fmoe_bench.demo.train import build_tokenizer
from fmoe_bench.tiny_families import FAMILIES, HIDDEN, NUM_EXPERTS, TOP_K, tiny_config
from fmoe_local.architectures import SUPPORTED, architecture_for


def test_every_supported_family_has_a_tiny_config_with_the_tokenizers_ids():
    tok = build_tokenizer(["<|im_start|>user\nhello there, the sea and the waves<|im_end|>\n"] * 4, vocab_size=300)
    assert sorted(FAMILIES) == sorted(SUPPORTED)
    for family in FAMILIES:
        config = tiny_config(family, tok, 300)
        arch = architecture_for(config)
        assert (config.model_type, config.vocab_size, config.hidden_size) == (family, 300, HIDDEN)
        assert (arch.num_experts(config), arch.top_k(config)) == (NUM_EXPERTS, TOP_K)
        assert (config.eos_token_id, config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
        assert arch.moe_layer_indices(config)
    with pytest.raises(ValueError, match="Choose one of: mixtral"):
        tiny_config("llama", tok, 300)
