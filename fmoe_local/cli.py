"""Command line: `fmoe-local run …` (one prompt through the runtime), and the commands other packages add.

Scope: argument parsing and printing. It does NOT open the SQLite store itself (fmoe_local never imports store/):
app.py passes `persistence_for(store_path, model_dir, shape)` when it dispatches `run`, which is how `--store`
reaches the runtime. It does NOT know the benchmarks either: app.py hands `main` the bench's `Commands`
(fmoe_bench/cli.py), which add `bench …` to the parser and run it. With `--json` the LAST stdout line is one JSON
object {"text", "token_ids", "stats"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fmoe_local.cli_args import SentenceParser, number, seed, some_text, whole  # noqa: E402
from fmoe_local.config import EXPERT_FORMATS, POLICIES, RuntimeConfig, Sampling  # noqa: E402

# (store path, model dir) → (MapPersistence, close callable); provided by app.py, which may import store/.
PersistenceFactory = Callable[[Path, Path], tuple[object, Callable[[], None]]]


class Commands(Protocol):
    """A package's sub-command (fmoe_bench/cli.py's `bench`): it adds its parser and runs what it parsed."""

    COMMAND: str

    def add_parser(self, subparsers: argparse._SubParsersAction) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="answer one prompt with a model (the demo model when --model is not given)")
    p.add_argument("--model", help="model folder (a Hugging Face checkpoint); default: the built-in demo model")
    p.add_argument("--prompt", required=True, type=some_text)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-new-tokens", type=whole(1), default=Sampling.max_new_tokens)
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (reproducible)")
    p.add_argument("--temperature", type=number(0), default=Sampling.temperature)
    p.add_argument("--top-p", type=number(0, 1), default=Sampling.top_p)
    p.add_argument("--seed", type=seed)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--cache-gb", type=number(above=0), help="expert cache size on the device, in GB")
    size.add_argument("--cache-experts", type=whole(1), help="expert cache size as a number of experts")
    p.add_argument(
        "--prefetch-distance",
        type=distance_arg,
        help="d, 1 to the model's MoE layers less one, or 'auto': ⌈expert copy time / layer time⌉ + 1, measured "
        f"(copy at load, layer time per request; d starts at {RuntimeConfig.prefetch_distance}); default "
        f"{RuntimeConfig.prefetch_distance}, or the model's last layer for a shallower model",
    )
    p.add_argument("--policy", choices=POLICIES, default=RuntimeConfig.policy)
    p.add_argument(
        "--miss-handling",
        default=RuntimeConfig.miss_handling,
        help="a missing expert: auto (each layer's misses shared between copy and CPU from measured costs), copy (into the cache) or cpu (computed "
        "on the processor)",
    )
    add_expert_format_argument(p)
    p.add_argument("--store", type=Path, help="SQLite file that keeps expert maps between runs")
    p.add_argument("--store-capacity", type=whole(1), default=RuntimeConfig.store_capacity)
    p.add_argument("--device", default=RuntimeConfig.device, help="auto, cpu or cuda")
    p.add_argument("--dtype", default=RuntimeConfig.dtype, help="auto, float32, bfloat16 or float16")
    p.add_argument("--record-trace", type=Path, help="write what the runtime saw to this .npz (trace format)")
    p.add_argument("--synchronous", action="store_true", help="match and copy inline (deterministic hit counts)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def distance_arg(text: str) -> int | str:
    """`--prefetch-distance` of run and bench replay: a number of layers, or 'auto' (prefetch_distance.py)."""
    if text == "auto":
        return text
    try:
        d = int(text)
    except ValueError:
        d = 0
    if d < 1:
        raise argparse.ArgumentTypeError(f"give d as a whole number of layers, 1 or more, or 'auto' (got '{text}')")
    return d


def add_expert_format_argument(p: argparse.ArgumentParser) -> None:
    """`--expert-format` and `--dense-format` (run, bench live): validated by RuntimeConfig, so a wrong value is one
    sentence."""
    from fmoe_local.expert_formats import LABELS

    p.add_argument(
        "--expert-format",
        default=RuntimeConfig.expert_format,
        help="how experts are stored: " + "; ".join(LABELS[f] for f in EXPERT_FORMATS),
    )
    p.add_argument(
        "--dense-format",
        default=RuntimeConfig.dense_format,
        help="how the linear weights outside the experts (attention, output head, shared experts) are stored: auto "
        "(as int8/int4 experts on a CPU device, else unquantised), bf16 (unquantised), int8 or int4 (CPU device only)",
    )
    p.add_argument(
        "--dense-int8-product",
        default=RuntimeConfig.dense_int8_product,
        help="what multiplies dense weights packed int8: auto (the faster one on this machine for each weight's size), "
        "torch or openvino",
    )


def config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    base = RuntimeConfig()
    distance = args.prefetch_distance
    return RuntimeConfig(
        device=args.device,
        dtype=args.dtype,
        cache_gb=args.cache_gb if args.cache_gb is not None else base.cache_gb,
        cache_experts=args.cache_experts,
        prefetch_distance=base.prefetch_distance if distance in (None, "auto") else distance,
        prefetch_distance_auto=distance == "auto",
        policy=args.policy,
        miss_handling=args.miss_handling,
        expert_format=args.expert_format,
        dense_format=args.dense_format,
        dense_int8_product=args.dense_int8_product,
        store_capacity=args.store_capacity,
        synchronous_prefetch=args.synchronous,
        record_trace=str(args.record_trace) if args.record_trace else None,
        sampling=Sampling(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            greedy=args.greedy,
            seed=args.seed,
        ),
    )


def moe_layer_count(model_dir: Path) -> int:
    """How many MoE layers the model in `model_dir` has, from its config.json alone (before any weight is read)."""
    from fmoe_local.architectures import architecture_for
    from fmoe_local.loading import read_config

    hf_config = read_config(model_dir)
    return len(architecture_for(hf_config).moe_layer_indices(hf_config))


def check_distance(asked: int | str | None, layers: int, what: str = "This model") -> None:
    """Refuse (ValueError, the Settings tab's sentence) a d the user asked for beyond `layers` MoE layers: run with
    it, no prefetch ever landed on a layer of the pass that planned it (a hit rate of 0, silently)."""
    from fmoe_local.prefetch_distance import max_distance

    top = max_distance(layers)
    if isinstance(asked, int) and asked > top:
        raise ValueError(
            f"{what} has {layers} MoE layers: the prefetch distance can be 1 to {top}. Give --prefetch-distance "
            f"{top} or less, or leave it out."
        )


def fit_distance(config: RuntimeConfig, asked: int | str | None, layers: int) -> RuntimeConfig:
    """`config` with d within a model of `layers` MoE layers: a d asked for beyond them is refused
    (check_distance); the default, or auto's starting value, is cut to the model's last layer, as the app does with
    a saved d."""
    from fmoe_local.prefetch_distance import max_distance

    check_distance(asked, layers)
    return config.with_changes(prefetch_distance=min(config.prefetch_distance, max_distance(layers)))


def default_model_dir() -> Path:
    from fmoe_local.demo import demo_model_dir

    return demo_model_dir()


def run_command(args: argparse.Namespace, persistence_factory: PersistenceFactory | None = None) -> int:
    from fmoe_local.runtime import Runtime
    from fmoe_local.runtime_types import Finished, TextDelta

    model_dir = Path(args.model) if args.model else default_model_dir()
    if args.store is not None and persistence_factory is None:
        print("--store needs the app's store package: run it as `fmoe-local run …`.", file=sys.stderr)
        return 2
    config = config_from_args(args)
    config.validate()  # the flags alone: refused before the model's files are read
    try:
        layers = moe_layer_count(model_dir)
    except (OSError, ValueError) as exc:
        return could_not_load(model_dir, exc)
    config = fit_distance(config, args.prefetch_distance, layers)
    persistence, close_store = None, lambda: None
    if args.store is not None:
        persistence, close_store = persistence_factory(args.store, model_dir)
    try:
        runtime = Runtime.load(model_dir, config, map_persistence=persistence)
    except (OSError, ValueError) as exc:  # a damaged or incomplete checkpoint: the app's sentence, not a traceback
        close_store()
        return could_not_load(model_dir, exc)
    except BaseException:
        close_store()
        raise
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    try:
        with runtime:
            final = None
            for event in runtime.submit(messages):  # Ctrl+C: close() below ends the request
                if isinstance(event, TextDelta) and not args.json:
                    print(event.text, end="", flush=True)
                elif isinstance(event, Finished):
                    final = event
    finally:
        close_store()
    if final.reason == "error":
        print(f"\nGeneration failed: {final.error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"text": final.text, "token_ids": final.token_ids, "stats": final.stats.to_dict()}))
    else:
        s = final.stats
        print(
            f"\n\n[{s.tokens} tokens · {s.tokens_per_s:.1f} tok/s · TTFT {s.ttft_s * 1000:.0f} ms · "
            f"expert hit rate {s.hit_rate:.0%}]"
        )
    return 0


def could_not_load(model_dir: Path, exc: BaseException) -> int:
    """The Models tab's sentence for a model that cannot load (ui/session.py), on one line, exit code 2."""
    said = " ".join(str(exc).split()) or type(exc).__name__
    print(f"fmoe-local: Could not load {model_dir.name}: {said}", file=sys.stderr)
    return 2


def build_parser(extra: Sequence[Commands] = ()) -> argparse.ArgumentParser:
    parser = SentenceParser(prog="fmoe-local", description="Chat with MoE models larger than your GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_parser(sub)
    for commands in extra:
        commands.add_parser(sub)
    return parser


def main(
    argv: list[str] | None = None,
    persistence_factory: PersistenceFactory | None = None,
    extra: Sequence[Commands] = (),
) -> int:
    args = build_parser(extra).parse_args(argv)
    try:
        if args.command == "run":
            return run_command(args, persistence_factory)
        (commands,) = [c for c in extra if c.COMMAND == args.command]
        return commands.run(args) or 0
    except (ValueError, FileNotFoundError) as exc:
        print(f"fmoe-local: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
