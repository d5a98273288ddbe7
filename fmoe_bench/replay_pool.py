"""Replaying many policies on one schedule: every policy under every miss handling, optionally in worker processes.

Scope: the task list (policy × miss handling; a policy that forces its own miss handling runs once), handing tasks
to processes longest first, and results in the caller's order. It does NOT simulate anything (replay.py does) or
build policies (the caller's factory does).
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from fmoe_bench.presets import CostModel
from fmoe_bench.replay import LIVE_ONLY, ReplayResult, Schedule, replay
from fmoe_local.policies.base import Policy

PolicyFactory = Callable[[str, Schedule, int], Policy]

# Replay cost per policy (CPU seconds on the shared intent trace, load ≈ 5; docs/bench.md "Replay speed"): the
# policies go to the worker processes longest first, so the two long ones never share a worker and the short ones
# fill in behind them. Only the order matters; unknown names count as the cheapest.
REPLAY_COST = {"fmoe": 38.6, "moe_infinity": 18.9, "oracle": 7.9, "lfu": 6.2, "lru": 4.3, "on_demand": 4.0}

# What every task of one replay_all shares, set once per worker process (inherited when workers fork) rather than
# pickled with each task: a schedule is ~100 MB.
_shared: tuple = ()


def _share(*shared: object) -> None:
    global _shared
    _shared = shared


def forced(name: str) -> str | None:
    """The miss handling policy `name` forces (its `miss_handling` attribute, policies/base.py), if any."""
    from fmoe_local.policies import REGISTRY

    policy = REGISTRY.get(name)
    return None if policy is None else policy.miss_handling


def _replay_one(task: tuple[str, str]) -> ReplayResult:
    name, miss_handling = task
    schedule, factory, capacity, cost, mode, trace_name, warm_requests = _shared
    t0 = time.process_time()
    policy = factory(name, schedule, capacity)
    result = replay(
        schedule,
        policy,
        capacity,
        cost,
        mode,
        trace_name=trace_name,
        policy_name=name,
        miss_handling=miss_handling,
        warm_requests=warm_requests,
    )
    result.cpu_s = time.process_time() - t0
    return result


def replay_all(
    schedule: Schedule,
    names: list[str],
    factory: PolicyFactory,
    capacity: int,
    cost: CostModel,
    mode: str = "offline",
    trace_name: str = "",
    jobs: int = 1,
    miss_handling: Sequence[str] = ("copy",),
    warm_requests: int | None = None,
    progress: Callable[[ReplayResult, int, int], None] | None = None,
) -> list[ReplayResult]:
    """Every named policy under every miss handling on the same schedule, cache and costs; live-only policies get
    a note, not numbers. A policy that forces its own miss handling (cpu_moe) is replayed once.

    `warm_requests`: how many of the first requests only warm the policies (replay.replay), in either mode.
    `jobs` > 1 replays in that many processes (the factory must then be picklable where processes are spawned, not
    forked); results keep the order of `names` (then of `miss_handling`) either way, and each result does not
    depend on `jobs`. `progress(result, done, total)` is called as each run finishes (a replay takes minutes).
    """
    tasks = [
        (n, m)
        for n in dict.fromkeys(n for n in names if n not in LIVE_ONLY)
        for m in ((forced(n),) if forced(n) else dict.fromkeys(miss_handling))
    ]
    todo = sorted(tasks, key=lambda t: -REPLAY_COST.get(t[0], 0.0))
    shared = (schedule, factory, capacity, cost, mode, trace_name, warm_requests)
    if jobs > 1 and len(todo) > 1:
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        workers = min(jobs, len(todo))
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_share, initargs=shared) as pool:
            futures = [pool.submit(_replay_one, t) for t in todo]  # handed out in this order as workers come free
            done = []
            for future in as_completed(futures):
                done.append(future.result())
                if progress is not None:
                    progress(done[-1], len(done), len(todo))
    else:
        _share(*shared)
        try:
            done = []
            for t in todo:
                done.append(_replay_one(t))
                if progress is not None:
                    progress(done[-1], len(done), len(todo))
        finally:
            _share()
    by_task = {(r.policy, r.miss_handling): r for r in done}
    out = []
    for n in dict.fromkeys(names):
        if n in LIVE_ONLY:
            out.append(ReplayResult(trace_name, n, semantic_source=schedule.semantic_source, note=LIVE_ONLY[n]))
        out += [by_task[t] for t in tasks if t[0] == n]
    return out
