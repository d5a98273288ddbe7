"""`fmoe-local bench live`: real TTFT, TPOT and hit rate of every policy on a real model, against all-resident.

Scope: prompts (a seeded sample of data/prompts or a file), one model load, then per policy and miss
handling (`--miss-handling copy,cpu,auto`) a fresh cold cache and an empty map store through `Runtime.reconfigure`,
the same prompts greedily, and last the all-resident baseline (every expert in the cache, warmed by one untimed
pass, its misses copied). Prints a table with the device's name, checks
that the greedy tokens are identical across runs (loudly, without stopping), writes --json. `--synthetic` runs the
same on a random model with real shapes whose routing is forced from a trace (fmoe_bench/synthetic.py). It does NOT
simulate anything (replay.py does) and uses the runtime only through its public API.

Order: one untimed 2-token request first takes one-time costs out of the first policy; each policy then gets its
cold cache from `reconfigure` + `reset_cache` and an empty map store from `clear_maps`; the all-resident baseline
runs last, so an out-of-memory there only skips it. Rows: mean TTFT, mean TPOT (requests with more than one
token), decode tok/s, pooled hit rate, stall s, bytes moved, TPOT / all-resident TPOT. `--synthetic NAME --layers
N`: a checkpoint with the model's real per-layer shapes (bf16 on CUDA, fp32 on CPU) written by save_pretrained and
loaded by our loader, so experts are really offloaded; routing forced by router hooks (synthetic.ForcedRouting).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

DEFAULT_POLICIES = "fmoe,moe_infinity,lru,lfu,on_demand"
RESIDENT = "all-resident"
DEFAULT_TRACE = "deepseek-v2-lite-intent.npz"


# ---- the benchmark -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LiveSettings:
    policies: tuple[str, ...] = tuple(DEFAULT_POLICIES.split(","))
    miss_handling: tuple[str, ...] = ("auto",)  # each policy runs under each (cpu_moe once: it forces cpu)
    cache_fraction: float | None = None  # of all experts; the default when none of the three is given is 0.25
    cache_gb: float | None = None
    cache_experts: int | None = None
    prefetch_distance: int = 3
    max_new_tokens: int = 32
    device: str = "auto"
    dtype: str = "auto"
    baseline: bool = True
    expert_format: str = "auto"  # RuntimeConfig.expert_format; the all-resident baseline uses the same
    dense_format: str = "auto"  # RuntimeConfig.dense_format, likewise
    quant_cache_dir: str | None = None  # synthetic runs keep their quantised copy beside their temporary model


@dataclass
class PolicyRow:
    policy: str
    cache_experts: int
    miss_handling: str = "copy"
    requests: int = 0
    ttft_s: float = 0.0  # mean over requests
    tpot_s: float = 0.0  # mean over requests that generated more than one token
    tokens_per_s: float = 0.0  # decode tokens after the first, over the time they took
    hits: int = 0
    late: int = 0  # prefetch still copying when needed: neither a hit nor a miss
    misses: int = 0
    on_host: int = 0  # misses the CPU computed
    stall_s: float = 0.0
    host_s: float = 0.0  # time computing misses on the CPU
    bytes_moved: int = 0
    prefetched: int = 0
    prefetch_wasted: int = 0
    wall_s: float = 0.0
    tpot_vs_resident: float | None = None
    request_ttft_s: list[float] = field(default_factory=list)
    request_tpot_s: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    expert_accesses: list[list[int]] = field(default_factory=list)  # [L][J] hits + late + misses

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.late + self.misses
        return self.hits / total if total else 0.0

    @property
    def label(self) -> str:
        return self.policy if self.policy == RESIDENT else f"{self.policy}+{self.miss_handling}"

    def to_dict(self) -> dict:
        return asdict(self) | {"hit_rate": self.hit_rate, "label": self.label}


def summarise(
    policy: str, cache_experts: int, finals: Sequence, wall_s: float, miss_handling: str = "copy"
) -> PolicyRow:
    """One row from the `Finished` events of a policy's requests."""
    import numpy as np

    stats = [f.stats for f in finals]
    row = PolicyRow(policy, cache_experts, miss_handling, requests=len(stats), wall_s=wall_s)
    row.ttft_s = sum(s.ttft_s for s in stats) / max(len(stats), 1)
    decoded = [s for s in stats if s.tokens > 1]
    row.tpot_s = sum(s.tpot_s for s in decoded) / len(decoded) if decoded else 0.0
    decode_time = sum(s.tpot_s * (s.tokens - 1) for s in decoded)
    row.tokens_per_s = sum(s.tokens - 1 for s in decoded) / decode_time if decode_time > 0 else 0.0
    for s in stats:
        row.hits, row.misses, row.stall_s = row.hits + s.hits, row.misses + s.misses, row.stall_s + s.stall_s
        row.late += s.late
        row.on_host, row.host_s = row.on_host + s.on_host, row.host_s + s.host_s
        row.bytes_moved += s.bytes_moved
        row.prefetched, row.prefetch_wasted = row.prefetched + s.prefetched, row.prefetch_wasted + s.prefetch_wasted
    row.request_ttft_s, row.request_tpot_s = [s.ttft_s for s in stats], [s.tpot_s for s in stats]
    row.prompt_tokens = [s.prompt_tokens for s in stats]
    row.token_ids = [list(f.token_ids) for f in finals]
    accesses = [
        np.asarray(s.layer_hits) + np.asarray(s.layer_misses) + np.asarray(s.layer_late or 0)
        for s in stats
        if s.layer_hits
    ]
    row.expert_accesses = np.sum(accesses, axis=0).tolist() if accesses else []
    return row


