"""Where a live run's time goes between threads: wall time inside each policy method and cache entry point, per
thread, for each policy × miss handling, under the interpreter's default GIL switch interval (5 ms) and a short one.

Why: on the H100 (session 15) fmoe had the best hit rate and the slowest TPOT, while moving fewer bytes than lru. The
forward thread, the loader thread (demand copies) and the prefetcher thread (the matcher) share one GIL: a thread
coming back from a GPU wait must get it from whichever thread holds it, and CPython hands it over only when the
holder blocks or after the switch interval. This shows how much each thread spends where, and whether a shorter
interval changes TPOT.

Builds one synthetic model (real shapes, random weights, routing forced from a trace) and runs fmoe_bench.live's
`benchmark` on it once per interval. Run from the repository root:
  python tools/gpu_check/thread_time.py [--shape qwen3-30b-a3b] [--layers 16] [--device cuda] [--narrow]
`--narrow` keeps L, J and K but makes every width small, so the same contention shows on a CPU.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fmoe_bench.live import LiveSettings, benchmark  # noqa: E402
from fmoe_bench.prompts import sample_prompts, shared_data_dir  # noqa: E402
from fmoe_bench.synthetic import SYNTHETIC, ForcedRouting, build_synthetic, experts_and_top_k, fold_trace  # noqa: E402
from fmoe_local.prefetcher import Prefetcher  # noqa: E402

THREADED_PUBLISH = Prefetcher.publish  # the shipped method, put back after an inline run
NARROW = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)

_time: dict[tuple[str, str, str], float] = collections.defaultdict(float)
_calls: collections.Counter = collections.Counter()


def _timed(cls: type, method: str) -> None:
    original = getattr(cls, method)

    @functools.wraps(original)
    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            key = (type(self).__name__, threading.current_thread().name, method)
            _time[key] += time.perf_counter() - t0
            _calls[key] += 1

    setattr(cls, method, timed)


def instrument() -> None:
    from fmoe_local.cache import ExpertCache
    from fmoe_local.policies._common import RecencyPolicy
    from fmoe_local.policies.fmoe import FMoEPolicy

    for cls in (FMoEPolicy, RecencyPolicy):
        for method in ("begin_iteration", "observe_layer", "end_iteration", "record_access", "choose_victims"):
            _timed(cls, method)
    for method in ("acquire", "try_prefetch"):
        if hasattr(ExpertCache, method):
            _timed(ExpertCache, method)


def _publish_inline(self, kind: str, layer: int = -1, value: object = None, lookahead: object = None) -> None:
    """Prefetcher.publish with the policy called here, on the forward thread, as synchronous mode does but without
    waiting for copies: the prefetcher thread then only copies."""
    if self.synchronous:
        return THREADED_PUBLISH(self, kind, layer, value, lookahead)
    event = self._event(kind, layer, value, lookahead)  # the forward pass's bookkeeping, as publish does it
    if event is None:
        return
    try:
        self._handle(event)
    except Exception as exc:  # noqa: BLE001 - reported as the worker's failures are
        self._fail(exc)
        self.raise_if_failed()
    with self._cond:
        self._idle.clear()
        self._cond.notify_all()


def inline_matcher(on: bool) -> None:
    """The experiment: the matcher on the forward thread (on) or on its own thread, as shipped (off)."""
    Prefetcher.publish = _publish_inline if on else THREADED_PUBLISH


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SYNTHETIC))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--narrow", action="store_true")
    ap.add_argument("--policies", default="fmoe,lru")
    ap.add_argument("--miss-handling", default="copy,auto")
    ap.add_argument("--intervals-ms", default="5")
    ap.add_argument(
        "--modes",
        default="threaded,inline",
        help="threaded: the matcher on the prefetcher thread; "
        "inline: on the forward thread, the prefetcher thread only copying",
    )
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()

    shapes = dict(SYNTHETIC[args.shape])
    if args.narrow:
        shapes |= NARROW | {"vocab_size": 2048}
        shapes["moe_intermediate_size" if "moe_intermediate_size" in shapes else "intermediate_size"] = 128
    data = shared_data_dir()
    prompts = sample_prompts(data / "prompts", args.requests, 0, 1500)
    trace_path = data / "traces" / "deepseek-v2-lite-intent.npz"
    from fmoe_local.architectures import architecture_for
    from fmoe_local.traces import load_trace

    folded = fold_trace(load_trace(trace_path), args.layers, *experts_and_top_k(shapes), trace_path.name)

    def routing(runtime: object) -> ForcedRouting:
        model = runtime.engine.model
        refs = architecture_for(model.config).moe_layers(model)
        return ForcedRouting(folded, [r.router for r in refs], runtime.info.device).attach()

    instrument()
    cuda = args.device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    with tempfile.TemporaryDirectory(prefix="fmoe-threads-") as tmp:
        t0 = time.perf_counter()
        build_synthetic(tmp, shapes, args.layers, prompts, dtype=dtype, init_device=args.device)
        print(
            f"{args.shape} x {args.layers} layers{' (narrow)' if args.narrow else ''} built in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        runs = [(ms, mode) for ms in args.intervals_ms.split(",") for mode in args.modes.split(",")]
        for ms, mode in runs:
            ms = float(ms)
            sys.setswitchinterval(ms / 1000)
            inline_matcher(mode == "inline")
            per_run: dict[str, list[tuple[tuple[str, str, str], int, float]]] = {}

            def log(line: str, per_run: dict = per_run) -> None:
                # benchmark logs "model ..." before the first run and "  <run>: done in ..." after each one
                if "done in" in line:
                    label = line.strip().split(":")[0]
                    per_run[label] = [(k, _calls[k], _time[k]) for k in sorted(_time, key=lambda k: -_time[k])]
                if line.startswith("model ") or "done in" in line:
                    _time.clear()
                    _calls.clear()

            settings = LiveSettings(
                policies=tuple(args.policies.split(",")),
                miss_handling=tuple(args.miss_handling.split(",")),
                device=args.device,
                max_new_tokens=args.tokens,
                baseline=False,
                quant_cache_dir=tmp,
            )
            result = benchmark(Path(tmp), settings, prompts, routing, log=log)
            print(f"\n== switch interval {ms} ms, matcher {mode} ==")
            for r in result["rows"]:
                print(
                    f"{r['label']:16s} TPOT {r['tpot_s'] * 1e3:8.2f} ms  hit {r['hit_rate']:.3f}  stall "
                    f"{r['stall_s']:.2f} s  CPU {r['host_s']:.2f} s  wall {r['wall_s']:.2f} s  "
                    f"MB {r['bytes_moved'] / 1e6:.0f}"
                )
            for label, entries in per_run.items():
                print(f"-- {label}: wall s in each method, per thread (calls, ms per call)")
                for (cls, thread, method), calls, total in entries:
                    if total >= 0.005:
                        print(
                            f"   {cls:14s} {thread[:20]:20s} {method:16s} {calls:7d} {total:8.3f} "
                            f"{total / calls * 1e3:8.3f}"
                        )
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
