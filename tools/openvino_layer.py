"""One MoE layer's experts as an OpenVINO GatherMatmul model: how it is built (`int8_weight`, `int4_weight`,
`layer_model`, `compile_config`, `call_inputs`, which tools/kernel_candidates.py and tools/openvino_decode.py import
from here), and, run as a script, its compile time, ms per call and the memory it holds (issue 26; the kernel's speed
beside ours is kernel_candidates'). Prints one line per run.

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
from collections.abc import Sequence

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


def compile_config(threads: int) -> dict:
    """The CPU plugin's settings every OpenVINO measurement here uses: float32 activations (dynamic quantisation of
    activations off: the lossless rule), one stream, `threads` threads."""
    return {
        "INFERENCE_NUM_THREADS": threads,
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,
    }


def int8_weight(q: np.ndarray, scale: np.ndarray) -> ov.Node:
    """q int8 [E, out, in] and scale float32 [E, out, 1] (ours: w = q · scale) → the float32 [E, out, in] node the CPU
    plugin turns into GatherMatmulCompressed. The constant is a copy: `q` may be freed."""
    return ops.multiply(ops.convert(ops.constant(q, ov.Type.i8), ov.Type.f32), ops.constant(scale))


def int4_weight(q: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> ov.Node:
    """q uint8 [E, out, in/2], two codes a byte, the first in the low nibble (ours, and OpenVINO's u4 order); scale
    and zp float32 [E, out, groups, 1]: w = (code − zp) · scale (ours, (code − 8) · scale + zero, is zp = 8 − zero /
    scale). The float32 [E, out, in] node GatherMatmulCompressed is made from; the constant is a copy."""
    experts, out, half = q.shape
    groups = scale.shape[2]
    codes = ops.constant(ov.Tensor(q, [experts, out, groups, 2 * half // groups], ov.Type.u4), shared_memory=False)
    node = ops.multiply(ops.subtract(ops.convert(codes, ov.Type.f32), ops.constant(zp)), ops.constant(scale))
    return ops.reshape(node, ops.constant(np.array([experts, out, 2 * half], np.int64)), False)


def layer_model(gate_up: ov.Node, down: ov.Node) -> ov.Model:
    """One MoE layer's experts (SwiGLU: gate_up [E, 2I, H], down [E, H, I]) as GroupedMatMul, which the CPU plugin
    makes GatherMatmul: inputs the chosen experts' rows, sorted by expert, and each expert's cumulative row end
    (`call_inputs`); output one row per input row, each its expert's output."""
    experts, _, hidden = gate_up.get_output_shape(0)
    inter = down.get_output_shape(0)[2]
    rows = ops.parameter([-1, hidden], ov.Type.f32)
    ends = ops.parameter([experts], ov.Type.i32)
    h = ops17.grouped_matmul(rows, gate_up, ends)
    gate = ops.slice(h, np.array([0]), np.array([inter]), np.array([1]), np.array([1]))
    up = ops.slice(h, np.array([inter]), np.array([2 * inter]), np.array([1]), np.array([1]))
    y = ops17.grouped_matmul(ops.multiply(ops.swish(gate), up), down, ends)
    return ov.Model([y], [rows, ends])


def call_inputs(x: np.ndarray, chosen: Sequence[int], experts: int) -> dict[int, np.ndarray]:
    """A layer model's inputs for one token x [1, H] through the distinct `chosen` experts, sorted ascending."""
    counts = np.zeros(experts, np.int32)
    counts[list(chosen)] = 1
    return {0: np.repeat(x.astype(np.float32), len(chosen), 0), 1: np.cumsum(counts, dtype=np.int32)}


def _random_weight(fmt: str, experts: int, out: int, inp: int, rng: np.random.Generator) -> tuple[ov.Node, int]:
    """A random [E, out, in] weight in `fmt` (int4 in groups of 64), and its packed codes' bytes."""
    if fmt == "int8":
        q = rng.integers(-127, 128, (experts, out, inp), dtype=np.int8)
        return int8_weight(q, (rng.random((experts, out, 1), dtype=np.float32) + 0.5) * 1e-3), q.nbytes
    groups = inp // 64
    q = rng.integers(0, 256, (experts, out, inp // 2), dtype=np.uint8)
    scale = (rng.random((experts, out, groups, 1), dtype=np.float32) + 0.5) * 1e-2
    zp = (8 - rng.random((experts, out, groups, 1), dtype=np.float32)).astype(np.float32)
    return int4_weight(q, scale, zp), q.nbytes


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
    config = compile_config(args.threads)
    with tempfile.TemporaryDirectory() as workdir:
        rng = np.random.default_rng(0)
        gate_up, gu_bytes = _random_weight(args.format, args.experts, 2 * inter, hidden, rng)
        down, d_bytes = _random_weight(args.format, args.experts, hidden, inter, rng)
        model, nbytes = layer_model(gate_up, down), gu_bytes + d_bytes
        del gate_up, down
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
        x = rng.standard_normal((1, hidden), dtype=np.float32)
        times = []
        for _ in range(args.calls):
            inputs = call_inputs(x, sorted(rng.choice(args.experts, TOP_K, replace=False)), args.experts)
            start = time.perf_counter()
            request.infer(inputs)
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
