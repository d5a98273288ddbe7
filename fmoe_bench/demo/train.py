"""Reproducible training of the embedded demo model: a small Qwen3-MoE chat LM with its own BPE tokenizer.

Scope: build the tokenizer (byte-level BPE, trained offline on the training text) and the model (a transformers
config class, so the runtime loads it like any downloaded checkpoint), train it on CPU with the router
load-balancing loss, log the loss curve and held-out perplexity, and save checkpoints with save_pretrained every few
minutes so the best-so-far survives an interruption. It does NOT ship anything by itself (copy a checkpoint into
fmoe_local/demo/weights) and does NOT analyse routing (analysis.py).

Run (the shipped weights came from exactly this; see weights/TRAINING.md):
    python -m fmoe_bench.demo.train --out build/demo-train --steps 1800 --max-minutes 52 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from fmoe_bench.demo.data import (
    CHAT_TEMPLATE,
    END_OF_TEXT,
    IM_END,
    SPECIAL_TOKENS,
    is_heldout,
    iter_conversations,
    render_chat,
)


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any input text is representable) wrapped with a ChatML template and eos/pad tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (IM_END, END_OF_TEXT)],
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(vocab_size: int, tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,  # unused: every layer is sparse (mlp_only_layers empty)
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        output_router_logits=False,  # training turns it on per call; inference does not need the logits
        router_aux_loss_coef=args.aux_coef,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
        bos_token_id=None,
    )


def encode_corpus(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> np.ndarray:
    """One packed stream: each conversation followed by <|endoftext|>."""
    eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    out = []
    for seq in ids:
        out.extend(seq)
        out.append(eot)
    return np.asarray(out, dtype=np.uint16)


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-style balance loss per layer, averaged; 1.0·top_k when balanced.

    transformers' own aux loss pools the router logits of all layers before measuring balance, so a layer can leave
    experts dead as long as other layers use them (seen in a first run: two of eight experts unused in layer 4).
    """
    losses = [load_balancing_loss_func((logits,), num_experts, top_k) for logits in router_logits]
    return torch.stack(losses).mean()


def lr_at(progress: float, base_lr: float, warmup: float) -> float:
    """Linear warmup then cosine decay to 10% of base; progress in [0, 1]."""
    if progress < warmup:
        return base_lr * progress / warmup
    frac = min(1.0, (progress - warmup) / (1.0 - warmup))
    return base_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


@torch.no_grad()
def heldout_loss(model: Qwen3MoeForCausalLM, data: np.ndarray, seq_len: int, max_windows: int) -> float:
    """Mean next-token cross-entropy over non-overlapping held-out windows (the same windows every time)."""
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq_len)
    total = 0.0
    for i in range(0, n, 8):
        rows = [data[j * seq_len : (j + 1) * seq_len + 1] for j in range(i, min(n, i + 8))]
        x = torch.from_numpy(np.stack(rows).astype(np.int64))
        out = model(input_ids=x[:, :-1], labels=x[:, :-1])
        total += out.loss.item() * len(rows)
    model.train()
    return total / n


def save_checkpoint(model: Qwen3MoeForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """fp16 save_pretrained into a staging dir, then swap it in, so a reader never sees a half-written checkpoint."""
    staging = out.with_name(out.name + ".tmp")
    half = copy.deepcopy(model).to(torch.float16)
    half.config.output_router_logits = False
    half.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    GenerationConfig(
        eos_token_id=[model.config.eos_token_id, model.config.pad_token_id],
        pad_token_id=model.config.pad_token_id,
        do_sample=False,
        max_new_tokens=256,
    ).save_pretrained(staging)
    if out.exists():
        old = out.with_name(out.name + ".old")
        if old.exists():
            _rmtree(old)
        out.rename(old)
        staging.rename(out)
        _rmtree(old)
    else:
        staging.rename(out)


def _rmtree(path: Path) -> None:
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def sample_prompt(model: Qwen3MoeForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str, n: int = 40) -> str:
    model.eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=model.config.eos_token_id)
    model.train()
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@dataclass(frozen=True)
class TrainBudget:
    """How long and how hard `train_lm` trains: the demo's and `bench quality --families`'s one knob set."""

    steps: int
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: float = 0.04  # fraction of training
    weight_decay: float = 0.1
    aux_coef: float = 0.02
    max_minutes: float = 78.0  # the LR schedule ends here too when time, not steps, runs out
    seed: int = 0


