"""`fmoe-local bench …`: argument parsing and printing for the benchmarks.

Scope: `bench replay` (every policy on recorded traces, a table, --json, --plot, --sweep prefetch-distance), `bench
matcher` (map-search cost), `bench cpu-experts` (cpu_experts.py), `bench cpu-decode` (cpu_decode.py), and the wiring of
`bench live` (live_cli.py) and `bench overhead` (overhead.py), whose modules own their arguments. This module is the
`bench` Commands of fmoe_local/cli.py: app.py hands it to `cli.main`, which calls `add_parser(subparsers)` and
`run(args)`, so the runtime never imports the benchmarks; `python -m fmoe_bench.cli …` works on its own too. It does NOT
simulate anything itself (replay.py) and builds policies only through `policies.make_policy` (the oracle through
oracle.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from fmoe_bench import (
    constrained,
    cpu_decode,
    cpu_experts,
    live_cli,
    matcher,
    overhead,
    prefix,
    quality,
    record,
    replay_report,
)
from fmoe_bench.fold import fold, parse_fold
from fmoe_bench.oracle import OraclePolicy
from fmoe_bench.parts import learned_first, parse_counts, select_requests
from fmoe_bench.presets import BITS, CPU_EXPERT_GBPS, CPU_SOURCE, PRESETS, CostModel, cost_model
from fmoe_bench.replay import (
    FALLBACKS,
    LIVE_ONLY,
    MODES,
    ReplayResult,
    Schedule,
    build_schedule,
    capacity_for,
)
from fmoe_bench.replay_pool import replay_all
from fmoe_local.cli import check_distance, distance_arg
from fmoe_local.cli_args import SentenceParser, number, whole
from fmoe_local.config import MISS_HANDLING, SEMANTIC_MODES, RuntimeConfig
from fmoe_local.policies.base import Policy
from fmoe_local.prefetch_distance import distance_for
from fmoe_local.traces import load_trace

COMMAND = "bench"  # the sub-command fmoe_local/cli.py dispatches here (its Commands protocol)
DEFAULT_POLICIES = "fmoe,moe_infinity,lru,lfu,on_demand,oracle"
PLOT_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
SWEEP_DISTANCES = (1, 2, 3, 4, 5, 6)
D_INDEPENDENT = ("moe_infinity", "lru", "lfu", "on_demand", "oracle")  # policies that never look at d


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        COMMAND, help="replay routing traces through every policy; live timings; map-search cost; overhead"
    )
    sub = bench.add_subparsers(dest="bench_command", required=True)
    r = sub.add_parser("replay", help="simulate every policy on recorded routing traces (.npz)")
    r.add_argument("traces", nargs="+", type=Path, help="trace files (format: DESIGN.md)")
    r.add_argument("--preset", default="deepseek-v2-lite", choices=list(PRESETS), help="cost model of this model")
    wire = r.add_mutually_exclusive_group()
    wire.add_argument("--dtype", default="bf16", choices=list(BITS), help="expert weights on the wire")
    wire.add_argument(
        "--expert-format", dest="dtype", choices=list(BITS), help="the same: bytes per expert follow the format"
    )
    size = r.add_mutually_exclusive_group()
    size.add_argument(
        "--cache-fraction", type=number(above=0, most=1), help="cache slots as a fraction of all experts (default 0.25)"
    )
    size.add_argument("--cache-experts", type=whole(1), help="cache slots as a number of experts")
    size.add_argument("--cache-gb", type=number(above=0), help="cache budget in GB (slots = floor(GB / expert size))")
    r.add_argument(
        "--prefetch-distance",
        type=distance_arg,
        help="d, 1 to the trace's MoE layers less one, or 'auto': ⌈expert copy time / layer time⌉ + 1 from the cost "
        f"model (prefetch_distance.py); default {RuntimeConfig.prefetch_distance}",
    )
    r.add_argument("--store-capacity", type=whole(1), default=RuntimeConfig.store_capacity, help="C: maps kept")
    r.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated (default {DEFAULT_POLICIES})")
    r.add_argument("--mode", default="offline", choices=MODES, help="offline: first 70%% of requests only warm up")
    r.add_argument(
        "--requests",
        default="all",
        metavar="PART",
        help="replay only these requests of each trace: all, first-half, second-half (⌊n/2⌋ requests, then the "
        "rest) or a slice A:B of request indices (fmoe_bench/parts.py); default all",
    )
    r.add_argument(
        "--learn-first",
        type=Path,
        metavar="TRACE",
        help="the policies first learn every request of TRACE (its last one served), then every request of each "
        "trace is measured: a history of other work (--mode online only)",
    )
    r.add_argument(
        "--first-requests",
        metavar="N,N",
        help="also the hit rate over the first N measured requests, per policy (e.g. 10,50,200: a new user's start "
        "with --mode online)",
    )
    r.add_argument("--semantic-mode", default=RuntimeConfig.semantic_mode, choices=SEMANTIC_MODES)
    r.add_argument(
        "--semantic-fallback",
        default="request_map_mean",
        choices=FALLBACKS,
        help="semantic input when the trace has no embeddings",
    )
    r.add_argument(
        "--miss-handling",
        default="copy",
        help="comma list of copy, cpu, auto: each policy is replayed under each (cpu_moe only under cpu, which it "
        "forces); default copy",
    )
    r.add_argument(
        "--cpu-gbs",
        type=number(above=0),
        help=f"GB/s of expert weights the CPU computes through (default {CPU_EXPERT_GBPS}: {CPU_SOURCE})",
    )
    r.add_argument("--bandwidth-gbs", type=number(above=0), help="host→device GB/s (default 25, PCIe 4.0 x16)")
    r.add_argument("--expert-mb", type=number(above=0), help="override the preset's expert size (MB)")
    r.add_argument("--layer-time-ms", type=number(above=0), help="override the preset's decode time per MoE layer (ms)")
    r.add_argument(
        "--fold",
        metavar="JxK",
        help="fold every trace onto J experts and top-K first (e.g. 8x2: a few-expert stand-in, fmoe_bench/fold.py)",
    )
    r.add_argument("--json", type=Path, metavar="OUT", help="write config and results as JSON")
    r.add_argument("--plot", type=Path, metavar="OUT.png", help="plot hit rate vs cache fraction 0.1…0.6")
    r.add_argument("--sweep", choices=["prefetch-distance"], help="also vary d over 1…6")
    r.add_argument("--jobs", type=whole(1), default=2, help="policies replayed in parallel processes (default 2)")
    matcher.add_parser(sub)
    live_cli.add_parser(sub)
    overhead.add_parser(sub)
    quality.add_parser(sub)
    record.add_parser(sub)
    cpu_experts.add_parser(sub)
    constrained.add_parser(sub)
    prefix.add_parser(sub)
    cpu_decode.add_parser(sub)


def run(args: argparse.Namespace) -> int:
    runners = {
        "replay": run_replay,
        "matcher": matcher.run,
        "cpu-experts": cpu_experts.run,
        "cpu-decode": cpu_decode.run,
        "live": live_cli.run,
        "overhead": overhead.run,
        "constrained": constrained.run,
        "quality": quality.run,
        "record": record.run,
        "prefix": prefix.run,
    }
    if args.bench_command not in runners:
        raise ValueError(f"Unknown bench command '{args.bench_command}'.")
    return runners[args.bench_command](args)


class _Factory:
    """Builds a fresh policy per replay (picklable, so replays can run in worker processes)."""

    def __init__(self, args: argparse.Namespace, distance: int) -> None:
        self.store_capacity, self.semantic_mode, self.distance = args.store_capacity, args.semantic_mode, distance

    def __call__(self, name: str, schedule: Schedule, capacity: int) -> Policy:
        if name == "oracle":
            return OraclePolicy(schedule.shape, schedule.need_matrix(), capacity)
        from fmoe_local.maps import MapStore
        from fmoe_local.policies import make_policy

        config = RuntimeConfig(
            cache_experts=capacity,
            prefetch_distance=self.distance,
            policy=name,
            store_capacity=self.store_capacity,
            semantic_mode=self.semantic_mode,
        )
        store = MapStore.for_config(schedule.shape, config)
        return make_policy(name, schedule.shape, config, store)


def _policy_factory(args: argparse.Namespace, distance: int) -> _Factory:
    return _Factory(args, distance)


def _miss_handlings(text: str) -> list[str]:
    chosen = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in chosen if m not in MISS_HANDLING]
    if unknown or not chosen:
        raise ValueError(
            f"Unknown miss handling '{', '.join(unknown) or text}'. Give a comma list of: {', '.join(MISS_HANDLING)}."
        )
    return chosen


def _check_policies(names: list[str]) -> None:
    from fmoe_local.policies import REGISTRY

    known = [*REGISTRY, "oracle", *LIVE_ONLY]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"Unknown policy {', '.join(unknown)}. Choose from: {', '.join(dict.fromkeys(known))}.")


def _distance(args: argparse.Namespace, schedule: Schedule, cost: CostModel) -> int:
    """The d given, or with 'auto' the one the cost model's copy and layer times call for (prefetch_distance.py)."""
    if args.prefetch_distance != "auto":
        return args.prefetch_distance
    return distance_for(cost.load_s, cost.layer_time_s, schedule.shape.num_layers)