def _fresh_cache(runtime: object, policy: str, capacity: int, miss_handling: str = "copy") -> None:
    # A cold cache of `capacity` slots, and an empty map store so that no policy learns from another's run.
    runtime.reconfigure(policy=policy, cache_experts=capacity, miss_handling=miss_handling)
    runtime.reset_cache()
    runtime.clear_maps()


def capacity_of(settings: LiveSettings, info: object) -> int:
    """Cache slots from --cache-experts, --cache-gb or --cache-fraction (default 0.25 of every expert)."""
    from fmoe_local.cache_budget import slots_for_budget

    total = info.num_layers * info.num_experts
    if settings.cache_experts is not None:
        slots = settings.cache_experts
    elif settings.cache_gb is not None:
        slots = slots_for_budget(settings.cache_gb, info.expert_bytes)
    else:
        slots = int(total * (settings.cache_fraction if settings.cache_fraction is not None else 0.25))
    if slots < 1:
        raise ValueError(
            f"That cache holds no expert (one is {info.expert_bytes / 1e6:.1f} MB): give it more GB or experts."
        )
    return min(slots, total)


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({os.cpu_count()} cores)"


def benchmark(
    model_dir: Path,
    settings: LiveSettings,
    prompts: Sequence[str],
    routing: Callable[[object], object] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Every policy, then all-resident, on `prompts`; returns {"config", "rows", "lossless"}.

    `routing(runtime)`, when given, is called once after loading and returns an object whose `begin_request(i)` is
    called before request i (the synthetic mode forces routing that way).
    """
    import torch

    from fmoe_local.config import RuntimeConfig, Sampling
    from fmoe_local.runtime import Runtime

    sampling = Sampling(greedy=True, max_new_tokens=settings.max_new_tokens)
    config = RuntimeConfig(
        device=settings.device,
        dtype=settings.dtype,
        expert_format=settings.expert_format,
        dense_format=settings.dense_format,
        quant_cache_dir=settings.quant_cache_dir,
        cache_experts=1,  # resized below, once the model's shape is known
        prefetch_distance=settings.prefetch_distance,
        policy="on_demand",  # every measured policy is then built fresh by reconfigure
        prefix_cache_gb=0.0,  # each prompt prefilled whole, as the policies' earlier figures were measured
    )
    rows: list[PolicyRow] = []
    with Runtime.load(model_dir, config) as runtime:
        info = runtime.info
        capacity = capacity_of(settings, info)
        total = info.num_layers * info.num_experts
        forced = routing(runtime) if routing is not None else None

        def run_all(policy: str, slots: int) -> PolicyRow:
            t0 = time.perf_counter()
            finals = []
            for i, prompt in enumerate(prompts):
                if forced is not None:
                    forced.begin_request(i)
                final = runtime.generate([{"role": "user", "content": prompt}], sampling)
                if final.reason == "error":
                    raise RuntimeError(f"Generation failed with policy {policy}: {final.error}")
                finals.append(final)
            return summarise(policy, slots, finals, time.perf_counter() - t0, runtime.info.miss_handling)

        name = device_name(info.device)
        log(f"device: {name}")
        log(
            f"model {info.name} ({info.family}, {info.dtype}, experts {info.expert_format}): {info.num_layers} MoE layers x {info.num_experts} "
            f"experts, top-{info.top_k}, expert {info.expert_bytes / 1e6:.1f} MB; cache {capacity}/{total} experts "
            f"({capacity / total:.0%}); d={settings.prefetch_distance}; {len(prompts)} requests x "
            f"{settings.max_new_tokens} tokens, greedy"
        )
        _fresh_cache(runtime, "on_demand", capacity)
        if forced is not None:
            forced.begin_request(0)
        # One untimed request takes one-time costs (allocator, kernels, staging buffers) out of the first policy.
        runtime.generate([{"role": "user", "content": prompts[0]}], Sampling(greedy=True, max_new_tokens=2))
        for policy, misses in runs(settings):
            _fresh_cache(runtime, policy, capacity, misses)
            rows.append(run_all(policy, capacity))
            log(f"  {policy}+{rows[-1].miss_handling}: done in {rows[-1].wall_s:.1f} s")
        if settings.baseline:
            try:
                # Every expert resident: the misses of the filling pass are copied, whatever the setting.
                _fresh_cache(runtime, "on_demand", total, "copy")
                run_all(RESIDENT, total)  # fills the cache with every expert these prompts use
                rows.append(run_all(RESIDENT, total))
                log(f"  {RESIDENT}: done in {rows[-1].wall_s:.1f} s")
            except torch.OutOfMemoryError:
                log(f"  {RESIDENT}: skipped, {total} experts do not fit on {name}")
    resident = next((r for r in rows if r.policy == RESIDENT), None)
    for r in rows:
        if resident is not None and resident.tpot_s > 0:
            r.tpot_vs_resident = r.tpot_s / resident.tpot_s
    out_config = asdict(settings) | {
        "model": str(model_dir),
        "device_name": name,
        "device": info.device,
        "dtype": info.dtype,
        "expert_format": info.expert_format,
        "dense_format": info.dense_format,
        "num_layers": info.num_layers,
        "num_experts": info.num_experts,
        "top_k": info.top_k,
        "expert_bytes": info.expert_bytes,
        "cache_experts": capacity,
        "requests": len(prompts),
        "torch": torch.__version__,
    }
    lossless, line = lossless_check(rows, info.device)
    return {"config": out_config, "rows": [r.to_dict() for r in rows], "lossless": lossless, "lossless_line": line}


def runs(settings: LiveSettings) -> list[tuple[str, str]]:
    """(policy, miss handling) pairs in order; cpu_moe runs once, since it computes every miss on the CPU anyway."""
    out = []
    for policy in settings.policies:
        for misses in settings.miss_handling if policy != "cpu_moe" else ("cpu",):
            out.append((policy, misses))
    return out


def lossless_check(rows: Sequence[PolicyRow], device: str = "cpu") -> tuple[bool, str]:
    """Whether every run produced the same greedy tokens as the reference (all-resident, else the first policy).

    On a GPU a run whose misses the CPU computed is not held to that: the CPU's kernels round differently from the
    GPU's (bf16 sums in another order), so a near tie between two tokens can go the other way. Those runs are
    counted — how many replies agree — and only the runs computed wholly on the GPU must be identical."""
    if not rows:
        return True, "lossless: nothing was run"
    ref = next((r for r in rows if r.policy == RESIDENT), rows[0])
    gpu = str(device).startswith("cuda")
    mixed = [r for r in rows if gpu and r.on_host > 0]
    agreement = ""
    if mixed:
        same = sum(a == b for r in mixed for a, b in zip(r.token_ids, ref.token_ids, strict=True))
        total = sum(len(r.token_ids) for r in mixed)
        agreement = (
            f"; with misses computed on the CPU {same} of {total} replies identical to {ref.policy} (the CPU "
            "rounds differently from the GPU: not an error)"
        )
    exact = [r for r in rows if not (gpu and r.on_host > 0)]
    bad = {
        r.label: [i for i, (a, b) in enumerate(zip(r.token_ids, ref.token_ids, strict=True)) if a != b]
        for r in exact
        if r.token_ids != ref.token_ids
    }
    if not bad:
        return True, (
            f"lossless: greedy tokens identical across all {len(exact)} runs computed on the {'GPU' if gpu else 'CPU'} "
            f"({ref.requests} requests each){agreement}"
        )
    diffs = "; ".join(f"{p} (requests {', '.join(map(str, idx))})" for p, idx in bad.items())
    return False, f"!!! NOT LOSSLESS: greedy tokens differ from {ref.policy} for {diffs}{agreement}"


def print_table(result: dict) -> None:
    print(
        f"\n{'policy+misses':<20}{'cache':>7}{'TTFT ms':>10}{'TPOT ms':>10}{'tok/s':>9}{'hit rate':>10}{'late':>6}"
        f"{'on CPU':>8}{'stall s':>9}{'CPU s':>8}{'MB moved':>11}{'vs resident':>13}{'wall s':>8}"
    )
    for r in result["rows"]:
        vs = f"{r['tpot_vs_resident']:.2f}x" if r["tpot_vs_resident"] is not None else "-"
        print(
            f"{r['label']:<20}{r['cache_experts']:>7}{r['ttft_s'] * 1e3:>10.1f}{r['tpot_s'] * 1e3:>10.2f}"
            f"{r['tokens_per_s']:>9.1f}{r['hit_rate']:>10.3f}{r['late']:>6}{r['on_host']:>8}{r['stall_s']:>9.2f}"
            f"{r['host_s']:>8.2f}"
            f"{r['bytes_moved'] / 1e6:>11.1f}"
            f"{vs:>13}{r['wall_s']:>8.1f}"
        )
    print(result["lossless_line"])


def run_synthetic(
    name_or_shapes: str | dict,
    layers: int,
    trace_path: Path,
    prompts: Sequence[str],
    settings: LiveSettings,
    log: Callable[[str], None] = print,
) -> dict:
    """`benchmark` on a random model with real shapes (a SYNTHETIC name, or shapes for tests), routing from a trace.

    bf16 on CUDA; float32 on CPU (only sensible at tiny scale). The checkpoint lives in a temporary folder.
    """
    import torch

    from fmoe_bench.synthetic import SYNTHETIC, ForcedRouting, build_synthetic, experts_and_top_k, fold_trace
    from fmoe_local.architectures import architecture_for
    from fmoe_local.traces import load_trace

    if not Path(trace_path).exists():
        raise FileNotFoundError(f"No routing trace at {trace_path}: pass --trace FILE.npz (format in DESIGN.md).")
    shapes = SYNTHETIC[name_or_shapes] if isinstance(name_or_shapes, str) else name_or_shapes
    cuda = settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available())
    trace = load_trace(trace_path)
    folded = fold_trace(trace, layers, *experts_and_top_k(shapes), Path(trace_path).name)
    log(folded.mapping)

    def routing(runtime: object) -> ForcedRouting:
        model = runtime.engine.model
        refs = architecture_for(model.config).moe_layers(model)
        return ForcedRouting(folded, [r.router for r in refs], runtime.info.device).attach()

    with tempfile.TemporaryDirectory(prefix="fmoe-synthetic-") as tmp:
        t0 = time.perf_counter()
        dtype = "bfloat16" if cuda else "float32"
        build_synthetic(tmp, shapes, layers, prompts, dtype=dtype, init_device="cuda" if cuda else "cpu")
        log(f"synthetic model ({layers} layers, {dtype}) built in {time.perf_counter() - t0:.1f} s")
        result = benchmark(Path(tmp), replace(settings, quant_cache_dir=tmp), prompts, routing, log)
    label = name_or_shapes if isinstance(name_or_shapes, str) else "custom shapes"
    result["config"] |= {"synthetic": label, "layers": layers, "trace": str(trace_path), "mapping": folded.mapping}
    return result