def train_lm(
    model: torch.nn.Module,
    train: np.ndarray,
    budget: TrainBudget,
    num_experts: int,
    top_k: int,
    after_step: Callable[[int, dict], None] | None = None,
) -> tuple[int, int]:
    """Train a MoE causal LM on random windows of the packed token stream `train`; returns (last step, tokens seen).

    AdamW (decay on matrices only), warmup then cosine (`lr_at`), gradient clip 1.0, LM loss plus the per-layer
    balance loss. `after_step(step, {lr, loss, aux_loss, tokens})` runs after each step (the demo logs, evaluates
    and checkpoints there). Any family whose forward returns `router_logits` trains here (bench quality's tiny models).
    """
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": budget.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=budget.lr,
        betas=(0.9, 0.95),
    )
    if len(train) < budget.seq_len + 2:
        raise ValueError(f"The training text is shorter than one window of {budget.seq_len} tokens: give more text.")
    vocab = model.config.vocab_size
    rng = np.random.default_rng(budget.seed)
    start = time.time()
    tokens_seen = 0
    step = 0
    for step in range(1, budget.steps + 1):
        elapsed = time.time() - start
        # The schedule follows whichever budget runs out first, so a slow machine still anneals before stopping.
        progress = max(step / budget.steps, elapsed / (60 * budget.max_minutes))
        if progress > 1.0:
            break
        lr = lr_at(progress, budget.lr, budget.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(train) - budget.seq_len - 1, size=budget.batch)
        x = torch.from_numpy(np.stack([train[s : s + budget.seq_len] for s in starts]).astype(np.int64))
        out = model(input_ids=x, output_router_logits=True)
        lm = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))
        aux = per_layer_balance_loss(out.router_logits, num_experts, top_k)
        (lm + budget.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens_seen += x.numel()
        if after_step is not None:
            after_step(step, {"lr": lr, "loss": lm.item(), "aux_loss": aux.item(), "tokens": tokens_seen})
    return step, tokens_seen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("build/demo-train"))
    p.add_argument("--steps", type=int, default=1800)
    p.add_argument("--max-minutes", type=float, default=78.0, help="stop early; the LR schedule then ends here too")
    p.add_argument("--checkpoint-minutes", type=float, default=10.0)
    p.add_argument("--eval-every", type=int, default=150)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=float, default=0.04, help="fraction of training")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--aux-coef", type=float, default=0.02)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=192)
    p.add_argument("--heldout-fraction", type=float, default=0.02)
    # One thread: on a shared, oversubscribed CPU two OpenMP threads spin-wait on each other (measured: ~10x slower).
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "log.jsonl", "a", encoding="utf-8")

    def emit(**row: object) -> None:
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(json.dumps(row), flush=True)

    train_texts, heldout_texts = [], []
    for conv in iter_conversations(max_turns=6, max_message_chars=2000):
        (heldout_texts if is_heldout(conv.id, args.heldout_fraction) else train_texts).append(
            render_chat(conv.messages)
        )
    tokenizer = build_tokenizer(train_texts, args.vocab)
    train = encode_corpus(tokenizer, train_texts)
    heldout = encode_corpus(tokenizer, heldout_texts)
    emit(
        event="data",
        train_conversations=len(train_texts),
        heldout_conversations=len(heldout_texts),
        train_tokens=len(train),
        heldout_tokens=len(heldout),
        chars_per_token=sum(map(len, train_texts)) / len(train),
    )

    config = build_config(len(tokenizer), tokenizer, args)
    model = Qwen3MoeForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    emit(event="model", params=n_params, config=config.to_dict())

    start = time.time()
    last_ckpt = start
    best = float("inf")

    def after_step(step: int, row: dict) -> None:
        nonlocal best, last_ckpt
        if step % 10 == 0 or step == 1:
            emit(
                event="train",
                step=step,
                minutes=round((time.time() - start) / 60, 2),
                tokens=row["tokens"],
                lr=row["lr"],
                loss=round(row["loss"], 4),
                aux_loss=round(row["aux_loss"], 4),
            )
        if step % args.eval_every == 0:
            hl = heldout_loss(model, heldout, args.seq_len, max_windows=64)
            best = min(best, hl)
            emit(
                event="eval",
                step=step,
                tokens=row["tokens"],
                heldout_loss=round(hl, 4),
                heldout_ppl=round(math.exp(hl), 2),
            )
        if time.time() - last_ckpt > 60 * args.checkpoint_minutes:
            save_checkpoint(model, tokenizer, args.out / "checkpoint")
            emit(event="checkpoint", step=step, sample=sample_prompt(model, tokenizer, "Tell me about the ocean."))
            last_ckpt = time.time()

    budget = TrainBudget(
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        aux_coef=args.aux_coef,
        max_minutes=args.max_minutes,
        seed=args.seed,
    )
    step, tokens_seen = train_lm(model, train, budget, config.num_experts, config.num_experts_per_tok, after_step)
    hl = heldout_loss(model, heldout, args.seq_len, max_windows=256)
    save_checkpoint(model, tokenizer, args.out / "checkpoint")
    emit(
        event="final",
        step=step,
        tokens=tokens_seen,
        minutes=round((time.time() - start) / 60, 2),
        heldout_loss=round(hl, 4),
        heldout_ppl=round(math.exp(hl), 2),
        sample=sample_prompt(model, tokenizer, "Tell me about the ocean."),
    )


if __name__ == "__main__":
    main()
