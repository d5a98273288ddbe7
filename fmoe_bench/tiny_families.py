"""Tiny configs of every supported MoE family: real transformers config classes at toy sizes.

Scope: one config per family (hidden 64, 8 experts, top-2, 2–4 layers, each family's own features kept: shared
experts, dense first layers, MLA, grouped routing, YaRN) for the tests' random-weight models (tests/tiny.py) and for
`bench quality --families`, which trains them briefly before measuring perplexity. It does NOT build weights,
tokenizers or files.
"""

from __future__ import annotations

from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.deepseek_v2 import DeepseekV2Config
from transformers.models.deepseek_v3 import DeepseekV3Config
from transformers.models.gpt_oss import GptOssConfig
from transformers.models.mixtral import MixtralConfig
from transformers.models.olmoe import OlmoeConfig
from transformers.models.phimoe import PhimoeConfig
from transformers.models.qwen2_moe import Qwen2MoeConfig
from transformers.models.qwen3_moe import Qwen3MoeConfig

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "deepseek_v2", "deepseek_v3", "gpt_oss")
HIDDEN = 64
NUM_EXPERTS = 8
TOP_K = 2


def tiny_config(
    family: str, tokenizer: PreTrainedTokenizerBase, vocab_size: int, *, tied: bool = False
) -> PretrainedConfig:
    """The config of a tiny model of `family` (hidden 64, 8 experts, top-2), token ids from `tokenizer`."""
    ids = dict(
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tied,
        max_position_embeddings=512,
    )
    attn = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2)
    if family == "mixtral":
        return MixtralConfig(
            **ids, **attn, num_hidden_layers=4, intermediate_size=32, num_local_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
        )  # fmt: skip
    if family == "qwen2_moe":
        return Qwen2MoeConfig(
            **ids, **attn, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
        )  # fmt: skip
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **ids, **attn, head_dim=16, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32,
            num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, mlp_only_layers=[1], norm_topk_prob=True,
        )  # fmt: skip
    if family == "olmoe":
        return OlmoeConfig(
            **ids, **attn, num_hidden_layers=3, intermediate_size=32, num_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
        )  # fmt: skip
    if family == "phimoe":
        return PhimoeConfig(
            **ids, **attn, num_hidden_layers=3, intermediate_size=32, num_local_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K, router_jitter_noise=0.0, input_jitter_noise=0.0,
        )  # fmt: skip
    mla = dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    if family == "deepseek_v2":
        return DeepseekV2Config(
            **ids, **mla, hidden_size=HIDDEN, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
            n_routed_experts=NUM_EXPERTS, n_shared_experts=1, num_experts_per_tok=TOP_K, first_k_dense_replace=1,
            topk_method="greedy",
        )  # fmt: skip
    if family == "deepseek_v3":
        return DeepseekV3Config(
            **ids, **dict(mla, q_lora_rank=24), hidden_size=HIDDEN, num_hidden_layers=3, intermediate_size=96,
            moe_intermediate_size=32, n_routed_experts=NUM_EXPERTS, n_shared_experts=1, num_experts_per_tok=TOP_K,
            first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        )  # fmt: skip
    if family == "gpt_oss":
        return GptOssConfig(
            **ids, **attn, head_dim=16, num_hidden_layers=2, intermediate_size=32, num_local_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K, sliding_window=64,
            # GPT-OSS ships YaRN; keep it, with a factor consistent with the tiny context.
            rope_parameters={
                "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 16, "rope_theta": 150000.0,
            },
        )  # fmt: skip
    raise ValueError(f"Unknown tiny family '{family}'. Choose one of: {', '.join(FAMILIES)}.")
