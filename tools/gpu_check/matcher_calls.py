"""The fmoe policy's own cost, apart from any contention: record its calls in a live run, replay them on one thread.

  python tools/gpu_check/matcher_calls.py record calls.pkl [--layers 16]   # a live CPU run, narrow Qwen3 shapes
  python tools/gpu_check/matcher_calls.py replay calls.pkl                 # any machine: ms per observed layer

The record runs `thread_time.py --narrow` (real L, J and K, small widths, routing from the shared trace) on the CPU
and keeps every call the runtime made on the fmoe policy, arguments copied. The replay makes a fresh policy of the
same shape and makes the same calls in the same order, so the figure is the policy's work alone (searches, eviction
keys, bookkeeping) on the machine that replays it.
"""

from __future__ import annotations

import argparse
import copy
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("begin_request", "begin_iteration", "observe_layer", "end_iteration", "end_request", "record_access")
METHODS += ("choose_victims", "set_capacity", "observe_iteration")


def record(out: Path, layers: int) -> None:
    import thread_time

    from fmoe_local.policies.fmoe import FMoEPolicy

    calls: list[tuple[str, tuple, dict]] = []
    for name in METHODS:
        original = getattr(FMoEPolicy, name)

        def recorded(self, *args, _original=original, _name=name, **kwargs):
            calls.append((_name, copy.deepcopy(args), kwargs))
            return _original(self, *args, **kwargs)

        setattr(FMoEPolicy, name, recorded)
    sys.argv = ["thread_time", "--device", "cpu", "--narrow", "--layers", str(layers), "--policies", "fmoe"]
    sys.argv += ["--miss-handling", "copy", "--modes", "threaded"]
    thread_time.main()
    out.write_bytes(pickle.dumps(calls))
    print(f"{len(calls)} calls written to {out}")


def replay(path: Path, repeats: int = 5) -> None:
    from fmoe_local.config import RuntimeConfig
    from fmoe_local.policies.base import ModelShape
    from fmoe_local.policies.fmoe import FMoEPolicy

    calls = pickle.loads(path.read_bytes())
    embed = next(a[0].size for m, a, _ in calls if m == "begin_iteration" and a[0] is not None)
    layers = 1 + max(a[0] for m, a, _ in calls if m == "observe_layer")
    capacity = next(a[0] for m, a, _ in calls if m == "set_capacity")
    # the recorded run's shape: narrow Qwen3 (128 experts, top-8) at d = 3, as `record` makes it
    shape, config = ModelShape(layers, 128, 8, embed), RuntimeConfig(prefetch_distance=3)

    def run() -> float:
        policy = FMoEPolicy(shape, config)
        t0 = time.perf_counter()
        for name, args, kwargs in calls:
            getattr(policy, name)(*args, **kwargs)
        return time.perf_counter() - t0

    run()
    best = min(run() for _ in range(repeats))
    counts = {name: sum(1 for c in calls if c[0] == name) for name in METHODS}
    print(f"L={layers} J=128 K=8 h={embed} cache {capacity} slots; calls {counts}")
    print(
        f"replay {best * 1e3:.1f} ms (best of {repeats}): {best * 1e3 / counts['observe_layer']:.3f} ms per observed layer"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("record", "replay"))
    ap.add_argument("path", type=Path)
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    if args.what == "record":
        record(args.path, args.layers)
    else:
        replay(args.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
