"""Expert product kernels from libraries, measured side by side on this CPU (issue 26, item 1). Prints a table.

One token through many real-shaped experts (gate_up product, SwiGLU, down product; random weights; enough experts
that every pass reads DRAM, as a decode miss does), per candidate:
- torch's weight-only products as the runtime calls them (cpu_experts.KERNELS: int8 and int4, bf16 activations) and
  torch's bf16 GEMV, the runtime's kernels today;
- torch's fbgemm dynamic-quantised int8 linear (activations quantised per tensor; torch marks that API deprecated);
- ONNX Runtime's MatMulNBits (4 and 8 bits, blocks along the input, accuracy level 4: activations quantised to int8
  per block, as llama.cpp's q8_0 activations), one session per weight built from an ONNX file whose weights are
  external data (loading from bytes keeps copies: RSS 2.5× the weight), all sessions sharing one thread pool (one
  pool per session, the default, starts a spinning thread per session), only when `onnxruntime` and `onnx` import.
  The int8 weights are ours (per-row scale repeated per block: the same dequantised values); int4 is quantised with
  an integer zero point per block, which ours is not (its float zero point sends MatMulNBits to a 30× slower path).
- OpenVINO's GatherMatmul (`grouped_matmul` on [E, out, in] compressed constants, which the CPU plugin turns into
  GatherMatmulCompressed): one compiled model holds all the pass's experts, one call computes 8 chosen experts with
  float32 activations (dynamic quantisation off, so nothing is rounded), on our own int8 and int4 bytes; only when
  `openvino` imports. Its error column is of the whole expert (gate_up, SwiGLU, down), not of one product.

Columns: ms per expert (best pass; passes interleaved across candidates so a busy machine slows all alike), GB/s of
the bytes the candidate reads per expert, that as a share of the DRAM read measured in the same run, the largest
error of one product against float32 on the candidate's own dequantised weights relative to the largest output,
and, for ONNX Runtime, the RSS a session adds per weight against the weight's packed bytes.

Run from the repository root: `python tools/kernel_candidates.py --threads 1` (add `--threads 2`; `--experts` sets
how many distinct experts a pass cycles through). With ONNX Runtime: `pip install onnxruntime==1.32.0 onnx==1.23.2`
into a folder and put it on PYTHONPATH (neither is a dependency of the app); OpenVINO likewise with
`pip install --no-deps --target DIR openvino==2026.4.1` (it imports without its telemetry package).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fmoe_local import bandwidth, cpu_experts, expert_formats

SHAPES = {"qwen3-30b-a3b": (2048, 768), "mixtral-8x7b": (4096, 14336)}  # hidden, expert intermediate


@dataclass
class Candidate:
    name: str
    bytes_per_expert: int
    run: Callable[[int], torch.Tensor]  # expert index -> output [1, H] (one expert, one token)
    error: float = 0.0
    rss_ratio: float | None = None
    per_call: int = 1  # experts one `run` computes: run(e) does experts e .. e + per_call - 1
    times: list[float] = field(default_factory=list)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: RSS figures include freed heap
        pass


def _swiglu(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def _relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def _dequantised(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """The values a kernel of `fmt` multiplies by: the runtime's own packer, then its unpacking, in float32."""
    if fmt == "bf16":
        return w.to(torch.bfloat16).float()
    param = expert_formats.PackedParam(fmt, tuple(w.shape))
    return expert_formats.unpack(param, expert_formats.pack(param, w, torch.bfloat16), torch.float32)


def torch_candidates(weights: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, inter: int) -> list[Candidate]:
    out = []
    xb = x.to(torch.bfloat16)
    for fmt in ("bf16", "int8", "int4"):
        kernel = next(k for k in cpu_experts.KERNELS[fmt] if fmt == "bf16" or k.precision == "bf16 activations")
        packed = [(kernel.pack(a), kernel.pack(b)) for a, b in weights]
        nbytes = kernel.stored_bytes(packed[0][0]) + kernel.stored_bytes(packed[0][1])

        def run(e: int, packed: list = packed, kernel: cpu_experts.Kernel = kernel) -> torch.Tensor:
            a, b = packed[e]
            return kernel.linear(_swiglu(kernel.linear(xb, a, None), inter), b, None)

        error = _relative(kernel.linear(xb, packed[0][0], None), x @ _dequantised(fmt, weights[0][0]).T)
        out.append(Candidate(f"torch {kernel.name}", nbytes, run, error=error))
    return out


def fbgemm_candidate(weights: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, inter: int) -> Candidate:
    def prepack(w: torch.Tensor) -> object:
        scale = w.abs().amax(1) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qt = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
        return torch.ops.quantized.linear_prepack(qt, None)

    packed = [(prepack(a), prepack(b)) for a, b in weights]
    h, i2 = weights[0][0].shape[1], weights[0][0].shape[0]

    def run(e: int) -> torch.Tensor:
        a, b = packed[e]
        return torch.ops.quantized.linear_dynamic(
            _swiglu(torch.ops.quantized.linear_dynamic(x, a, True), inter), b, True
        )

    error = _relative(
        torch.ops.quantized.linear_dynamic(x, packed[0][0], True), x @ _dequantised("int8", weights[0][0]).T
    )
    return Candidate("torch fbgemm dynamic int8", i2 * h + h * inter + (i2 + h) * 4, run, error=error)


