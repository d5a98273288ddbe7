"""Replay: drive the runtime's own policy objects with recorded routing and a cost model instead of a model.

Scope: the runtime's cache rules (fmoe_local/slot_table.py) driven by a simulated copier (simcache.py: one
in-flight prefetch copy, on-demand loads) and the event order the runtime's prefetcher uses, timed by a `CostModel`;
hit/miss/stall accounting and simulated TPOT. It does NOT implement any policy (policies/ and fmoe_bench/oracle.py
do), print tables (fmoe_bench/cli.py) or run a model.

Timeline of one iteration (the runtime's order, prefetcher.py + cache.py):
  begin_iteration(semantic) → prefetches queued; then for each MoE layer l:
  1. transfer window: the copy engine moves up to bandwidth × layer time bytes of queued prefetches, highest priority
     first (the previous layer's compute, or the iteration's head for l = 0); one copy at a time, a copy may span
     windows; a prefetch claims its slot (evicting through `choose_victims`) when its copy starts.
  2. access: the needed experts are the recorded top-K of the iteration's rows (union over a prefill's tokens).
     Resident and copied → hit. A prefetch still copying is "late" (neither): it stalls only for its remaining bytes
     (the policy is told hit=True, as cache.acquire would). Else an on-demand load that stalls
     expert_bytes / bandwidth, prefetching paused meanwhile — or, when the miss handling sends it to the host (the
     runtime's MissPlanner.plan over the layer's misses, on the same figures: miss_handling copy | cpu | auto, or
     the policy's own, cpu_moe: cpu), no load at all and the CPU's time for that expert and its tokens
     (`CostModel.cpu_s`). The link's and the CPU's work for the layer run at once: the layer waits for the later.
     record_access (by the simulated cache, per chunk as cache.acquire does), then observe_layer(l, mean probs of
     the rows) → more prefetches.
  Queued prefetches for layers ≤ l (or an older iteration) are stale and dropped: the same PrefetchQueue
  (prefetch_queue.py) as the runtime's prefetcher.
Eviction candidates never include the experts in use (the current layer's; during a window, the previous layer's)
nor the copy in flight. `bandwidth = inf` makes every queued prefetch land before the next layer — the runtime's
synchronous prefetcher mode, which is how replay and runtime hit counts are compared.

Offline mode: the warm-up requests are only learned from (`_learn`), not simulated, except the last one, which is
served so that the measured requests find a warm cache.

Semantic embedding passed to begin_iteration: with recorded embeddings, the mean over the iteration's rows
("token") or over the request's rows so far ("running_mean"), per `RuntimeConfig.semantic_mode`. Without them the
fallback is named in the result: "prev_map" (the request's previous iteration's map, flattened [L·J]),
"request_map_mean" (mean of the request's earlier maps), or "none"; all fallbacks use only the past.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from fmoe_bench.presets import CostModel
from fmoe_bench.simcache import SimCache
from fmoe_local.config import MISS_HANDLING
from fmoe_local.miss_cost import MissPlanner
from fmoe_local.policies._common import learn_pass
from fmoe_local.policies.base import ModelShape, Policy
from fmoe_local.prefetch_queue import PrefetchQueue
from fmoe_local.stats import LayerCounters
from fmoe_local.traces import DECODE, Trace

MODES = ("offline", "online")
FALLBACKS = ("prev_map", "request_map_mean", "none")
LIVE_ONLY = {"speculative": "needs hidden states (live only)"}


@dataclass
class Schedule:
    """A trace laid out for replay, shared by every policy (and the oracle) replaying it."""

    shape: ModelShape
    needed: list[list[tuple[int, ...]]]  # [N iterations][L] experts accessed, in access order
    probs: np.ndarray  # [N, L, J] float32: mean distribution of the iteration's rows
    tokens: np.ndarray  # [N] rows per iteration
    decode: np.ndarray  # [N] bool
    request_of: np.ndarray  # [N] index into `requests`
    requests: list[int]  # seq ids, in order
    semantics: list[np.ndarray | None]  # [N] what begin_iteration receives
    semantic_source: str
    # Multi-row iterations (prefill): per layer, how many rows chose each expert of `needed`, in the same order —
    # what the miss handling decides with (a decode step's expert serves one token).
    counts: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)

    @property
    def num_iterations(self) -> int:
        return len(self.needed)

    def need_matrix(self) -> np.ndarray:
        """[N, L, J] bool: which experts each iteration accesses (the oracle's future knowledge)."""
        n, L, J = self.num_iterations, self.shape.num_layers, self.shape.num_experts
        m = np.zeros((n * L, J), bool)
        cells = [experts for layers in self.needed for experts in layers]  # [N·L] row by row
        sizes = np.fromiter(map(len, cells), np.int64, count=len(cells))
        experts = np.fromiter(itertools.chain.from_iterable(cells), np.int64, count=int(sizes.sum()))
        m[np.repeat(np.arange(n * L), sizes), experts] = True
        return m.reshape(n, L, J)


def build_schedule(trace: Trace, semantic_mode: str = "running_mean", fallback: str = "request_map_mean") -> Schedule:
    if fallback not in FALLBACKS:
        raise ValueError(f"Unknown semantic fallback '{fallback}'. Choose one of: {', '.join(FALLBACKS)}.")
    L, J = trace.num_layers, trace.num_experts
    iters = list(trace.iterations())
    n = len(iters)
    probs = np.zeros((n, L, J), np.float32)
    needed: list[list[tuple[int, ...]]] = []
    counts: dict[int, list[tuple[int, ...]]] = {}
    # Every row at once (decode steps are one row each: most of a trace), then per iteration only what remains.
    rows = trace.num_rows
    dist, sel = trace.distributions(0, rows), trace.selected(0, rows)  # [T, L, J], [T, L, K]
    complete = bool((sel >= 0).all())
    sel_lists = sel.tolist()
    starts = np.array([it.start for it in iters], np.int64)
    single = np.array([it.stop - it.start == 1 for it in iters], bool)
    probs[single] = dist[starts[single]]  # the mean of one row
    for i, it in enumerate(iters):
        if single[i]:
            row = sel_lists[it.start]
            needed.append(list(map(tuple, row)) if complete else [tuple(e for e in r if e >= 0) for r in row])
        else:
            probs[i] = dist[it.start : it.stop].mean(0)
            rows_sel = sel[it.start : it.stop]
            layers = []
            counts[i] = []
            for layer in range(L):
                ids, n = np.unique(rows_sel[:, layer], return_counts=True)
                keep = ids >= 0
                layers.append(tuple(ids[keep].tolist()))
                counts[i].append(tuple(n[keep].tolist()))
            needed.append(layers)
    seqs = [it.seq_id for it in iters]
    requests = list(dict.fromkeys(seqs))
    index = {s: r for r, s in enumerate(requests)}
    request_of = np.array([index[s] for s in seqs], np.int64)
    if trace.embeddings is not None:
        semantics, source, dim = _embedding_semantics(trace, iters, semantic_mode), f"embeddings ({semantic_mode})", 0
        dim = trace.embed_dim
    else:
        semantics, source, dim = _map_semantics(probs, request_of, fallback), f"fallback: {fallback}", L * J
        if fallback == "none":
            dim = 0
    shape = ModelShape(L, J, trace.top_k, dim)
    tokens = np.array([it.stop - it.start for it in iters], np.int64)
    decode = np.array([it.phase == DECODE for it in iters], bool)
    return Schedule(shape, needed, probs, tokens, decode, request_of, requests, semantics, source, counts)


def _embedding_semantics(trace: Trace, iters: list, mode: str) -> list[np.ndarray | None]:
    out: list[np.ndarray | None] = []
    total, count, seq = None, 0, None
    for it in iters:
        rows = trace.embeddings[it.start : it.stop]
        if mode == "token":
            out.append(rows.mean(0))
            continue
        if it.seq_id != seq:
            total, count, seq = np.zeros(rows.shape[1], np.float64), 0, it.seq_id
        total += rows.sum(0)
        count += rows.shape[0]
        out.append((total / count).astype(np.float32))
    return out


def _map_semantics(probs: np.ndarray, request_of: np.ndarray, fallback: str) -> list[np.ndarray | None]:
    out: list[np.ndarray | None] = []
    total, count = None, 0
    for i in range(probs.shape[0]):
        first = i == 0 or request_of[i] != request_of[i - 1]
        if first:
            total, count = np.zeros(probs.shape[1:], np.float64), 0
        if fallback == "none" or first:
            out.append(None)
        elif fallback == "prev_map":
            out.append(probs[i - 1].reshape(-1).copy())
        else:
            out.append((total / count).astype(np.float32).reshape(-1))
        total += probs[i]
        count += 1
    return out


@dataclass
class ReplayResult:
    trace: str
    policy: str
    miss_handling: str = "copy"  # in force: the one asked for, or the one the policy forces (cpu_moe: cpu)
    hits: int = 0
    misses: int = 0
    # Time the forward pass waited for copies (on-demand loads and unfinished prefetches) beyond the CPU's work on
    # the same layer's misses, which runs meanwhile.
    stall_s: float = 0.0
    compute_s: float = 0.0  # simulated layer compute of the measured iterations
    decode_s: float = 0.0  # compute + stalls of measured decode iterations
    decode_tokens: int = 0
    late: int = 0  # accesses whose prefetch was under way: they stall only for the bytes still to copy
    on_host: int = 0  # misses computed on the host instead of loaded
    host_s: float = 0.0  # time the forward pass spent computing them
    prefetched: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    bytes_moved: int = 0
    requests_measured: int = 0
    iterations_measured: int = 0
    semantic_source: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0  # CPU time of building the policy and replaying it (replay_all), the speed figure to compare
    note: str = ""  # set when the policy could not be replayed
    layer_hits: list[int] = field(default_factory=list)
    layer_misses: list[int] = field(default_factory=list)
    layer_late: list[int] = field(default_factory=list)
    # Per measured request, in order: hits and accesses (hits + late + misses) — the hit rate over a replay's first
    # n requests (fmoe_bench/parts.py), e.g. a new user's first 10 online.
    request_hits: list[int] = field(default_factory=list)
    request_accesses: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.policy}+{self.miss_handling}"

    @property
    def stalls(self) -> int:
        return self.misses + self.late

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.late + self.misses
        return self.hits / total if total else 0.0

    @property
    def tpot_s(self) -> float:
        """Simulated time per output token: Σ layer compute + stalls, per measured decode iteration."""
        return self.decode_s / self.decode_tokens if self.decode_tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(hit_rate=self.hit_rate, tpot_s=self.tpot_s, stalls=self.stalls)
        return d


