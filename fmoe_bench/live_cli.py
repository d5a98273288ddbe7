"""`fmoe-local bench live`'s command line: its arguments, checked into LiveSettings, and the run that prints the table
and writes --json. The benchmark itself is fmoe_bench/live.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fmoe_bench.live import DEFAULT_POLICIES, DEFAULT_TRACE, LiveSettings, benchmark, print_table, run_synthetic
from fmoe_bench.prompts import sample_prompts, shared_data_dir
from fmoe_local.cli_args import number, seed, whole


def add_parser(sub: argparse._SubParsersAction) -> None:
    from fmoe_bench.synthetic import SYNTHETIC
    from fmoe_local.cli import add_expert_format_argument

    p = sub.add_parser("live", help="real TTFT/TPOT/hit rate of every policy on a model, vs all experts resident")
    p.add_argument("--model", type=Path, help="model folder (a Hugging Face MoE checkpoint)")
    p.add_argument("--synthetic", choices=list(SYNTHETIC), help="random weights with this model's real shapes")
    p.add_argument("--layers", type=whole(1), default=4, help="--synthetic: number of layers (default 4)")
    p.add_argument("--trace", type=Path, help=f"--synthetic: routing trace (default data/traces/{DEFAULT_TRACE})")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated (default {DEFAULT_POLICIES})")
    p.add_argument(
        "--miss-handling",
        default="auto",
        help="comma-separated auto, copy, cpu: each policy runs under each (cpu_moe once, it always uses the CPU)",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--cache-fraction", type=number(above=0, most=1), help="cache slots as a fraction of all experts (default 0.25)"
    )
    size.add_argument("--cache-gb", type=number(above=0), help="cache budget in GB")
    size.add_argument("--cache-experts", type=whole(1), help="cache slots as a number of experts")
    p.add_argument(
        "--prefetch-distance",
        type=whole(1),
        help=f"d, 1 to the model's MoE layers less one (default {LiveSettings.prefetch_distance}, or the last layer)",
    )
    p.add_argument("--prompts", type=Path, help="a .json/.jsonl prompts file or folder (default data/prompts)")
    p.add_argument("--requests", type=whole(1), default=8, help="prompts sampled (seeded) from --prompts (default 8)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the prompt sample")
    p.add_argument("--max-prompt-chars", type=whole(1), default=1500, help="sample only prompts up to this length")
    p.add_argument("--max-new-tokens", type=whole(1), default=LiveSettings.max_new_tokens)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (--model only)")
    p.add_argument("--no-baseline", action="store_true", help="skip the all-resident run")
    add_expert_format_argument(p)
    p.add_argument("--json", type=Path, metavar="OUT", help="write config and rows as JSON")


def parse_miss_handling(text: str) -> tuple[str, ...]:
    """A comma list of miss handlings, each checked (a sentence for an unknown one)."""
    from fmoe_local.config import MISS_HANDLING

    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in MISS_HANDLING]
    if unknown or not names:
        raise ValueError(
            f"Unknown miss handling {', '.join(unknown) or repr(text)}. Choose from: {', '.join(MISS_HANDLING)} "
            "(comma-separated to run several)."
        )
    return names


def settings_from_args(args: argparse.Namespace) -> LiveSettings:
    from fmoe_local.config import POLICIES

    policies = tuple(n.strip() for n in args.policies.split(",") if n.strip())
    unknown = [n for n in policies if n not in POLICIES]
    if unknown:
        raise ValueError(f"Unknown policy {', '.join(unknown)}. Choose from: {', '.join(POLICIES)}.")
    return LiveSettings(
        policies=policies,
        miss_handling=parse_miss_handling(args.miss_handling),
        cache_fraction=args.cache_fraction,
        cache_gb=args.cache_gb,
        cache_experts=args.cache_experts,
        prefetch_distance=args.prefetch_distance,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        dtype=args.dtype,
        baseline=not args.no_baseline,
        expert_format=args.expert_format,
        dense_format=args.dense_format,
    )


def run(args: argparse.Namespace) -> int:
    from fmoe_local.cli import check_distance, moe_layer_count
    from fmoe_local.engine import resolve_device
    from fmoe_local.prefetch_distance import max_distance

    if (args.model is None) == (args.synthetic is None):
        raise ValueError("Pass either --model DIR (a MoE checkpoint) or --synthetic NAME, not both or neither.")
    if args.model is not None and not args.model.is_dir():
        raise FileNotFoundError(f"No model folder at {args.model}: pass --model with a downloaded checkpoint.")
    resolve_device(args.device)  # a sentence now, not a CUDA traceback once a synthetic model has been built
    layers = args.layers if args.synthetic is not None else moe_layer_count(args.model)
    check_distance(args.prefetch_distance, layers)  # the default is cut to a shallow model's last layer instead
    if args.prefetch_distance is None:
        args.prefetch_distance = min(LiveSettings.prefetch_distance, max_distance(layers))
    settings = settings_from_args(args)
    prompts_path = args.prompts or shared_data_dir() / "prompts"
    prompts = sample_prompts(prompts_path, args.requests, args.seed, args.max_prompt_chars)
    if args.synthetic is not None:
        trace = args.trace or shared_data_dir() / "traces" / DEFAULT_TRACE
        result = run_synthetic(args.synthetic, args.layers, trace, prompts, settings)
    else:
        result = benchmark(args.model, settings, prompts)
    result["config"] |= {"prompts": str(prompts_path), "seed": args.seed, "max_prompt_chars": args.max_prompt_chars}
    result["prompts"] = prompts
    print_table(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"results written to {args.json}")
    return 0
