"""Overhead benchmark: the runtime with every expert resident vs the un-modified transformers model.

Scope: measures the cost of our machinery (hooks, matcher thread, cache bookkeeping) when offloading has nothing to
do, on the same greedy tokens. Prints a table; asserts nothing (performance is measured, never a test).
`fmoe-local bench overhead --model DIR [--tokens N] [--repeats R]`.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.runtime import Runtime

PROMPT = [{"role": "user", "content": "Tell me about the ocean, its waves, its tides and the life in it."}]


def _time_plain(model: torch.nn.Module, ids: torch.Tensor, tokens: int) -> float:
    """The same token loop as ours (prefill, then one token at a time with a KV cache) on the plain model."""
    t0 = time.perf_counter()
    cache = DynamicCache(config=model.config)
    inputs = ids
    with torch.inference_mode():
        for _ in range(tokens):
            out = model(input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
            inputs = out.logits[:, -1:].argmax(-1)
    return time.perf_counter() - t0


def measure(model_dir: Path, tokens: int = 64, repeats: int = 5, policy: str = "fmoe") -> dict:
    config = RuntimeConfig(device="cpu", cache_experts=10**9, policy=policy)
    sampling = Sampling(greedy=True, max_new_tokens=tokens)
    with Runtime.load(model_dir, config) as runtime:
        ids = runtime.engine.encode_chat(PROMPT)
        eos = runtime.engine.eos_ids
        runtime.generate(PROMPT, sampling)  # warm-up: fills the cache, so every later access is a hit
        ours = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            final = runtime.generate(PROMPT, sampling)
            ours.append(time.perf_counter() - t0)
        n = final.stats.tokens
        hit_rate = final.stats.hit_rate
    plain_model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32)
    plain_model.eval()
    _time_plain(plain_model, ids, n)
    plain = [_time_plain(plain_model, ids, n) for _ in range(repeats)]
    return {
        "model": model_dir.name,
        "tokens": n,
        "eos_ids": sorted(eos),
        "ours_s": statistics.median(ours),
        "plain_s": statistics.median(plain),
        "ratio": statistics.median(ours) / statistics.median(plain),
        "hit_rate": hit_rate,
        "policy": policy,
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<28} {'policy':<12} {'tokens':>6} {'plain s':>9} {'ours s':>9} {'ratio':>7} {'hit rate':>9}")
    for r in rows:
        print(
            f"{r['model']:<28} {r['policy']:<12} {r['tokens']:>6} {r['plain_s']:>9.3f} {r['ours_s']:>9.3f} "
            f"{r['ratio']:>7.3f} {r['hit_rate']:>9.1%}"
        )