def capacity_for(shape: ModelShape, cache_fraction: float | None = None, cache_experts: int | None = None) -> int:
    """Cache slots: an explicit count wins, else floor(fraction × L × J); never below one layer's top-K."""
    if cache_experts is not None:
        cap = cache_experts
    elif cache_fraction is not None:
        cap = math.floor(cache_fraction * shape.num_layers * shape.num_experts)
    else:
        raise ValueError("Give the cache size as a fraction of all experts or as a number of experts.")
    if cap < shape.top_k:
        raise ValueError(f"The cache needs at least {shape.top_k} expert slots (one layer's top-k); got {cap}.")
    return cap


def replay(
    schedule: Schedule,
    policy: Policy,
    capacity: int,
    cost: CostModel,
    mode: str = "offline",
    warm_fraction: float = 0.7,
    trace_name: str = "",
    policy_name: str | None = None,
    miss_handling: str = "copy",
    warm_requests: int | None = None,
) -> ReplayResult:
    """Replay `schedule` through `policy`. Offline: the first `warm_fraction` of the requests only warm the policy;
    `warm_requests`, in either mode, names how many do (another trace's requests put first: fmoe_bench/parts.py)."""
    if mode not in MODES:
        raise ValueError(f"Unknown replay mode '{mode}'. Choose offline or online.")
    if miss_handling not in MISS_HANDLING:
        raise ValueError(f"Unknown miss handling '{miss_handling}'. Choose from: {', '.join(MISS_HANDLING)}.")
    t0 = time.perf_counter()
    name = policy_name or policy.name
    shape = schedule.shape
    policy.set_capacity(capacity)  # as the engine does whenever it makes a cache
    planner = MissPlanner(miss_handling, cost.miss_costs(), policy.miss_handling)
    plan = None if planner.mode == "copy" else planner.plan
    sim = SimCache(shape, capacity, policy, cost)
    warm = int(warm_fraction * len(schedule.requests)) if mode == "offline" else 0
    if warm_requests is not None:
        warm = warm_requests
    result = ReplayResult(trace_name, name, planner.mode, semantic_source=schedule.semantic_source)
    queue = PrefetchQueue(shape.num_layers, shape.num_experts)
    before: LayerCounters | None = None
    transfer, access, push, observe_layer = sim.transfer, sim.access, queue.push, policy.observe_layer
    request = -1
    counted = (0, 0)  # hits, accesses when the current measured request began
    for i in range(schedule.num_iterations):
        r = int(schedule.request_of[i])
        if r != request:
            if request >= 0:
                policy.end_request()
                sim.end_request()
                queue.clear()
                if request >= warm:
                    counted = _count_request(result, sim.counters, counted)
            request = r
            if r == warm:
                before, counted = sim.counters.snapshot(), _totals(sim.counters)
            policy.begin_request(schedule.requests[r])
        measuring = r >= warm
        if r < warm - 1:  # the last warm-up request is served, so the measured part starts with a warm cache
            _learn(policy, schedule, i)
            continue
        sim.begin_iteration()
        queue.push(i, policy.begin_iteration(schedule.semantics[i]))
        layer_s = cost.layer_s(int(schedule.tokens[i]))
        budget = cost.bandwidth * layer_s
        stall_total = 0.0
        probs = schedule.probs[i]  # [L, J]
        counts = schedule.counts.get(i)
        for layer, experts in enumerate(schedule.needed[i]):
            transfer(budget, queue, i)
            stall, host = access(layer, experts, None if counts is None else counts[layer], plan)
            stall_total += stall + host
            push(i, observe_layer(layer, probs[layer]))
        policy.end_iteration()
        if measuring:
            result.iterations_measured += 1
            result.compute_s += layer_s * shape.num_layers
            if schedule.decode[i]:
                result.decode_s += layer_s * shape.num_layers + stall_total
                result.decode_tokens += 1
    if request >= 0:
        policy.end_request()
        sim.end_request()
        if request >= warm:
            _count_request(result, sim.counters, counted)
    measured = sim.counters.since(before) if before is not None else LayerCounters(shape.num_layers, shape.num_experts)
    result.hits, result.misses = int(measured.hits.sum()), int(measured.misses.sum())
    result.late = int(measured.late.sum())
    result.layer_hits = measured.hits.sum(1).tolist()
    result.layer_misses = measured.misses.sum(1).tolist()
    result.layer_late = measured.late.sum(1).tolist()
    result.stall_s = float(measured.stall_s)
    result.on_host, result.host_s = int(measured.on_host.sum()), float(measured.host_s)
    result.prefetched = int(measured.prefetched.sum())
    result.prefetch_used, result.prefetch_wasted = int(measured.prefetch_used), int(measured.prefetch_wasted)
    result.bytes_moved = int(measured.bytes_moved)
    result.requests_measured = len(schedule.requests) - warm
    result.wall_s = time.perf_counter() - t0
    return result


def _totals(counters: LayerCounters) -> tuple[int, int]:
    hits = int(counters.hits.sum())
    return hits, hits + int(counters.late.sum()) + int(counters.misses.sum())


def _count_request(result: ReplayResult, counters: LayerCounters, start: tuple[int, int]) -> tuple[int, int]:
    """Append the request that just ended (counts since `start`) to the result's per-request lists."""
    now = _totals(counters)
    result.request_hits.append(now[0] - start[0])
    result.request_accesses.append(now[1] - start[1])
    return now


def _learn(policy: Policy, schedule: Schedule, i: int) -> None:
    """A warm-up iteration: the policy learns from it (maps, EAMs, access counts) but nothing is simulated.

    The paper's offline split fills the map store with the first 70 % of requests; serving all of them through the
    simulated cache took most of a replay's time, and only the last one shapes the cache the measured part starts
    with.
    """
    for layer, experts in enumerate(schedule.needed[i]):
        policy.record_access(layer, list(experts), [True] * len(experts))
    learn_pass(policy, schedule.probs[i], schedule.semantics[i])
