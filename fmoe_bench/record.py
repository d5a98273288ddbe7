"""`fmoe-local bench record`: a model's own routing on a seeded sample of prompts, written as a routing trace.

Scope: one model load with `RuntimeConfig.record_trace` set, then each sampled prompt answered greedily as a request
of its own (no chat history), the runtime's TraceRecorder saving the trace after every request. It does NOT replay
(replay.py) or time anything. The policy and cache do not change what is recorded (the output is lossless and the
routing is the model's), so it records with lru, a small cache and misses computed where auto puts them.

Why: the shared traces are one model's (DeepSeek-V2-Lite, 64 experts, top-6). A few-expert model's own routing —
the built-in demo model's 8 experts, top-2, with real softmaxes and embeddings — is a stand-in for Mixtral-8x7B that
folding cannot give (docs/bench.md, "Generalising").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fmoe_bench.prompts import sample_prompts, shared_data_dir
from fmoe_local.cli_args import seed, whole


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("record", help="record a model's routing on a seeded sample of prompts as a trace (.npz)")
    p.add_argument("out", type=Path, help="the trace file to write (.npz, format: DESIGN.md)")
    p.add_argument("--model", type=Path, help="model folder (default: the built-in demo model)")
    p.add_argument("--prompts", type=Path, help="a .json/.jsonl prompts file or folder (default data/prompts)")
    p.add_argument("--requests", type=whole(1), default=64, help="prompts sampled (seeded) from --prompts (default 64)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the prompt sample")
    p.add_argument("--max-prompt-chars", type=whole(1), default=1500, help="sample only prompts up to this length")
    p.add_argument("--max-new-tokens", type=whole(1), default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])


def run(args: argparse.Namespace) -> int:
    from fmoe_local.cli import default_model_dir
    from fmoe_local.config import RuntimeConfig, Sampling
    from fmoe_local.runtime import Runtime
    from fmoe_local.traces import load_trace

    if args.requests < 1 or args.max_new_tokens < 1:
        raise ValueError("--requests and --max-new-tokens must be at least 1.")
    if args.out.suffix != ".npz":
        raise ValueError(f"Name the trace file with .npz (got {args.out.name}): the trace format is numpy's .npz.")
    model = args.model or default_model_dir()
    if not model.is_dir():
        raise FileNotFoundError(f"No model folder at {model}: pass --model with a downloaded checkpoint.")
    prompts_path = args.prompts or shared_data_dir() / "prompts"
    prompts = sample_prompts(prompts_path, args.requests, args.seed, args.max_prompt_chars)
    args.out.unlink(missing_ok=True)  # the recorder writes everything it saw; an old file would only mislead
    sampling = Sampling(greedy=True, max_new_tokens=args.max_new_tokens)
    # Every prompt prefilled whole: a trace holds each prompt's own routing, not what a kept prefix left to run.
    config = RuntimeConfig(
        device=args.device, policy="lru", record_trace=str(args.out), sampling=sampling, prefix_cache_gb=0.0
    )
    t0 = time.perf_counter()
    with Runtime.load(model, config) as runtime:
        for i, prompt in enumerate(prompts):
            final = runtime.generate([{"role": "user", "content": prompt}])
            if final.reason == "error":
                raise ValueError(f"Prompt {i} of the sample failed: {final.error}")
            if (i + 1) % 8 == 0 or i + 1 == len(prompts):  # 64 prompts take minutes on a CPU: say how far
                print(
                    f"[{time.perf_counter() - t0:7.1f} s] {i + 1} of {len(prompts)} prompts recorded", file=sys.stderr
                )
    trace = load_trace(args.out)
    print(
        f"{trace.model}: {len(trace.requests())} requests, {trace.num_rows} rows, {trace.num_layers} MoE layers, "
        f"{trace.num_experts} experts, top-{trace.top_k}; sample of {prompts_path} (seed {args.seed}); "
        f"{time.perf_counter() - t0:.0f} s; written to {args.out}"
    )
    return 0
