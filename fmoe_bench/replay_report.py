"""What `bench replay` prints and writes per result: the table per trace, the pooled line, the JSON rows.

Scope: formatting ReplayResults (with the speed-up against on_demand and the hit rate against the oracle). It does
NOT replay anything (replay.py, replay_pool.py) or parse arguments (cli.py).
"""

from __future__ import annotations

from fmoe_bench.parts import first_requests
from fmoe_bench.presets import CostModel
from fmoe_bench.replay import ReplayResult, Schedule


def rows(results: list[ReplayResult], first: list[int] | None = None) -> list[dict]:
    """Speed-ups are against on_demand with copied misses (the plain offloading baseline) where it ran, hit rates
    against the oracle under the same miss handling; with `first`, the hit rate over the first n measured requests
    per n (parts.first_requests)."""
    by = {(r.policy, r.miss_handling): r for r in results if not r.note}
    base = next((r.tpot_s for r in results if r.policy == "on_demand" and r.miss_handling == "copy"), None)
    base = base or next((r.tpot_s for r in results if r.policy == "on_demand"), None)
    out = []
    for r in results:
        d = r.to_dict()
        d["speedup_vs_on_demand"] = base / r.tpot_s if base and r.tpot_s else None
        oracle = by.get(("oracle", r.miss_handling))
        d["hit_rate_vs_oracle"] = r.hit_rate / oracle.hit_rate if oracle and oracle.hit_rate and not r.note else None
        if first:
            d["first_requests"] = [] if r.note else first_requests(r, first)
        out.append(d)
    return out


def print_table(name: str, model: str, s: Schedule, capacity: int, cost: CostModel, results, distance: int) -> None:
    total = s.shape.num_layers * s.shape.num_experts
    print(
        f"\n{name} ({model}): {s.num_iterations} iterations, {len(s.requests)} requests; "
        f"cache {capacity}/{total} experts ({capacity / total:.0%}); semantic input: {s.semantic_source}"
    )
    print(
        f"cost: expert {cost.expert_bytes / 1e6:.1f} MB, {cost.bandwidth / 1e9:.1f} GB/s "
        f"(load {cost.load_s * 1e3:.2f} ms), layer {cost.layer_time_s * 1e3:.3f} ms, "
        f"CPU {cost.cpu_s_1 * 1e3:.2f} ms per expert at one token; prefetch distance {distance}"
    )
    header = f"{'policy+misses':<20}{'hit rate':>9}{'vs oracle':>10}{'stalls':>9}{'stall s':>9}{'on CPU':>8}"
    print(header + f"{'CPU s':>7}{'TPOT ms':>9}{'speed-up':>9}{'prefetched':>11}{'late':>7}{'wasted':>8}{'wall s':>8}")
    for d in rows(results):
        if d["note"]:
            print(f"{d['policy']:<20}  {d['note']}")
            continue
        vs = f"{d['hit_rate_vs_oracle']:.2f}" if d["hit_rate_vs_oracle"] is not None else "-"
        sp = f"{d['speedup_vs_on_demand']:.2f}x" if d["speedup_vs_on_demand"] is not None else "-"
        print(
            f"{d['policy'] + '+' + d['miss_handling']:<20}{d['hit_rate']:>9.3f}{vs:>10}{d['stalls']:>9}"
            f"{d['stall_s']:>9.2f}{d['on_host']:>8}{d['host_s']:>7.2f}{d['tpot_s'] * 1e3:>9.2f}{sp:>9}"
            f"{d['prefetched']:>11}{d['late']:>7}{d['prefetch_wasted']:>8}{d['wall_s']:>8.1f}"
        )


def print_pooled(table: list[dict], names: list[str]) -> None:
    print("\nall traces pooled (hits / accesses):")
    labels = dict.fromkeys((r["policy"], r["miss_handling"]) for r in table if r["policy"] in names and not r["note"])
    for name, misses in labels:
        mine = [r for r in table if (r["policy"], r["miss_handling"]) == (name, misses) and not r["note"]]
        hits, total = sum(r["hits"] for r in mine), sum(r["hits"] + r["late"] + r["misses"] for r in mine)
        if total:
            print(f"{name + '+' + misses:<20}{hits / total:>9.3f}")


def print_first_requests(table: list[dict], mode: str) -> None:
    """One trace's hit rate over its first n measured requests, per policy; a count past the trace's end is
    printed once, as "all m"."""
    done = [d for d in table if not d["note"] and d.get("first_requests")]
    if not done:
        return
    columns = {}  # requests counted → label; counts past the end collapse into one "all m" column
    for f in done[0]["first_requests"]:
        columns.setdefault(f["requests"], f"all {f['requests']}" if f["all"] else f"first {f['n']}")
    start = "from an empty store" if mode == "online" else "after the offline warm-up"
    print(f"hit rate over the first requests measured ({mode}, {start}):")
    print(f"{'policy+misses':<20}" + "".join(f"{label:>11}" for label in columns.values()))
    for d in done:
        rates = {f["requests"]: f["hit_rate"] for f in d["first_requests"]}
        print(f"{d['policy'] + '+' + d['miss_handling']:<20}" + "".join(f"{rates[m]:>11.3f}" for m in columns))
