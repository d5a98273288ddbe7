"""`fmoe-local bench quality`: what quantising the experts costs in accuracy — perplexity on held text per format
(the dense weights unquantised whatever the device, so a row is the experts' format alone).

Scope: one load of the model per expert format through `Runtime.load` (every expert resident, so the number is the
format's and not the cache's), the held text cut into fixed windows, and the mean next-token cross-entropy of the
offloaded model over them (the runtime's own forward pass: slots, dequantising, eager's ops). It does NOT time
anything (bench live does) or generate.

Held text: the first user turns of the shared ShareGPT prompts, which the demo model never trained on (its
TRAINING.md), rendered in the model's chat template and packed into windows of `seq_len` tokens.
`--families` adds one briefly trained tiny model per supported family (quality_families.py).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path

from fmoe_bench.prompts import read_prompts, shared_data_dir
from fmoe_local.cli_args import whole

DEFAULT_TEXT = "prompts/sharegpt-first-turn-2000.json"


def held_windows(tokenizer: object, texts: Sequence[str], seq_len: int, windows: int) -> list[list[int]]:
    """Non-overlapping windows of `seq_len + 1` tokens of the texts rendered as user turns, in order."""
    stream: list[int] = []
    for text in texts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=True, return_dict=False, add_generation_prompt=False
        )
        stream.extend(ids["input_ids"] if isinstance(ids, dict) else ids)
        if len(stream) > (seq_len + 1) * windows:
            break
    n = min(windows, len(stream) // (seq_len + 1))
    return [stream[i * (seq_len + 1) : (i + 1) * (seq_len + 1)] for i in range(n)]


def perplexity(model_dir: Path, fmt: str, texts: Sequence[str], seq_len: int, windows: int, device: str) -> dict:
    """{format, expert_bytes, tokens, loss, ppl} of the offloaded model with experts stored as `fmt`."""
    import torch

    from fmoe_local.config import RuntimeConfig
    from fmoe_local.runtime import Runtime
    from fmoe_local.stats import RequestStats

    with tempfile.TemporaryDirectory(prefix="fmoe-quality-") as tmp:
        # dense_format bf16: the number is the experts' format alone; on a CPU device dense_format auto would pack
        # the attention and output head too (dense_formats.py), mixing a second quantisation into every row.
        config = RuntimeConfig(
            device=device, expert_format=fmt, dense_format="bf16", quant_cache_dir=tmp, policy="on_demand"
        )
        with Runtime.load(model_dir, config) as runtime:
            info = runtime.info
            runtime.reconfigure(cache_experts=info.num_layers * info.num_experts, miss_handling="copy")
            engine = runtime.engine
            rows = held_windows(engine.tokenizer, texts, seq_len, windows)
            if not rows:
                raise ValueError("The held text is shorter than one window: pass more text or a smaller --seq-len.")
            total, count = 0.0, 0
            # One request bracket, as the runtime's worker makes one (the worker is idle: no request is queued).
            with torch.inference_mode(), engine.request(1, RequestStats()):
                for row in rows:
                    x = torch.tensor([row], device=engine.device)
                    logits = engine.model(input_ids=x[:, :-1]).logits.float()  # [1, T, V]
                    loss = torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum")
                    total, count = total + loss.item(), count + seq_len
                    engine.end_iteration()
    return {
        "format": info.expert_format,
        "dtype": info.dtype,
        "expert_bytes": info.expert_bytes,
        "tokens": count,
        "loss": total / count,
        "ppl": math.exp(total / count),
    }


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quality", help="perplexity on held text for each expert format (bf16 vs int8 vs nf4)")
    p.add_argument("--model", type=Path, help="model folder (default: the built-in demo model)")
    p.add_argument("--formats", default="bf16,int8,nf4", help="comma-separated expert formats (default bf16,int8,nf4)")
    p.add_argument("--text", type=Path, help=f"held text: a prompts file (default data/{DEFAULT_TEXT})")
    p.add_argument("--seq-len", type=whole(2), default=256, help="tokens per window (default 256)")
    p.add_argument("--windows", type=whole(1), default=64, help="windows scored (default 64)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--families",
        help="also train one tiny model per family (comma-separated, or 'all') on part of the text and score it and "
        "the demo model on the rest (random weights would make perplexity meaningless)",
    )
    p.add_argument("--train-steps", type=whole(1), default=300, help="training steps per tiny model (default 300)")
    p.add_argument("--train-dir", type=Path, help="keep the trained tiny models here (default: a temporary folder)")


def run(args: argparse.Namespace) -> int:
    from fmoe_local.config import EXPERT_FORMATS
    from fmoe_local.demo import demo_model_dir

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in EXPERT_FORMATS]
    if unknown or not formats:
        raise ValueError(f"Unknown expert format {', '.join(unknown) or '(none)'}. Choose from: bf16, int8, nf4, auto.")
    if args.seq_len < 2 or args.windows < 1:
        raise ValueError("--seq-len must be at least 2 and --windows at least 1.")
    model_dir = args.model or demo_model_dir()
    if args.families and args.model:
        raise ValueError("--families scores the demo model beside the tiny ones: leave out --model.")
    text_path = args.text or shared_data_dir() / DEFAULT_TEXT
    texts = read_prompts(text_path)
    if args.families:
        from fmoe_bench.quality_families import run_families

        return run_families(args, formats, texts, text_path)
    print(f"model {model_dir}; held text {text_path}; {args.windows} windows x {args.seq_len} tokens")
    print("| expert format | expert KB | tokens | loss | perplexity |\n|---|---|---|---|---|")
    for fmt in formats:
        r = perplexity(model_dir, fmt, texts, args.seq_len, args.windows, args.device)
        name = r["format"] if r["format"] != "bf16" else f"unquantised ({r['dtype']})"
        # flush: each format takes minutes, and a pipe would hold every row until the end
        print(
            f"| {name} | {r['expert_bytes'] / 1e3:.1f} | {r['tokens']} | {r['loss']:.4f} | {r['ppl']:.2f} |", flush=True
        )
    return 0
