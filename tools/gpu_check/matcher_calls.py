"""The fmoe policy's own cost, apart from any contention: record its calls in a live run, replay them on one thread.

  python tools/gpu_check/matcher_calls.py record calls.pkl [--layers 16]   # a live CPU run, narrow Qwen3 shapes
  python tools/gpu_check/matcher_calls.py replay calls.pkl                 # any machine: ms per observed layer
  python tools/gpu_check/matcher_calls.py replay calls.pkl --check         # and every return value as recorded
  python tools/gpu_check/matcher_calls.py replay calls.pkl --split         # CPU time in each policy method
  python tools/gpu_check/matcher_calls.py replay calls.pkl --profile 30    # cProfile of one replay, top 30 rows

The record runs `thread_time.py --narrow` (real L, J and K, small widths, routing from the shared trace) on the CPU
and keeps every call the runtime made on the fmoe policy, arguments copied. The replay makes a fresh policy of the
same shape and makes the same calls in the same order, so the figure is the policy's work alone (searches, eviction
keys, bookkeeping) on the machine that replays it.

`record` also keeps what each call returned, and `--check` asserts a replay returns exactly that, call for call
(prefetches as (layer, expert, priority) triples, victims as lists): a faster policy must decide the same. The live
run's threads may interleave a call with another's lock-protected update, so the returns kept are those of a
single-threaded replay of the recorded calls by the code that recorded them (`--rebase` redoes that with the code
checked out, for a recording made before a change).
"""

from __future__ import annotations

import argparse
import copy
import pickle
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("begin_request", "begin_iteration", "observe_layer", "end_iteration", "end_request", "record_access")
METHODS += ("choose_victims", "set_capacity", "observe_iteration")


def record(out: Path, layers: int) -> None:
    import thread_time

    from fmoe_local.policies.fmoe import FMoEPolicy

    calls: list[tuple[str, tuple, dict]] = []
    live: list = []  # what each call returned in the live run (threads interleaved)
    order = threading.Lock()
    originals = {name: FMoEPolicy.__dict__.get(name) for name in METHODS}
    for name in METHODS:
        original = getattr(FMoEPolicy, name)

        def recorded(self, *args, _original=original, _name=name, **kwargs):
            with order:  # calls and live stay index-aligned across threads
                calls.append((_name, copy.deepcopy(args), copy.deepcopy(kwargs)))
                slot = len(live)
                live.append(None)
            value = _original(self, *args, **kwargs)
            live[slot] = _comparable(_name, value)
            return value

        setattr(FMoEPolicy, name, recorded)
    sys.argv = ["thread_time", "--device", "cpu", "--narrow", "--layers", str(layers), "--policies", "fmoe"]
    sys.argv += ["--miss-handling", "copy", "--modes", "threaded"]
    thread_time.main()
    for name, original in originals.items():  # the replay below runs the unpatched methods
        if original is None:
            delattr(FMoEPolicy, name)
        else:
            setattr(FMoEPolicy, name, original)
    returns = _returns(calls, _replay_policy(calls))
    out.write_bytes(pickle.dumps({"calls": calls, "returns": returns, "live_returns": live}))
    differ = sum(1 for a, b in zip(returns, live, strict=True) if a != b)
    print(f"{len(calls)} calls and their returns written to {out} ({differ} differ from the live run's)")


def _load(path: Path) -> tuple[list, list | None]:
    data = pickle.loads(path.read_bytes())
    if isinstance(data, list):  # a recording from before returns were kept
        return data, None
    return data["calls"], data["returns"]


def _replay_policy(calls: list):
    """A fresh policy of the recorded run's shape (narrow Qwen3: 128 experts, top-8, d = 3, as `record` makes it)."""
    from fmoe_local.config import RuntimeConfig
    from fmoe_local.policies.base import ModelShape
    from fmoe_local.policies.fmoe import FMoEPolicy

    embed = next(a[0].size for m, a, _ in calls if m == "begin_iteration" and a[0] is not None)
    layers = 1 + max(a[0] for m, a, _ in calls if m == "observe_layer")
    return lambda: FMoEPolicy(ModelShape(layers, 128, 8, embed), RuntimeConfig(prefetch_distance=3))


def _comparable(name: str, value):
    """A call's return as plain values: prefetches as (layer, expert, priority) triples, victims as a list."""
    if name in ("begin_iteration", "observe_layer"):
        return [(int(p.layer), int(p.expert), float(p.priority)) for p in value]
    if name == "choose_victims":
        return [(int(a), int(b)) for a, b in value]
    return value


def _returns(calls: list, make) -> list:
    policy = make()
    return [_comparable(name, getattr(policy, name)(*args, **kwargs)) for name, args, kwargs in calls]


def rebase(path: Path) -> None:
    calls, _ = _load(path)
    path.write_bytes(pickle.dumps({"calls": calls, "returns": _returns(calls, _replay_policy(calls))}))
    print(f"{path}: returns of this checkout's single-threaded replay kept")


