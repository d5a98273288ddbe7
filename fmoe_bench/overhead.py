"""Overhead benchmark: the runtime with every expert resident vs the un-modified transformers model.

Scope: measures the cost of our machinery (hooks, matcher thread, cache bookkeeping) when offloading has nothing to
do, on the same greedy tokens. Prints a table; asserts nothing (performance is measured, never a test).
`fmoe-local bench overhead --model DIR [--tokens N] [--repeats R]`, or `python -m fmoe_bench.overhead …`.
torch and transformers are imported when measuring, so that building the command line stays fast.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fmoe_local.cli_args import SentenceParser, whole

if TYPE_CHECKING:
    import torch

PROMPT = [{"role": "user", "content": "Tell me about the ocean, its waves, its tides and the life in it."}]


def _time_plain(model: torch.nn.Module, ids: torch.Tensor, tokens: int) -> float:
    """The same token loop as ours (prefill, then one token at a time with a KV cache) on the plain model."""
    import torch
    from transformers import DynamicCache

    t0 = time.perf_counter()
    cache = DynamicCache(config=model.config)
    inputs = ids
    with torch.inference_mode():
        for _ in range(tokens):
            out = model(input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
            inputs = out.logits[:, -1:].argmax(-1)
    return time.perf_counter() - t0


def measure(
    model_dir: Path, tokens: int = 64, repeats: int = 7, policy: str = "fmoe", synchronous: bool = False
) -> dict:
    """The same greedy generation, ours then plain, back to back `repeats` times.

    The ratio is the median of the pairs' ratios: on a shared machine the load drifts between pairs far more than
    within one, so separate medians of each side measured mostly the drift.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from fmoe_local.config import RuntimeConfig, Sampling
    from fmoe_local.runtime import Runtime

    # Copy misses: the warm-up then leaves every expert resident, which is what this benchmark compares.
    config = RuntimeConfig(
        device="cpu",
        cache_experts=10**9,
        policy=policy,
        synchronous_prefetch=synchronous,
        miss_handling="copy",
        prefix_cache_gb=0.0,  # the same prompt each time: plain transformers prefills it whole, so do we
    )
    sampling = Sampling(greedy=True, max_new_tokens=tokens)
    plain_model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32)
    plain_model.eval()
    ours, plain = [], []
    with Runtime.load(model_dir, config) as runtime:
        ids = torch.tensor([runtime.tokenize(PROMPT)])  # on the CPU, as plain_model is
        final = runtime.generate(PROMPT, sampling)  # warm-up: fills the cache, so every later access is a hit
        n = final.stats.tokens
        _time_plain(plain_model, ids, n)
        for _ in range(repeats):
            t0 = time.perf_counter()
            final = runtime.generate(PROMPT, sampling)
            ours.append(time.perf_counter() - t0)
            plain.append(_time_plain(plain_model, ids, n))
        hit_rate = final.stats.hit_rate
    return {
        "model": model_dir.name,
        "tokens": n,
        "ours_s": statistics.median(ours),
        "plain_s": statistics.median(plain),
        "ratio": statistics.median(o / p for o, p in zip(ours, plain, strict=True)),
        "hit_rate": hit_rate,
        "policy": policy + ("/sync" if synchronous else ""),
    }


def print_table(rows: list[dict]) -> None:
    print("plain s, ours s: medians of the timed generations; ratio: median of the back-to-back pairs' ratios")
    print(f"{'model':<28} {'policy':<19} {'tokens':>6} {'plain s':>9} {'ours s':>9} {'ratio':>7} {'hit rate':>9}")
    for r in rows:
        print(
            f"{r['model']:<28} {r['policy']:<19} {r['tokens']:>6} {r['plain_s']:>9.3f} {r['ours_s']:>9.3f} "
            f"{r['ratio']:>7.3f} {r['hit_rate']:>9.1%}"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, action="append", required=True, help="model folder (repeatable)")
    p.add_argument("--tokens", type=whole(1), default=64, help="greedy tokens per generation (default 64)")
    p.add_argument("--repeats", type=whole(1), default=7, help="timed generations of each, median taken (default 7)")
    p.add_argument("--policy", default="fmoe", help="the runtime's policy (default fmoe)")
    p.add_argument("--sync", action="store_true", help="matcher and copies inline instead of on the worker thread")


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_arguments(sub.add_parser("overhead", help="runtime with every expert resident vs plain transformers"))


def run(args: argparse.Namespace) -> int:
    for m in args.model:
        if not m.is_dir():
            raise FileNotFoundError(f"No model folder at {m}: pass --model with a downloaded checkpoint.")
    print_table([measure(m, args.tokens, args.repeats, args.policy, args.sync) for m in args.model])
    return 0


def main(argv: list[str] | None = None) -> int:
    p = SentenceParser(prog="python -m fmoe_bench.overhead", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
