"""One MoE layer's experts as an OpenVINO GatherMatmul model: compile time, ms per call and the memory it holds
(issue 26; the kernel's speed beside ours is tools/kernel_candidates.py). Prints one line per run.

The layer: [E, 2I, H] gate_up and [E, H, I] down weights in int8 (per-row float32 scale) or int4 (u4 codes in groups
of 64 with float32 scale and float zero point), random codes, real widths; one call computes 8 chosen experts for one
token with float32 activations. `--from-ir` writes the model as an IR file first and compiles it from there (OpenVINO
memory-maps the weights file), to separate the anonymous memory compile adds from the file pages of the weights.

Run from the repository root with openvino on PYTHONPATH (`pip install --no-deps --target DIR openvino==2026.4.1`; not
a dependency of the app): `python tools/openvino_layer.py --experts 128 --format int8 [--from-ir]`.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import tempfile
import time

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import openvino.opset17 as ops17

SHAPES = {"qwen3-30b-a3b": (2048, 768), "mixtral-8x7b": (4096, 14336)}  # hidden, expert intermediate
TOP_K = 8


def _memory_mb() -> dict[str, float]:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        rows = [line.split(":") for line in f if line.startswith(("RssAnon", "RssFile"))]
    return {k: int(v.split()[0]) / 1e3 for k, v in rows}


def _weight(fmt: str, experts: int, out: int, inp: int, rng: np.random.Generator) -> tuple[object, int]:
    """The [E, out, in] float32 weight node GatherMatmulCompressed is made from, and its packed bytes."""
    if fmt == "int8":
        q = rng.integers(-127, 128, (experts, out, inp), dtype=np.int8)
        scale = (rng.random((experts, out, 1), dtype=np.float32) + 0.5) * 1e-3
        return ops.multiply(ops.convert(ops.constant(q, ov.Type.i8), ov.Type.f32), ops.constant(scale)), q.nbytes
    groups = inp // 64
    codes = rng.integers(0, 16, (experts, out, groups, 64), dtype=np.uint8)
    scale = (rng.random((experts, out, groups, 1), dtype=np.float32) + 0.5) * 1e-2
    zp = (8 - rng.random((experts, out, groups, 1), dtype=np.float32)).astype(np.float32)
    node = ops.multiply(
        ops.subtract(ops.convert(ops.constant(codes, ov.Type.u4), ov.Type.f32), ops.constant(zp)), ops.constant(scale)
    )
    return ops.reshape(node, ops.constant(np.array([experts, out, inp], np.int64)), False), codes.size // 2


def layer_model(fmt: str, experts: int, hidden: int, inter: int) -> tuple[ov.Model, int]:
    rng = np.random.default_rng(0)
    rows = ops.parameter([-1, hidden], ov.Type.f32)  # one row per chosen expert, sorted by expert
    ends = ops.parameter([experts], ov.Type.i32)  # cumulative rows per expert
    gate_up, gu_bytes = _weight(fmt, experts, 2 * inter, hidden, rng)
    down, d_bytes = _weight(fmt, experts, hidden, inter, rng)
    h = ops17.grouped_matmul(rows, gate_up, ends)
    gate = ops.slice(h, np.array([0]), np.array([inter]), np.array([1]), np.array([1]))
    up = ops.slice(h, np.array([inter]), np.array([2 * inter]), np.array([1]), np.array([1]))
    y = ops17.grouped_matmul(ops.multiply(ops.swish(gate), up), down, ends)
    return ov.Model([y], [rows, ends]), gu_bytes + d_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--format", choices=("int8", "int4"), default="int8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--from-ir", action="store_true")
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    hidden, inter = SHAPES[args.shape]
    core = ov.Core()
    config = {
        "INFERENCE_NUM_THREADS": args.threads,
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,
    }
    with tempfile.TemporaryDirectory() as workdir:
        model, nbytes = layer_model(args.format, args.experts, hidden, inter)
        if args.from_ir:
            path = os.path.join(workdir, "layer.xml")
            ov.save_model(model, path, compress_to_fp16=False)
            del model
            before = _memory_mb()
            model = core.read_model(path)
        else:
            before = _memory_mb()
        start = time.perf_counter()
        compiled = core.compile_model(model, "CPU", config)
        compile_s = time.perf_counter() - start
        del model
        after = _memory_mb()
        kinds = {op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()}
        request = compiled.create_infer_request()
        rng = np.random.default_rng(1)
        rows = np.repeat(rng.standard_normal((1, hidden), dtype=np.float32), TOP_K, 0)
        times = []
        for _ in range(args.calls):
            counts = np.zeros(args.experts, np.int32)
            counts[rng.choice(args.experts, TOP_K, replace=False)] = 1
            start = time.perf_counter()
            request.infer({0: rows, 1: np.cumsum(counts, dtype=np.int32)})
            times.append(time.perf_counter() - start)
    call = float(np.median(times))
    per_expert = nbytes / args.experts
    load = open("/proc/loadavg").read().split()[0]
    print(
        f"{args.shape} {args.format}, {args.experts} experts, {args.threads} thread(s), "
        f"{'from an IR file' if args.from_ir else 'built in process'}: GatherMatmul fused {'GatherMatmul' in kinds}; "
        f"compile {compile_s:.2f} s; {call * 1e3:.2f} ms per call of {TOP_K} experts "
        f"({per_expert * TOP_K / call / 1e9:.2f} GB/s of packed codes); compile added "
        f"{(after['RssAnon'] - before['RssAnon']) / (nbytes / 1e6):.2f}x the codes in anonymous memory, "
        f"{(after['RssFile'] - before['RssFile']) / (nbytes / 1e6):.2f}x in file pages; load {load}"
    )


if __name__ == "__main__":
    main()
