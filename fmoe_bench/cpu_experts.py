"""`fmoe-local bench cpu-experts`: every CPU expert kernel, per stored format and per real expert shape, on this CPU.

Scope: the table the hybrid path's kernel choice rests on — ms per expert per token and the GB/s of weights each
kernel reaches, against this machine's measured DRAM read bandwidth — with the kernel `cpu_experts.choose` would
take marked per (shape, format). It does NOT decide anything for the runtime (miss_cost.probe measures the loaded
model's own experts at load) and it does not check numerics (tests/test_cpu_experts.py does, against eager).

Method: per (shape, format) it builds random experts of the shape, as many as it takes to exceed four times the
last-level cache and 256 MB (at least two, within `--max-gb`), so every pass reads them from DRAM as a real miss does, and
times every candidate with `cpu_experts.time_kernel` (best of `--passes` passes after a warm-up). The experts
module that supplies the activation is a one-layer model of the shape's family built from its transformers config
class (the weights' sizes do not enter it).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fmoe_local import bandwidth, cpu_experts
from fmoe_local.cli_args import number, whole, whole_list


@dataclass(frozen=True)
class ExpertShape:
    name: str
    family: str  # the transformers model_type whose experts module computes it
    hidden: int  # H
    intermediate: int  # I
    source: str


_HUB = "https://huggingface.co/{}/blob/main/config.json"
SHAPES: dict[str, ExpertShape] = {
    s.name: s
    for s in (
        ExpertShape("mixtral-8x7b", "mixtral", 4096, 14336, _HUB.format("mistralai/Mixtral-8x7B-v0.1")),
        ExpertShape("qwen3-30b-a3b", "qwen3_moe", 2048, 768, _HUB.format("Qwen/Qwen3-30B-A3B")),
        ExpertShape("deepseek-v2-lite", "deepseek_v2", 2048, 1408, _HUB.format("deepseek-ai/DeepSeek-V2-Lite")),
        ExpertShape("gpt-oss-20b", "gpt_oss", 2880, 2880, _HUB.format("openai/gpt-oss-20b")),
    )
}
FORMATS = ("bf16", "fp16", "fp32", "int8", "int4")
DEFAULT_TOKENS = (1, 16)
MIN_CYCLE_BYTES = 256 * 1024**2  # LLC sizes from sysfs can be per cluster: cycle through at least this much


@dataclass(frozen=True)
class Row:
    shape: str
    fmt: str
    kernel: str
    precision: str
    tokens: int
    experts: int  # distinct experts cycled through
    ms_per_expert: float
    gbps: float  # weight bytes read per second
    dram_fraction: float  # gbps / the measured DRAM read bandwidth
    chosen: bool  # the kernel cpu_experts.choose takes for this (shape, format)


def experts_module(family: str) -> torch.nn.Module:
    """The experts module of a one-layer, tiny `family` model: it brings the family's gate and activation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fmoe_local.architectures import architecture_for

    tiny = dict(
        hidden_size=64,
        intermediate_size=32,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=64,
        first_k_dense_replace=0,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        layer_types=["full_attention"],
        n_shared_experts=1,
        num_local_experts=4,
        num_experts=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
    )
    config = AutoConfig.for_model(family, **tiny)
    model = AutoModelForCausalLM.from_config(config)
    return architecture_for(config).moe_layers(model)[0].experts


