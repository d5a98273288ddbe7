"""Quantise-on-load, per Mixtral-8x7B expert: CPU time (time.process_time) and wall time of what a load does to
one expert it quantises (issue 26, item 5; the goal is ≤ 0.5 s of CPU per expert). Prints a table.

Per format: packing the expert's three [14336, 4096]-sized matrices (gate, up: [14336, 4096] each, down [4096, 14336];
random bf16 weights, as the checkpoint holds them) with expert_formats' packers; beside them the other per-expert
steps of a load: converting the bf16 rows to float32 whole (what a load did before packing until the packers
converted a block at a time: a "before" figure), torch's CPU int4 layout (Int4Weight.from_portable, made for every int4
expert a CPU device holds) and writing the packed expert to a safetensors file (what quant_cache writes per layer,
here one expert, fsync'd).

Run from the repository root: `python tools/pack_bench.py --threads 1,2 --repeats 2`. To time another checkout's
packers (the "before" of a change), put its root first: `PYTHONPATH=/path/to/other python tools/pack_bench.py`.

`--nf4-rounds N` times instead nf4's packers side by side on the same expert, interleaved N rounds in one process at
each of `--threads`' torch thread counts: the table on bf16 bits that `pack_nf4` uses for bf16 rows (its table made
first, once per process, and timed apart), the midpoint-counting packer it replaced (`pack_nf4_compares`, still the
one for float16/float32 rows), and bitsandbytes' `quantize_4bit(quant_type="nf4", blocksize=64)` where bitsandbytes is
importable (its CPU path). Each round's figures, then whether each packer's codes and block maxima equal the table's,
byte for byte.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from fmoe_local import expert_formats as ef

SHAPES = ((14336, 4096), (14336, 4096), (4096, 14336))  # Mixtral-8x7B: gate, up, down


def _timed(step: Callable[[], object], repeats: int) -> tuple[float, float, object]:
    """Best CPU seconds and best wall seconds over `repeats` runs (after one warm-up), and the last result."""
    result = step()
    cpu, wall = float("inf"), float("inf")
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        result = step()
        cpu, wall = min(cpu, time.process_time() - c), min(wall, time.perf_counter() - w)
    return cpu, wall, result


def _write(packed: list[dict[str, torch.Tensor]], folder: Path) -> None:
    tensors = {f"{i}.{k}": t.contiguous() for i, parts in enumerate(packed) for k, t in parts.items()}
    path = folder / "expert.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _bitsandbytes_nf4() -> Callable[[torch.Tensor], dict[str, torch.Tensor]] | None:
    """bitsandbytes' nf4 quantiser in our parts' form, or None where it is not installed (a test-only dependency)."""
    try:
        import bitsandbytes.functional as bnb
    except ImportError:
        return None

    def pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, state = bnb.quantize_4bit(w, blocksize=ef.NF4_BLOCK, quant_type="nf4")
        return {"q": q.view(-1), "absmax": state.absmax}

    return pack


def _nf4_rounds(weights: list[torch.Tensor], rounds: int, threads: list[int]) -> None:
    packers: dict[str, Callable[[torch.Tensor], dict[str, torch.Tensor]]] = {
        "table (pack_nf4, bf16 rows)": ef.pack_nf4,
        "counting midpoints (pack_nf4_compares, before)": ef.pack_nf4_compares,
    }
    bnb = _bitsandbytes_nf4()
    if bnb is not None:
        packers["bitsandbytes quantize_4bit"] = bnb
    c = time.process_time()
    ef._nf4_bf16_table()
    print(f"the table (once per process): {time.process_time() - c:.3f} s of CPU")
    print("| threads | round | nf4 packer, one Mixtral expert | CPU s | wall s | load average before → after |")
    print("|---|---|---|---|---|---|")
    results: dict[str, list[dict[str, torch.Tensor]]] = {}
    for t in threads:
        torch.set_num_threads(t)
        for r in range(rounds):
            for name, pack in packers.items():
                before = os.getloadavg()[0]
                c, w = time.process_time(), time.perf_counter()
                results[name] = [pack(x) for x in weights]
                cpu, wall = time.process_time() - c, time.perf_counter() - w
                load = f"{before:.1f} → {os.getloadavg()[0]:.1f}"
                print(f"| {t} | {r + 1} | {name} | {cpu:.3f} | {wall:.3f} | {load} |", flush=True)
    table = results[next(iter(packers))]
    for name, parts in results.items():
        differ = sum(int((p["q"] != t["q"]).sum()) for p, t in zip(parts, table, strict=True))
        maxima = all(torch.equal(p["absmax"], t["absmax"]) for p, t in zip(parts, table, strict=True))
        print(f"{name}: {differ} bytes differ from the table's, block maxima {'equal' if maxima else 'differ'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="torch thread counts to run, comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per step (the best counts)")
    parser.add_argument("--formats", default="int8,int4,nf4")
    parser.add_argument("--nf4-rounds", type=int, default=0, help="compare nf4's packers instead, interleaved")
    args = parser.parse_args()
    weights = [
        (torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 0.02).to(torch.bfloat16)
        for i, shape in enumerate(SHAPES)
    ]
    if args.nf4_rounds:
        _nf4_rounds(weights, args.nf4_rounds, [int(t) for t in args.threads.split(",")])
        return
    packers = {
        "int8": ef.pack_int8,
        "int4": lambda w: ef.pack_int4(w, torch.bfloat16),
        "nf4": ef.pack_nf4,
    }
    print(
        f"packers from {ef.__file__}; torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    print("| threads | step (one Mixtral expert) | CPU s | wall s | load average before → after |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            rows: list[tuple[str, Callable[[], object]]] = [
                ("read bf16 rows as float32", lambda: [w.float() for w in weights])
            ]
            for fmt in args.formats.split(","):
                rows.append((f"pack {fmt}", lambda f=packers[fmt]: [f(w) for w in weights]))
            for name, step in rows:
                before = os.getloadavg()[0]
                cpu, wall, result = _timed(step, args.repeats)
                print(
                    f"| {threads} | {name} | {cpu:.3f} | {wall:.3f} | {before:.1f} → {os.getloadavg()[0]:.1f} |",
                    flush=True,
                )
                if name == "pack int4":
                    before = os.getloadavg()[0]
                    cpu, wall, _ = _timed(
                        lambda r=result: [ef.Int4Weight.from_portable(p["q"]) for p in r], args.repeats
                    )
                    print(
                        f"| {threads} | int4: torch's CPU layout | {cpu:.3f} | {wall:.3f} | {before:.1f} → {os.getloadavg()[0]:.1f} |"
                    )
                if name.startswith("pack "):
                    before = os.getloadavg()[0]
                    cpu, wall, _ = _timed(lambda r=result: _write(r, Path(tmp)), args.repeats)
                    print(
                        f"| {threads} | {name[5:]}: write to disk | {cpu:.3f} | {wall:.3f} | {before:.1f} → {os.getloadavg()[0]:.1f} |"
                    )


if __name__ == "__main__":
    main()