def _capacity(args: argparse.Namespace, schedule: Schedule, cost: CostModel, fraction: float | None = None) -> int:
    if fraction is not None:
        return capacity_for(schedule.shape, cache_fraction=fraction)
    if args.cache_gb is not None:
        return capacity_for(schedule.shape, cache_experts=int(args.cache_gb * 1e9 // cost.expert_bytes))
    if args.cache_experts is not None:
        return capacity_for(schedule.shape, cache_experts=args.cache_experts)
    return capacity_for(schedule.shape, cache_fraction=args.cache_fraction or 0.25)


def run_replay(args: argparse.Namespace) -> int:
    t0, cpu0 = time.perf_counter(), _cpu_s()
    args.started = t0  # the progress lines of the sweep and the curve count from here too
    asked = args.prefetch_distance  # None: the default, which is never refused for a shallow trace
    if asked is None:
        args.prefetch_distance = RuntimeConfig.prefetch_distance
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    _check_policies(names)
    folding = parse_fold(args.fold) if args.fold else None
    args.miss_handling = _miss_handlings(args.miss_handling)
    counts = parse_counts(args.first_requests) if args.first_requests else None
    learned = load_trace(args.learn_first) if args.learn_first else None
    if learned is not None and args.mode != "online":
        raise ValueError("--learn-first replaces the offline warm-up: use it with --mode online.")
    args.warm_requests = len(learned.requests()) if learned is not None else None  # the sweep and curve too
    cost = cost_model(args.preset, args.dtype, args.bandwidth_gbs, args.expert_mb, args.layer_time_ms, args.cpu_gbs)
    config = {
        "preset": args.preset,
        "dtype": args.dtype,
        "expert_bytes": cost.expert_bytes,
        "bandwidth_Bps": cost.bandwidth,
        "layer_time_s": cost.layer_time_s,
        "miss_handling": args.miss_handling,
        "cpu_expert_s": cost.cpu_s_1,
        "cpu_expert_s_per_token": cost.cpu_s_per_token,
        "cpu_source": f"{args.cpu_gbs} GB/s (--cpu-gbs)" if args.cpu_gbs else CPU_SOURCE,
        "prefetch_distance": args.prefetch_distance,
        "fold": args.fold,
        "store_capacity": args.store_capacity,
        "mode": args.mode,
        "requests": args.requests,
        "first_requests": counts,
        "learn_first": str(args.learn_first) if args.learn_first else None,
        "policies": names,
        "traces": [str(p) for p in args.traces],
    }
    out: dict = {"config": config, "results": []}
    schedules = {}
    for path in args.traces:
        trace = select_requests(load_trace(path), args.requests)
        if learned is not None:
            trace = learned_first(learned, trace)
        if folding is not None:
            trace = fold(trace, *folding)
        check_distance(asked, trace.num_layers, f"The trace {path.name}")
        schedule = build_schedule(trace, args.semantic_mode, args.semantic_fallback)
        schedules[path] = schedule
        capacity = _capacity(args, schedule, cost)
        config.setdefault("cache_experts", {})[path.name] = capacity
        distance = _distance(args, schedule, cost)
        config.setdefault("prefetch_distance_used", {})[path.name] = distance
        print(f"[{time.perf_counter() - t0:7.1f} s] {path.name}: replaying {', '.join(names)}", file=sys.stderr)
        results = replay_all(
            schedule,
            names,
            _policy_factory(args, distance),
            capacity,
            cost,
            args.mode,
            path.name,
            args.jobs,
            args.miss_handling,
            args.warm_requests,
            progress=_progress(path.name, t0),
        )
        replay_report.print_table(path.name, trace.model, schedule, capacity, cost, results, distance)
        rows = replay_report.rows(results, counts)
        if counts:
            replay_report.print_first_requests(rows, args.mode)
        out["results"].extend(rows)
    if len(args.traces) > 1:
        replay_report.print_pooled(out["results"], names)
    if args.sweep == "prefetch-distance":
        out["sweep"] = _sweep(args, schedules, names, cost)
    if args.plot is not None:
        out["curve"] = _curve(args, schedules, names, cost)
        _plot(out["curve"], names, args.plot, args)
        print(f"plot written to {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
        print(f"results written to {args.json}")
    print(
        f"total wall time {time.perf_counter() - t0:.1f} s, {_cpu_s() - cpu0:.1f} s CPU (this process and its workers)"
    )
    return 0


def _progress(trace: str, t0: float) -> Callable[[ReplayResult, int, int], None]:
    """A line on stderr per finished replay (one trace's policies take minutes), with the time since the start."""

    def say(r: ReplayResult, done: int, total: int) -> None:
        line = f"[{time.perf_counter() - t0:7.1f} s] {trace}: {r.policy}/{r.miss_handling} replayed ({done}/{total})"
        print(line, file=sys.stderr, flush=True)

    return say


def _cpu_s() -> float:
    """User + system CPU seconds of this process and of its finished child processes (only its own on Windows,
    which has no `resource` module)."""
    try:
        import resource
    except ImportError:
        return time.process_time()
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _sweep(args: argparse.Namespace, schedules: dict, names: list[str], cost: CostModel) -> list[dict]:
    first = args.miss_handling[:1]
    print(f"\nprefetch-distance sweep (hit rate, misses {first[0]}; policies that ignore d are replayed once):")
    print(f"{'trace':<34}{'policy':<13}" + "".join(f"{'d=' + str(d):>8}" for d in SWEEP_DISTANCES))
    fixed = [n for n in names if n in D_INDEPENDENT]
    varying = [n for n in names if n not in D_INDEPENDENT and n not in LIVE_ONLY]
    rows = []
    for path, schedule in schedules.items():
        capacity = _capacity(args, schedule, cost)
        rates: dict[str, list[float]] = {}
        for d in SWEEP_DISTANCES:
            todo = varying + (fixed if d == SWEEP_DISTANCES[0] else [])
            factory = _policy_factory(args, d)
            rest = (capacity, cost, args.mode, path.name, args.jobs, first, args.warm_requests)
            for r in replay_all(schedule, todo, factory, *rest, progress=_progress(f"{path.name} d={d}", args.started)):
                rates.setdefault(r.policy, []).append(r.hit_rate)
                rows.append({"trace": path.name, "policy": r.policy, "prefetch_distance": d, **_brief(r)})
        for name in varying + fixed:
            xs = rates[name] if name in varying else rates[name] * len(SWEEP_DISTANCES)
            print(f"{path.name:<34}{name:<13}" + "".join(f"{x:>8.3f}" for x in xs))
    return rows


def _curve(args: argparse.Namespace, schedules: dict, names: list[str], cost: CostModel) -> list[dict]:
    first = args.miss_handling[:1]  # the curve shows hit rates: one miss handling
    rows = []
    for path, schedule in schedules.items():
        for f in PLOT_FRACTIONS:
            capacity = _capacity(args, schedule, cost, fraction=f)
            factory = _policy_factory(args, _distance(args, schedule, cost))
            rest = (capacity, cost, args.mode, path.name, args.jobs, first, args.warm_requests)
            said = _progress(f"{path.name} cache {f:.0%}", args.started)
            for r in replay_all(schedule, names, factory, *rest, progress=said):
                if not r.note:
                    rows.append({"trace": path.name, "policy": r.policy, "cache_fraction": f, **_brief(r)})
    return rows


def _brief(r: ReplayResult) -> dict:
    d = asdict(r)
    return {k: d[k] for k in ("hits", "late", "misses", "stall_s")} | {"hit_rate": r.hit_rate, "tpot_s": r.tpot_s}


def _plot(rows: list[dict], names: list[str], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in rows))
    fig, axes = plt.subplots(1, len(traces), figsize=(5.5 * len(traces), 4.2), squeeze=False)
    for ax, trace in zip(axes[0], traces, strict=True):
        for name in names:
            pts = [(r["cache_fraction"], r["hit_rate"]) for r in rows if r["trace"] == trace and r["policy"] == name]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", label=name, linestyle="--" if name == "oracle" else "-")
        ax.set_title(f"{trace}\n{args.preset}, d={args.prefetch_distance}, {args.mode}", fontsize=9)
        ax.set_xlabel("cache size (fraction of all experts)")
        ax.set_ylabel("expert hit rate")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = SentenceParser(prog="python -m fmoe_bench.cli")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"fmoe-local bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