def ort_candidates(
    weights: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, inter: int, threads: int, workdir: str
) -> list[Candidate]:
    try:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        print("onnxruntime or onnx not importable: no ONNX Runtime rows (see the docstring)")
        return []

    def quantise(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        n, k = w.shape
        if bits == 8:  # ours: symmetric per row, the scale repeated per block; zero point 128 (MatMulNBits' default)
            scale = np.abs(w).max(1) / 127
            q = np.clip(np.round(w / scale[:, None]), -127, 127).astype(np.int16) + 128
            return q.astype(np.uint8).reshape(n, k // block, block), np.repeat(scale, k // block), None
        wb = w.reshape(n, k // block, block)
        lo, hi = np.minimum(wb.min(-1), 0), np.maximum(wb.max(-1), 0)
        scale = np.where(hi > lo, (hi - lo) / 15, 1.0)
        zero = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
        q = np.clip(np.round(wb / scale[..., None]) + zero[..., None], 0, 15).astype(np.uint8)
        zp = zero.reshape(n, -1)
        if zp.shape[1] % 2:
            zp = np.concatenate([zp, np.zeros((n, 1), np.uint8)], 1)
        return (q[..., 0::2] | (q[..., 1::2] << 4)), scale.reshape(-1), (zp[:, 0::2] | (zp[:, 1::2] << 4)).reshape(-1)

    def dequantised(b: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, bits: int, n: int, k: int) -> np.ndarray:
        if bits == 8:
            return ((b.astype(np.float32) - 128) * scale.reshape(n, -1, 1)).reshape(n, k)
        q = np.stack([b & 15, b >> 4], -1).reshape(n, k // (2 * b.shape[-1]), -1).astype(np.float32)
        z = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, : q.shape[1]].astype(np.float32)
        return ((q - z[..., None]) * scale.reshape(n, -1, 1)).reshape(n, k)

    def session(path: str, b: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, bits: int, block: int) -> object:
        n, k = b.shape[0], b.shape[1] * block
        inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scale.astype(np.float32), "s")]
        names = ["x", "B", "s"] + (["zp"] if zp is not None else [])
        if zp is not None:
            inits.append(numpy_helper.from_array(zp, "zp"))
        node = helper.make_node(
            "MatMulNBits", names, ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block, accuracy_level=4
        )
        graph = helper.make_graph(
            [node],
            "w",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
            inits,
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        )
        onnx.save_model(
            model, path, save_as_external_data=True, location=os.path.basename(path) + ".bin", size_threshold=0
        )
        options = ort.SessionOptions()
        options.use_per_session_threads = False  # one pool for all: a pool per session is hundreds of spinning threads
        options.enable_cpu_mem_arena = False
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    ort.set_global_thread_pool_sizes(threads, 1)
    out = []
    xn = x.numpy()
    for bits, block in ((8, 32), (8, 128), (4, 32), (4, 64)):
        parts = [
            tuple(quantise(w.float().numpy(), bits, block) for w in pair) for pair in weights
        ]  # [(gate_up parts, down parts)]
        nbytes = sum(p.nbytes for part in parts[0] for p in part if p is not None)
        _trim()
        before = _rss_bytes()
        sessions = [
            tuple(
                session(os.path.join(workdir, f"w{bits}-{block}-{e}-{j}.onnx"), *part, bits, block)
                for j, part in enumerate(pair)
            )
            for e, pair in enumerate(parts)
        ]
        _trim()
        rss_ratio = (_rss_bytes() - before) / (nbytes * len(parts))

        def run(e: int, sessions: list = sessions) -> torch.Tensor:
            a, b = sessions[e]
            h = _swiglu(torch.from_numpy(a.run(None, {"x": xn})[0]), inter)
            return torch.from_numpy(b.run(None, {"x": h.numpy()})[0])

        cand = Candidate(f"ORT MatMulNBits int{bits} block {block}", nbytes, run, rss_ratio=rss_ratio)
        gu = parts[0][0]
        ref_gu = x @ torch.from_numpy(dequantised(*gu, bits, *weights[0][0].shape)).T
        cand.error = _relative(torch.from_numpy(sessions[0][0].run(None, {"x": xn})[0]), ref_gu)
        out.append(cand)
    return out


def openvino_candidates(
    weights: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, inter: int, threads: int
) -> list[Candidate]:
    """OpenVINO's GatherMatmul: a layer's experts as one compiled model (tools/openvino_layer.py builds it), the
    chosen experts computed in one call with float32 activations, on our own packed bytes (int8: `q`, `scale`;
    int4: `q` as u4, the float zero point written as (code − zp) · scale with zp = 8 − zero / scale)."""
    try:
        import openvino as ov
        from openvino_layer import call_inputs, compile_config, int4_weight, int8_weight, layer_model
    except ImportError:
        print("openvino (or tools/openvino_layer.py beside this script) not importable: no OpenVINO rows")
        return []
    top_k, experts = 8, len(weights)

    def decompressed(fmt: str, ws: list[torch.Tensor]) -> tuple[object, int]:
        """Our packed `ws` as the [E, out, in] weight node GatherMatmulCompressed is made from, and bytes/expert."""
        param = expert_formats.PackedParam(fmt, tuple(ws[0].shape))
        packed = [expert_formats.pack(param, w, torch.bfloat16) for w in ws]
        q = np.stack([p["q"].numpy() for p in packed])  # int4: [E, a, b/2], low nibble first
        if fmt == "int8":
            scale = np.stack([p["scale"].numpy() for p in packed])[..., None]
            return int8_weight(q, scale), (q.nbytes + scale.nbytes) // experts
        sz = torch.stack([p["sz"].float() for p in packed]).permute(0, 2, 1, 3).numpy()  # [E, a, b/g, 2]
        scale, zero = sz[..., :1].copy(), sz[..., 1:]
        zp = (8 - zero / scale).astype(np.float32)
        return int4_weight(q, scale, zp), (q.nbytes + scale.nbytes + zp.nbytes) // experts

    core = ov.Core()
    out = []
    calls = {e: call_inputs(x.numpy(), range(e, e + top_k), experts) for e in range(0, experts, top_k)}
    for fmt in ("int8", "int4"):
        _trim()
        before = _rss_bytes()
        gate_up, gu_bytes = decompressed(fmt, [a for a, _ in weights])
        down, d_bytes = decompressed(fmt, [b for _, b in weights])
        compiled = core.compile_model(layer_model(gate_up, down), "CPU", compile_config(threads))
        del gate_up, down
        _trim()
        rss_ratio = (_rss_bytes() - before) / ((gu_bytes + d_bytes) * experts)
        kinds = {op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()}
        if "GatherMatmul" not in kinds:
            print(f"OpenVINO did not fuse the {fmt} experts into GatherMatmul: no {fmt} row")
            continue
        request = compiled.create_infer_request()

        def run(e: int, request: object = request) -> torch.Tensor:
            return torch.from_numpy(request.infer(calls[e])[0])

        first = run(0)[0:1]
        a, b = weights[0]
        ref = _swiglu(x @ _dequantised(fmt, a).T, inter) @ _dequantised(fmt, b).T
        out.append(
            Candidate(
                f"OpenVINO GatherMatmul {fmt}, float32 activations",
                gu_bytes + d_bytes,
                run,
                error=_relative(first, ref),
                rss_ratio=rss_ratio,
                per_call=top_k,
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--experts", type=int, default=48, help="distinct experts a pass cycles through")
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hidden, inter = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(2 * inter, hidden, generator=gen) * 0.02, torch.randn(hidden, inter, generator=gen) * 0.02)
        for _ in range(args.experts)
    ]
    x = torch.randn(1, hidden, generator=gen)
    cands = torch_candidates(weights, x, inter) + [fbgemm_candidate(weights, x, inter)]
    with tempfile.TemporaryDirectory() as workdir:
        cands += ort_candidates(weights, x, inter, args.threads, workdir)
        cands += openvino_candidates(weights, x, inter, args.threads)
        dram = bandwidth.dram_read_gbps()
        for _ in range(args.passes):
            for cand in cands:
                start = time.perf_counter()
                for e in range(0, args.experts, cand.per_call):
                    cand.run(e)
                cand.times.append((time.perf_counter() - start) / args.experts)
        dram = max(dram, bandwidth.dram_read_gbps())
    load = open("/proc/loadavg").read().split()[:3]
    print(f"{args.shape}, one token, {args.threads} thread(s), {args.experts} experts a pass, best of {args.passes}")
    print(f"DRAM read {dram:.1f} GB/s (best of two, all threads); load average {' '.join(load)}")
    print(
        f"{'candidate':40s} {'MB/expert':>9s} {'ms/expert':>9s} {'GB/s':>6s} {'of DRAM':>7s} {'error':>8s} {'RSS/bytes':>9s}"
    )
    for c in cands:
        best = min(c.times)
        gbps = c.bytes_per_expert / best / 1e9
        rss = f"{c.rss_ratio:.2f}" if c.rss_ratio is not None else "-"
        err = f"{c.error:.1e}" if c.error else "-"
        print(
            f"{c.name:40s} {c.bytes_per_expert / 1e6:9.2f} {best * 1e3:9.3f} {gbps:6.2f} {gbps / dram:7.0%} {err:>8s} {rss:>9s}"
        )


if __name__ == "__main__":
    main()