def check(path: Path) -> None:
    calls, expected = _load(path)
    if expected is None:
        raise SystemExit(f"{path} holds no return values: record it again, or --rebase it with the reference code.")
    got = _returns(calls, _replay_policy(calls))
    for i, ((name, args, _), want, have) in enumerate(zip(calls, expected, got, strict=True)):
        if want != have:
            where = f" layer {args[0]}" if name == "observe_layer" else ""
            raise SystemExit(f"call {i} ({name}{where}) returned {have!r},\nrecorded {want!r}")
    counted = sum(1 for name, _, _ in calls if name in ("begin_iteration", "observe_layer", "choose_victims"))
    print(f"check: all {len(calls)} returns identical ({counted} prefetch lists and victim lists compared)")


def split(path: Path, repeats: int, warm_store: bool) -> None:
    """CPU ms per observed layer inside each policy method (the best of `repeats` replays by their sum)."""
    calls, _ = _load(path)
    make = _warmed(_replay_policy(calls)) if warm_store else _replay_policy(calls)
    layers = sum(1 for name, _, _ in calls if name == "observe_layer")
    best: dict[str, float] | None = None
    for _ in range(repeats + 1):  # the first one warms up
        policy, spent = make(), dict.fromkeys(METHODS, 0.0)
        for name, args, kwargs in calls:
            c0 = time.process_time()
            getattr(policy, name)(*args, **kwargs)
            spent[name] += time.process_time() - c0
        if best is None or sum(spent.values()) < sum(best.values()):
            best = spent
    parts = sorted(best.items(), key=lambda kv: -kv[1])
    print("CPU ms per observed layer: " + ", ".join(f"{k} {v * 1e3 / layers:.3f}" for k, v in parts if v > 0))


def profile(path: Path, rows: int) -> None:
    import cProfile
    import pstats

    calls, _ = _load(path)
    policy = _replay_policy(calls)()
    prof = cProfile.Profile(time.process_time)  # CPU time: a shared machine's waits for a core left out
    prof.enable()
    for name, args, kwargs in calls:
        getattr(policy, name)(*args, **kwargs)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows)


def _warmed(make):
    """`make` with the new store's arrays written once beforehand: the first map written to a fresh store
    page-faults its [L, J, C] arrays in (tens of ms, once per process), which a short replay would spread over its
    few hundred layers."""
    from fmoe_local.maps import ExpertMap

    def warmed():
        policy = make()
        shape = policy.shape
        policy.store.add(ExpertMap(np.zeros((shape.num_layers, shape.num_experts), np.float32), None, -1))
        policy.store.clear()
        return policy

    return warmed


def replay(path: Path, repeats: int = 5, warm_store: bool = False) -> None:
    calls, _ = _load(path)
    capacity = next(a[0] for m, a, _ in calls if m == "set_capacity")
    make = _replay_policy(calls)
    if warm_store:
        make = _warmed(make)
    layers = make().shape.num_layers
    embed = make().shape.embed_dim

    def run() -> tuple[float, float]:
        policy = make()
        t0, c0 = time.perf_counter(), time.process_time()
        for name, args, kwargs in calls:
            getattr(policy, name)(*args, **kwargs)
        return time.perf_counter() - t0, time.process_time() - c0

    run()
    times = [run() for _ in range(repeats)]
    wall, cpu = min(t[0] for t in times), min(t[1] for t in times)
    counts = {name: sum(1 for c in calls if c[0] == name) for name in METHODS}
    per = 1e3 / counts["observe_layer"]
    warm = ", store arrays written once before timing" if warm_store else ""
    print(f"L={layers} J=128 K=8 h={embed} cache {capacity} slots{warm}; calls {counts}")
    # The process's CPU time too: on a shared machine the wall time also counts waits for a core.
    print(
        f"replay {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU (best of {repeats}): "
        f"{wall * per:.3f} ms per observed layer (CPU {cpu * per:.3f})"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("record", "replay"))
    ap.add_argument("path", type=Path)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--check", action="store_true", help="assert every return equals the recorded one")
    ap.add_argument("--rebase", action="store_true", help="keep this checkout's returns as the recorded ones")
    ap.add_argument("--split", action="store_true", help="CPU time per observed layer in each policy method")
    ap.add_argument("--profile", type=int, metavar="ROWS", help="cProfile one replay, print the top ROWS by own time")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warm-store", action="store_true", help="fault the new store's arrays in before timing")
    args = ap.parse_args()
    if args.what == "record":
        record(args.path, args.layers)
    elif args.rebase:
        rebase(args.path)
    elif args.check:
        check(args.path)
    elif args.split:
        split(args.path, args.repeats, args.warm_store)
    elif args.profile:
        profile(args.path, args.profile)
    else:
        replay(args.path, args.repeats, args.warm_store)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
