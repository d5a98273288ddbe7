"""The lossless matrix on a CUDA GPU: the runtime's greedy tokens against transformers eager on the same device.

For every tiny family: float32 and bf16 compute, experts stored as bf16 (the compute dtype), int8 and nf4; misses
copied to the GPU (fmoe, lru, on_demand) and computed on the CPU (fmoe and on_demand with `cpu`, `auto`, cpu_moe);
a cache of K experts, and all experts for fmoe. The reference runs eager on the GPU in the same dtype on the same
(dequantised) weights. A CPU-computed miss in bf16 is not expected to match the GPU's bf16 bit for bit (other
kernels, other summation order), so those runs are counted, not asserted: the table says how many replies were
identical. Prints one line per configuration and a summary; exits 1 when a copy-only run differs.

Run from the repository root: `python tools/gpu_check/lossless.py [--deadline-s 150]`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fmoe_local.config import RuntimeConfig, Sampling  # noqa: E402
from fmoe_local.runtime import Runtime  # noqa: E402
from tests.test_runtime_quantized import dequantise_experts  # noqa: E402
from tests.tiny import FAMILIES, build_tiny_model  # noqa: E402

PROMPT = [{"role": "user", "content": "Tell me about the ocean and the waves."}]
NEW_TOKENS = 8
RUNS = [("fmoe", "copy"), ("lru", "copy"), ("on_demand", "copy"), ("fmoe", "cpu"), ("on_demand", "cpu")]
RUNS += [("fmoe", "auto"), ("cpu_moe", "auto")]
CONFIGS = [("float32", "bf16"), ("bfloat16", "bf16"), ("float32", "int8"), ("float32", "nf4"), ("bfloat16", "nf4")]
CONFIGS += [("float32", "int4"), ("bfloat16", "int4")]
# bf16 compute on packed experts: this reference does not yet reproduce the CPU run's tokens either (the CPU suite
# checks packed formats in float32 only), so these runs are counted, not asserted.
# bf16 int4 hits on a GPU go through torch's int4 product (tinygemm), which rounds otherwise than eager's bf16 product.
COUNTED_ONLY = {("bfloat16", "int8"), ("bfloat16", "nf4"), ("bfloat16", "int4")}


@torch.no_grad()
def reference(model_dir: Path, dtype: str, fmt: str, ids: torch.Tensor, device: str) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32)
    model.eval()
    if fmt != "bf16":
        dequantise_experts(model, fmt, getattr(torch, dtype))  # what the runtime's PackedRows give in that dtype
    model = model.to(device, getattr(torch, dtype))
    out = model.generate(ids.to(device), do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return out[0, ids.shape[1] :].tolist()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--deadline-s", type=float, default=150.0, help="stop starting new configurations after this")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--device", default="cuda", help="cpu only to try the script where there is no GPU")
    p.add_argument("--formats", default="", help="only these expert formats, comma-separated (default: all)")
    args = p.parse_args()
    t0 = time.perf_counter()
    counts = {"copy": [0, 0], "host": [0, 0]}  # [identical, runs]
    copy_failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            model_dir = build_tiny_model(family, Path(tmp) / family)
            for dtype, fmt in [c for c in CONFIGS if not args.formats or c[1] in args.formats.split(",")]:
                if time.perf_counter() - t0 > args.deadline_s:
                    print(f"deadline reached: {family} {dtype} {fmt} and later not run", flush=True)
                    break
                config = RuntimeConfig(
                    device=args.device, dtype=dtype, cache_experts=1, expert_format=fmt,
                    quant_cache_dir=str(Path(tmp) / "q"), sampling=Sampling(greedy=True, max_new_tokens=NEW_TOKENS),
                )  # fmt: skip
                try:
                    with Runtime.load(model_dir, config) as runtime:
                        engine = runtime.engine
                        ids = engine.encode_prompt(PROMPT)
                        expected = reference(model_dir, dtype, fmt, ids, args.device)
                        k, total = engine.shape.top_k, engine.shape.num_layers * engine.shape.num_experts
                        marks = []
                        for policy, misses in [*RUNS, ("fmoe-all", "copy")]:
                            slots = total if policy == "fmoe-all" else k
                            runtime.reconfigure(cache_experts=slots, policy=policy.split("-")[0], miss_handling=misses)
                            final = runtime.generate(PROMPT)
                            got = final.token_ids
                            same = bool(got) and got == expected[: len(got)]
                            host = final.stats.on_host > 0
                            kind = "host" if host else "copy"
                            counts[kind][0] += same
                            counts[kind][1] += 1
                            marks.append(f"{policy}/{misses}{'=' if same else '≠'}{'h' if host else ''}")
                            if not same and not host and (dtype, fmt) not in COUNTED_ONLY:
                                copy_failures.append(f"{family} {dtype} {fmt} {policy} {misses}: {got} vs {expected}")
                            if final.reason == "error":
                                marks[-1] += f"[error: {final.error}]"
                    print(f"{family:12s} {dtype:9s} {fmt:5s} " + " ".join(marks), flush=True)
                except Exception as exc:  # a broken configuration must not hide the others' results
                    print(f"{family:12s} {dtype:9s} {fmt:5s} FAILED: {type(exc).__name__}: {exc}", flush=True)
                    copy_failures.append(f"{family} {dtype} {fmt}: {exc}")
    print(
        f"\nlossless on {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}): runs with no CPU-computed miss identical to eager "
        f"{counts['copy'][0]}/{counts['copy'][1]}; runs with CPU-computed misses identical {counts['host'][0]}/"
        f"{counts['host'][1]} ({time.perf_counter() - t0:.0f} s)"
    )
    for line in copy_failures:
        print("DIFFERS:", line)
    return 1 if copy_failures else 0


if __name__ == "__main__":
    sys.exit(main())