def dense_rows(shape: ExpertShape, transposed: bool, bias: bool, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One expert's weights in fp32, in the layout the module reads ([out, in], or GPT-OSS's [in, out])."""
    h, i = shape.hidden, shape.intermediate
    scale = 1 / math.sqrt(h)
    if transposed:
        rows = {
            "gate_up_proj": torch.randn(h, 2 * i, generator=generator) * scale,
            "down_proj": torch.randn(i, h, generator=generator) * scale,
        }
    else:
        rows = {
            "gate_up_proj": torch.randn(2 * i, h, generator=generator) * scale,
            "down_proj": torch.randn(h, i, generator=generator) * scale,
        }
    if bias:
        rows["gate_up_proj_bias"] = torch.zeros(2 * i)
        rows["down_proj_bias"] = torch.zeros(h)
    return rows


def measure_shape(
    shape: ExpertShape,
    formats: Sequence[str],
    tokens: Sequence[int],
    dram_gbps: float,
    max_bytes: int,
    passes: int = 3,
    module: torch.nn.Module | None = None,
) -> list[Row]:
    from fmoe_local import hf_internals

    module = module if module is not None else experts_module(shape.family)
    transposed = hf_internals.is_transposed(module)
    bias = transposed and hf_internals.has_bias(module)
    generator = torch.Generator().manual_seed(0)
    target = max(4 * bandwidth.llc_bytes(), MIN_CYCLE_BYTES)
    rows: list[Row] = []
    for fmt in formats:
        try:
            kernels = cpu_experts.kernels_for(fmt, transposed)
        except ValueError:
            continue  # e.g. the packed integer kernels have no [in, out] product: GPT-OSS keeps the float ones
        pack = kernels[0].pack  # every candidate of a format reads the same stored form
        experts: list[dict[str, object]] = []
        stored = 0
        while len(experts) < 2 or (stored < target and stored + stored // len(experts) <= max_bytes):
            dense = dense_rows(shape, transposed, bias, generator)
            packed = {n: (pack(w) if not n.endswith("_bias") else w) for n, w in dense.items()}
            experts.append(packed)
            stored += sum(kernels[0].stored_bytes(w) for w in packed.values())
        timings = {
            (k.name, t): cpu_experts.time_kernel(k, module, experts, shape.hidden, tokens=t, passes=passes)
            for k in kernels
            for t in tokens
        }
        one = [timings[(k.name, min(tokens))] for k in kernels]
        chosen = cpu_experts.choose(one, kernels).name
        for (name, t), timing in timings.items():
            kernel = next(k for k in kernels if k.name == name)
            rows.append(
                Row(
                    shape.name,
                    fmt,
                    name,
                    kernel.precision,
                    t,
                    len(experts),
                    timing.seconds * 1e3,
                    timing.gbps,
                    timing.gbps / dram_gbps if dram_gbps > 0 else 0.0,
                    name == chosen,
                )
            )
        del experts
    return rows


def table(rows: Sequence[Row], dram_gbps: float) -> str:
    head = (
        f"DRAM read bandwidth measured here: {dram_gbps:.1f} GB/s ({torch.get_num_threads()} threads)\n\n"
        "| shape | format | kernel | computes in | tokens | experts cycled | ms / expert | ms / expert / token "
        "| GB/s of weights | % of DRAM | chosen |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r.shape} | {r.fmt} | {r.kernel} | {r.precision} | {r.tokens} | {r.experts} | {r.ms_per_expert:.2f} "
        f"| {r.ms_per_expert / r.tokens:.3f} | {r.gbps:.2f} | {100 * r.dram_fraction:.0f} % "
        f"| {'**yes**' if r.chosen and r.tokens == min(x.tokens for x in rows) else ''} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cpu-experts", help="time every CPU expert kernel per stored format and real expert shape, vs DRAM bandwidth"
    )
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated (default {','.join(SHAPES)})")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated (default {','.join(FORMATS)})")
    p.add_argument(
        "--tokens", type=whole_list(1), default=list(DEFAULT_TOKENS), help="tokens per call, comma-separated"
    )
    p.add_argument("--passes", type=whole(1), default=3, help="timed passes over the experts; the best counts")
    p.add_argument("--max-gb", type=number(above=0), default=1.5, help="most GB of experts held per (shape, format)")
    p.add_argument("--threads", type=whole(0), default=0, help="torch CPU threads (default: torch's own choice)")
    p.add_argument("--json", type=Path, help="also write the rows here")


def _choices(text: str, known: Sequence[str], what: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in known]
    if unknown or not chosen:
        raise ValueError(f"Unknown {what} '{', '.join(unknown) or text}'. Choose from: {', '.join(known)}.")
    return chosen


def run(args: argparse.Namespace) -> int:
    shapes = _choices(args.shapes, list(SHAPES), "shape")
    formats = _choices(args.formats, FORMATS, "format")
    tokens = sorted(set(args.tokens))  # each checked by its argument type (cli_args.py)
    if args.threads:
        torch.set_num_threads(args.threads)
    dram = bandwidth.dram_read_gbps()
    rows: list[Row] = []
    for name in shapes:
        rows += measure_shape(SHAPES[name], formats, tokens, dram, int(args.max_gb * 1e9), args.passes)
    print(table(rows, dram))
    if args.json:
        args.json.write_text(json.dumps({"dram_gbps": dram, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0
