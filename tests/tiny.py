"""Tiny MoE checkpoints for tests: real transformers config classes, random weights, an offline-trained tokenizer.

Scope: build a model directory that looks like a downloaded checkpoint (config.json, safetensors, tokenizer files)
so that tests exercise the real loading path. It does NOT download anything and does NOT load models for tests
(tests/conftest.py caches the built directories per session).

Weights are re-drawn with a fixed seed at a scale (std 1/sqrt(fan_in), norms around 1) that makes routing
non-uniform and greedy decoding varied; transformers' own 0.02 init gives near-uniform routers and a model that
repeats one token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from fmoe_bench.tiny_families import FAMILIES, NUM_EXPERTS, TOP_K, tiny_config
from tests.shared_data import SHARED_DATA

__all__ = ("FAMILIES", "NUM_EXPERTS", "TOP_K", "build_tiny_model", "tiny_config", "train_tokenizer")

VOCAB_SIZE = 384
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PROMPTS_FILE = SHARED_DATA / "prompts" / "alpaca-seed-tasks-175.jsonl"
# Used when the shared prompts are absent (e.g. a fresh clone): enough text for a few hundred merges.
FALLBACK_TEXT = (
    "The quick brown fox jumps over the lazy dog. Experts live in host memory and a small cache on the GPU "
    "holds the ones about to be needed. Write a short poem about the sea. Explain how a router picks two experts "
    "for every token, and why prefetching them early hides the cost of copying weights. "
) * 8


def _corpus() -> list[str]:
    if PROMPTS_FILE.exists():
        lines = []
        for line in PROMPTS_FILE.read_text(encoding="utf-8").splitlines()[:60]:
            row = json.loads(line)
            lines.append(row["instruction"])
            lines.extend(inst["output"] for inst in row.get("instances", []))
        return lines
    return FALLBACK_TEXT.split(". ")


def train_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer offline, wrap it with special tokens and a chat template, save it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


@torch.no_grad()
def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter deterministically (sorted names, own generator)."""
    gen = torch.Generator().manual_seed(seed)
    # GPT-OSS keeps its experts as [E, in, out]; the others as [E, out, in].
    in_dim = -2 if model.config.model_type == "gpt_oss" else -1
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.dim() == 1:
            # Norm weights around 1; biases (incl. e_score_correction_bias, attention sinks) small but non-zero.
            base = 1.0 if ("norm" in name and name.endswith("weight")) else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            continue
        fan_in = p.shape[in_dim] if p.dim() == 3 else p.shape[-1]
        # Unit-scale embeddings keep token identity strong in the residual stream (else the model loops on one token).
        std = 1.0 if name.endswith("embed_tokens.weight") else fan_in**-0.5
        if name.endswith(("mlp.gate.weight", "mlp.router.weight", "block_sparse_moe.gate.weight")):
            std *= 2.0  # peaked router distributions, so that top-k and prefetch choices are meaningful
        p.copy_(torch.randn(p.shape, generator=gen) * std)
    for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
        if name.endswith("e_score_correction_bias"):  # saved with the checkpoint: make it non-trivial to load
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def build_tiny_model(
    family: str,
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    sharded: bool = False,
    tied: bool = False,
) -> Path:
    """Build and save a tiny `family` model (weights + tokenizer) into `out_dir`; returns `out_dir`.

    `sharded=True` writes several safetensors shards plus model.safetensors.index.json; `tied=True` ties the
    output projection to the input embeddings (the checkpoint then has no lm_head.weight).
    """
    out_dir = Path(out_dir)
    for stale in out_dir.glob("model*.safetensors*"):
        stale.unlink()  # a rebuild with another sharding must not leave the old files behind
    tokenizer = train_tokenizer(out_dir)
    config = tiny_config(family, tokenizer, VOCAB_SIZE, tied=tied)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit(model, seed)
    model = model.to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, max_shard_size="150KB" if sharded else "1GB")
    return out_dir


def with_special_tokens(model_dir: Path, out_dir: Path, tokens: list[str], context: int | None = None) -> Path:
    """A copy of a tiny model whose tokenizer also has `tokens` as special tokens (as a real checkpoint has its tool
    markers: Mistral's [TOOL_CALLS], harmony's <|channel|>), the embeddings and output rows grown to match with
    seeded random rows; `context`: a longer max_position_embeddings (rotary positions take any length)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    shutil.copytree(model_dir, out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    old = len(tok)
    tok.add_tokens(list(tokens), special_tokens=True)
    tok.save_pretrained(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    config["vocab_size"] = len(tok)
    config |= {"max_position_embeddings": context} if context else {}
    (out_dir / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(len(tokens))
    for file in out_dir.glob("*.safetensors"):
        tensors = load_file(file)
        for name, t in tensors.items():
            if name.endswith(("embed_tokens.weight", "lm_head.weight")) and t.shape[0] == old:
                extra = torch.randn((len(tok) - old, t.shape[1]), generator=gen, dtype=torch.float32)
                tensors[name] = torch.cat([t, (extra * t.float().std()).to(t.dtype)])
        save_file(tensors, file, metadata={"format": "pt"})
    return out_dir
