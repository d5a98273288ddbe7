"""`fmoe-local bench cpu-decode`: decode tokens per second per expert format on a CPU-only machine, through the real
Runtime, next to the memory limit measured in the same run.

Scope: a synthetic checkpoint of a real model's widths (fmoe_bench/synthetic.py: random bf16 weights, `--layers` N),
loaded by `Runtime.load` once per (round, format) with `device` cpu, and N greedy tokens generated after a warm-up;
per format the table gives tok/s (1 / the runtime's own time per output token), the bytes one token must read
(K active experts per MoE layer at their stored size, plus every non-expert weight at its stored size — packed where
`--dense-format` packs it — but the input embedding table, of which a token reads one row), the memory limit (this
round's measured DRAM read bandwidth ÷ those bytes) and the share of it reached; and the same for the experts alone
(the runtime's host-compute time per token against the experts' bytes). It does NOT check numerics
(tests/test_runtime_quantized.py and tests/test_dense_formats.py do) or choose kernels.

The path measured is the one a CPU-only user's misses take: `miss_handling` cpu (what auto does without a GPU:
every miss computed by the CPU from the host copy, with the CPU device's own ops — torch's weight-only products for
int8/int4), and by default policy on_demand, so that no expert is ever copied within RAM into a cache slot and every
expert is computed where the host store holds it. `--policy fmoe` measures the default policy, whose prefetcher
copies predicted experts into RAM slots (hits are then computed from the slots with the same ops).

Method: formats interleaved in every round (the order reversed every other round, so a drifting machine load does
not favour one format), each round's DRAM figure (bandwidth.dram_read_gbps, all torch threads) measured at its
start; per format the medians over rounds of tok/s and of each round's own share of its limit. The compute dtype is
resolved once per format before the first round (`--dtype auto`: dtype_verdicts.resolve_dtype's probes, what a load
of that format would choose: int8/int4 keep bf16 where torch's products are faster so), and kept over the rounds. The prompt is one character, so the prefill is one token as every decode step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from fmoe_local.cli_args import whole
from fmoe_local.config import DENSE_FORMATS, DENSE_INT8_PRODUCTS

FORMATS = ("bf16", "int8", "int4", "nf4")
DTYPES = ("auto", "bfloat16", "float32")
PROMPT = "a"  # one byte: one token for any byte-level tokenizer
TEXT = (
    "A synthetic checkpoint: random weights with a real model's widths, for timing decode on the CPU. "
    "Every token reads the active experts and the rest of the model once."
)
MARKER = "fmoe-cpu-decode.json"  # what a kept checkpoint in --work-dir was built as
WARM_UP_TOKENS = 2


@dataclass(frozen=True)
class DecodeSettings:
    formats: tuple[str, ...] = FORMATS
    tokens: int = 32  # greedy tokens per timed generation
    rounds: int = 3
    dtype: str = "auto"
    policy: str = "on_demand"
    dense_format: str = "auto"  # RuntimeConfig.dense_format: auto packs the dense weights as int8/int4 experts
    dense_int8_product: str = "auto"  # RuntimeConfig.dense_int8_product: auto, torch or openvino


@dataclass(frozen=True)
class TokenBytes:
    """Bytes one decode token reads from memory (weights only: the KV cache of a short context is negligible)."""

    experts: int  # K × MoE layers × one expert's stored bytes
    resident: int  # every non-expert weight at its stored size (packed where the dense format packs), the input
    # embedding table counted as one row

    @property
    def total(self) -> int:
        return self.experts + self.resident


@dataclass(frozen=True)
class Sample:
    """One format in one round."""

    fmt: str
    tok_s: float
    experts_s: float  # the runtime's host-compute seconds per token (every expert is computed on the host)
    dram_gbps: float
    bytes: TokenBytes
    note: str = ""
    kernel: str = ""  # the host experts' kernel the load's probe chose (miss_cost.probe)
    dense: str = "bf16"  # the dense format in force (ModelInfo.dense_format)


@dataclass(frozen=True)
class Row:
    """One format over the rounds (medians)."""

    fmt: str
    dtype: str
    rounds: int
    tok_s: float
    bytes_per_token: int
    expert_bytes_per_token: int
    limit_tok_s: float  # DRAM GB/s ÷ bytes per token
    of_limit: float  # tok/s ÷ limit, per round, median
    experts_ms: float  # host-compute ms per token
    experts_of_limit: float  # (expert bytes ÷ DRAM GB/s) ÷ the experts' time, per round, median
    note: str = ""
    kernel: str = ""
    dense: str = "bf16"


def token_bytes(runtime: object) -> TokenBytes:
    """What one decode token of this loaded runtime reads: the K active experts of every MoE layer at their stored
    size, and every resident weight at its stored size (ModelInfo.resident_bytes: a packed dense weight counts its
    packed bytes; tied embeddings are one tensor, unless the head was packed into a copy of its own; the input table
    counts as the one row read; OpenVINO's repacked copy of the dense int8 codes is read instead of them, not beside
    them)."""
    info, model = runtime.info, runtime.engine.model
    resident = info.resident_bytes - info.dense_repacked_bytes
    table = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)  # None: no head, or a packed one (PackedLinear)
    if head is None or head.data_ptr() != table.data_ptr():  # not one tensor: the lookup reads one row of the table
        resident -= (table.shape[0] - 1) * table.shape[1] * table.element_size()
    experts = info.top_k * info.num_layers * info.expert_bytes
    return TokenBytes(int(experts), int(resident))


def compute_dtype(name: str, model_dir: Path, fmt: str = "auto") -> str:
    """The compute dtype `fmt` runs in: `name`, or with auto what a CPU load of this checkpoint in `fmt` chooses."""
    import torch

    from fmoe_local.dtype_verdicts import resolve_dtype
    from fmoe_local.loading import checkpoint_dtype

    if name != "auto":
        return name
    chosen = resolve_dtype("auto", torch.device("cpu"), partial(checkpoint_dtype, model_dir), expert_format=fmt)
    return str(chosen or checkpoint_dtype(model_dir)).removeprefix("torch.")


def _config(fmt: str, dtype: str, settings: DecodeSettings, quant_dir: Path, top_k: int) -> object:
    from fmoe_local.config import RuntimeConfig, Sampling

    return RuntimeConfig(
        device="cpu",
        dtype=dtype,
        expert_format=fmt,
        dense_format=settings.dense_format,
        dense_int8_product=settings.dense_int8_product,
        miss_handling="cpu",
        policy=settings.policy,
        # K slots: a token's experts fit (the one-token path), and on_demand never fills them (misses go to the CPU).
        cache_experts=top_k,
        quant_cache_dir=str(quant_dir),
        sampling=Sampling(greedy=True, max_new_tokens=settings.tokens),
    )


def _top_k(model_dir: Path) -> int:
    from fmoe_local.architectures import architecture_for
    from fmoe_local.loading import read_config

    config = read_config(model_dir)
    return architecture_for(config).top_k(config)


def measure_format(
    model_dir: Path, fmt: str, dtype: str, settings: DecodeSettings, quant_dir: Path, dram_gbps: float, saved: dict
) -> Sample:
    """Load `fmt`, warm up, generate `settings.tokens` greedy tokens and close. `saved`: the miss-cost figures of an
    earlier load of the same format, reused as the app reuses them (filled on the first load)."""
    from fmoe_local.config import Sampling
    from fmoe_local.runtime import Runtime

    config = _config(fmt, dtype, settings, quant_dir, _top_k(model_dir))
    with Runtime.load(model_dir, config, miss_costs=saved.get(fmt)) as runtime:
        saved[fmt] = runtime.miss_costs
        runtime.generate(PROMPT, Sampling(greedy=True, max_new_tokens=WARM_UP_TOKENS))
        final = runtime.generate(PROMPT)
        if final.error:
            raise RuntimeError(f"The {fmt} generation failed: {final.error}")
        stats = final.stats
        info = runtime.info
        everything = info.num_layers * info.num_experts * info.expert_bytes
        note = "" if info.host_ram_bytes >= everything else "some experts read from disk (RAM short)"
        counted = token_bytes(runtime)
    del runtime
    gc.collect()  # the engine holds reference cycles: without this the next format loads beside this one
    per_token = stats.host_s / max(stats.tokens, 1)
    kernel = saved[fmt].cpu_kernel
    dense = info.dense_format + (f" ({info.dense_product})" if info.dense_product else "")
    return Sample(fmt, stats.tokens_per_s, per_token, dram_gbps, counted, note, kernel, dense)


def summarise(samples: Sequence[Sample], dtypes: dict[str, str]) -> list[Row]:
    """One row per format (in the order first measured): medians over its rounds. `dtypes`: each format's compute
    dtype."""
    rows = []
    for fmt in dict.fromkeys(s.fmt for s in samples):
        mine = [s for s in samples if s.fmt == fmt]
        first = mine[0].bytes

        def median(values: Sequence[float]) -> float:
            return statistics.median(values)

        limit = [s.dram_gbps * 1e9 / s.bytes.total for s in mine]
        experts_limit_s = [s.bytes.experts / (s.dram_gbps * 1e9) for s in mine]
        rows.append(
            Row(
                fmt=fmt,
                dtype=dtypes[fmt],
                rounds=len(mine),
                tok_s=median([s.tok_s for s in mine]),
                bytes_per_token=first.total,
                expert_bytes_per_token=first.experts,
                limit_tok_s=median(limit),
                of_limit=median([s.tok_s / lim for s, lim in zip(mine, limit, strict=True)]),
                experts_ms=median([s.experts_s * 1e3 for s in mine]),
                experts_of_limit=median(
                    [t / s.experts_s if s.experts_s > 0 else 0.0 for s, t in zip(mine, experts_limit_s, strict=True)]
                ),
                note="; ".join(dict.fromkeys(s.note for s in mine if s.note)),
                kernel=", ".join(dict.fromkeys(s.kernel for s in mine)),
                dense=", ".join(dict.fromkeys(s.dense for s in mine)),
            )
        )
    return rows


def benchmark(
    model_dir: Path,
    settings: DecodeSettings,
    quant_dir: Path,
    log: Callable[[str], None] = lambda s: None,
    dram: Callable[[], float] | None = None,
) -> tuple[list[Row], dict]:
    """Every format of `settings`, interleaved over `settings.rounds` rounds. Returns the rows and what was run
    (dtype, DRAM figures, load averages). `dram`: the DRAM read measurement (default bandwidth.dram_read_gbps)."""
    from fmoe_local import bandwidth

    measure_dram = dram or bandwidth.dram_read_gbps
    dtypes = {fmt: compute_dtype(settings.dtype, model_dir, fmt) for fmt in settings.formats}
    log(f"compute dtype (--dtype {settings.dtype}): {', '.join(f'{f} {d}' for f, d in dtypes.items())}")
    one = set(dtypes.values())
    info: dict = {"dtype": one.pop() if len(one) == 1 else "per format", "dram_gbps": [], "loadavg": [_loadavg()]}
    samples: list[Sample] = []
    saved: dict = {}
    for r in range(settings.rounds):
        gbps = measure_dram()
        info["dram_gbps"].append(gbps)
        order = settings.formats if r % 2 == 0 else tuple(reversed(settings.formats))
        for fmt in order:
            t0 = time.perf_counter()
            sample = measure_format(model_dir, fmt, dtypes[fmt], settings, quant_dir, gbps, saved)
            samples.append(sample)
            log(
                f"round {r + 1}/{settings.rounds} {fmt}: {sample.tok_s:.2f} tok/s, DRAM {gbps:.1f} GB/s "
                f"({time.perf_counter() - t0:.0f} s with the load)"
            )
    info["loadavg"].append(_loadavg())
    return summarise(samples, dtypes), info


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # Windows has no load average
        return "n/a"


def table(rows: Sequence[Row], info: dict) -> str:
    import torch

    dram = info["dram_gbps"]
    head = (
        f"{info.get('model', 'model')}; computes in {info['dtype']}; CPU {info.get('cpu', platform.processor())}, "
        f"{torch.get_num_threads()} torch threads; DRAM read {statistics.median(dram):.1f} GB/s "
        f"(median of {len(dram)} rounds: {', '.join(f'{x:.1f}' for x in dram)}); load average "
        f"{' → '.join(info['loadavg'])}\n"
        "limit = DRAM read ÷ bytes per token; experts: the runtime's host-compute time per token against the active "
        "experts' bytes ÷ DRAM read\n\n"
        "| format | dense weights | computes in | tok/s | MB / token (experts + rest) | limit tok/s | % of limit "
        "| experts ms / token | experts % of their limit | experts' kernel | rounds | note |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r.fmt} | {r.dense} | {r.dtype} | {r.tok_s:.2f} | {r.bytes_per_token / 1e6:.1f} ({r.expert_bytes_per_token / 1e6:.1f} + "
        f"{(r.bytes_per_token - r.expert_bytes_per_token) / 1e6:.1f}) | {r.limit_tok_s:.1f} | {100 * r.of_limit:.0f} % "
        f"| {r.experts_ms:.1f} | {100 * r.experts_of_limit:.0f} % | {r.kernel} | {r.rounds} | {r.note} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


# ---- the synthetic checkpoint ----------------------------------------------------------------------------------------
def checkpoint(work_dir: Path, shape: str, layers: int, log: Callable[[str], None] = lambda s: None) -> Path:
    """The synthetic `shape` checkpoint with `layers` layers in `work_dir`: the one kept there when it was built the
    same way, else built now (random bf16 weights, seed 0)."""
    from fmoe_bench.synthetic import SYNTHETIC, build_synthetic

    out = work_dir / f"{shape}-{layers}-layers"
    want = {"shape": shape, "layers": layers, "fields": SYNTHETIC[shape], "text": TEXT}
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == want:
        log(f"reusing the synthetic checkpoint in {out}")
        return out
    t0 = time.perf_counter()
    build_synthetic(out, SYNTHETIC[shape], layers, [TEXT], dtype="bfloat16")
    marker.write_text(json.dumps(want))
    log(f"built the synthetic checkpoint ({layers} layers) in {time.perf_counter() - t0:.0f} s")
    return out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- command line ----------------------------------------------------------------------------------------------------
def _choices(text: str, known: Sequence[str], what: str) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [s for s in chosen if s not in known]
    if unknown or not chosen:
        raise ValueError(f"Unknown {what} '{', '.join(unknown) or text}'. Choose from: {', '.join(known)}.")
    return chosen


def add_arguments(p: argparse.ArgumentParser) -> None:
    from fmoe_bench.synthetic import SYNTHETIC

    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SYNTHETIC), help="real widths of this model")
    p.add_argument(
        "--layers",
        type=whole(1),
        default=2,
        help="layers of the synthetic checkpoint (default 2: 3.7 GB of bf16 weights for qwen3-30b-a3b, 7.6 GB in RAM "
        "where the compute dtype is float32; each layer adds 1.25 GB, twice that in float32)",
    )
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated (default {','.join(FORMATS)})")
    p.add_argument("--tokens", type=whole(2), default=DecodeSettings.tokens, help="greedy tokens per generation")
    p.add_argument("--rounds", type=whole(1), default=DecodeSettings.rounds, help="rounds over every format")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="compute dtype of every format (default auto)")
    p.add_argument(
        "--policy", default=DecodeSettings.policy, help="the runtime's policy (default on_demand: no copies in RAM)"
    )
    p.add_argument(
        "--dense-format",
        default=DecodeSettings.dense_format,
        choices=DENSE_FORMATS,
        help="how the dense linear weights are stored (default auto: as int8/int4 experts, else unquantised)",
    )
    p.add_argument(
        "--dense-int8-product",
        default=DecodeSettings.dense_int8_product,
        choices=DENSE_INT8_PRODUCTS,
        help="what multiplies dense weights packed int8 (default auto: the faster one on this machine)",
    )
    p.add_argument("--threads", type=whole(0), default=0, help="torch CPU threads (default: torch's own choice)")
    p.add_argument(
        "--work-dir", type=Path, help="keep the checkpoint and the quantised copies here (default: a temporary folder)"
    )
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the rows here")


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_arguments(
        sub.add_parser("cpu-decode", help="decode tok/s per expert format on the CPU vs the measured memory limit")
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from fmoe_local.policies import REGISTRY

    formats = _choices(args.formats, FORMATS, "format")
    if args.policy not in REGISTRY:
        raise ValueError(f"Unknown policy '{args.policy}'. Choose from: {', '.join(REGISTRY)}.")
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = DecodeSettings(
        formats, args.tokens, args.rounds, args.dtype, args.policy, args.dense_format, args.dense_int8_product
    )

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="fmoe-cpu-decode-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = checkpoint(work, args.shape, args.layers, log)
        rows, info = benchmark(model_dir, settings, work / "quantized", log)
    info |= {
        "model": f"{args.shape} widths, {args.layers} layers, random weights; device cpu, miss handling cpu, policy "
        f"{args.policy}; {args.tokens} greedy tokens per generation",
        "cpu": _cpu_name(),
    }
    print(table(rows, info))
    if args.json:
        args.json.write_text(json.dumps({"info": info, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    from fmoe_local.cli_args import SentenceParser

    p = SentenceParser(prog="python -m fmoe_bench.cpu_decode", description=__doc__)
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except (ValueError, FileNotFoundError) as exc:
        print(f"fmoe-local bench cpu-decode: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
