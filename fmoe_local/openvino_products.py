"""OpenVINO's CPU product on int8 weights: x·(q · scale)ᵀ with float32 activations, the one place that uses openvino.

Scope: `Int8Product`, one compiled OpenVINO model per packed int8 weight (expert_formats' int8 parts: [out, in] int8
codes `q` and a float32 `scale` per row), which the CPU plugin runs as a FullyConnected on compressed weights;
`int8_ratio`, the probe that times it against torch's `_weight_int8pack_mm` on this machine (dtype_verdicts.py keeps
the answer); `unavailable`, why it cannot run here. It does NOT decide where it is used (dense_formats.py does, from
the verdict and `RuntimeConfig.dense_int8_product`), add the bias (the caller's torch does), or touch the routed
experts.

Exactness: the activations stay float32 inside (`INFERENCE_PRECISION_HINT` f32, `DYNAMIC_QUANTIZATION_GROUP_SIZE` 0:
no rounding of x to int8 or bf16), so the product is float32's x·Wᵀ on the dequantised W = q · scale up to the order
of the sums (tests/test_openvino_products.py: ~1e-6 of the largest output). A bf16 model's activations are widened
to float32 (exact) and the output rounded back to bf16 once.

Memory: the model's constant shares the memory of the `q` tensor it is given (no copy at build), which must stay
alive and unchanged while the product is used (PackedLinear holds it); the CPU plugin makes its own repacked copy of
the codes at the first call, about as large (REPACK_BYTES_PER_CODE), so a weight computed here holds about twice its
int8 bytes (hardware.cpu_resident_bytes and ModelInfo.resident_bytes count it; docs/bench.md, session 21).

Threads: OpenVINO's pool (TBB) runs beside torch's (OpenMP) in one process. `threads` (torch's thread count at the
load) sizes OpenVINO's: with one, a call runs on the calling thread alone; with two, on it and OpenVINO's own workers,
which take turns with torch's on a small machine (docs/bench.md, session 21: no setting measured better there). The
probe's verdict is measured at torch's thread count and kept per count (dtype_verdicts.machine_key). The compiled
model and its infer request are built on the loading thread and, once the model is loaded, used only by the runtime's
worker thread (the thread that runs forward passes): an infer request is not safe to call from two threads at once,
and each Int8Product has its own, so two weights never share one.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import math
import sys
import time
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from fmoe_local import bandwidth

log = logging.getLogger(__name__)


def _import_openvino() -> tuple[ModuleType, ModuleType]:
    """openvino and the opset we build with. `import openvino` imports its model converter, which sends a telemetry
    event on import when the `openvino_telemetry` package (installed with openvino) is importable and the user never
    opted out: a None in sys.modules makes that import fail, and the converter falls back to its own no-op stub. The
    seam tests replace to see the fallback."""
    sys.modules.setdefault("openvino_telemetry", None)
    import openvino
    import openvino.opset13

    return openvino, openvino.opset13


@functools.cache
def _openvino() -> tuple[ModuleType, ModuleType] | str:
    """The imported modules, or why they cannot be imported: imported at first use, not with this module (about 0.3 s
    that an app start without a packed int8 load need not pay). Any thread; the import system serialises it."""
    try:
        return _import_openvino()
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken native library raising anything at import
        return f"{type(exc).__name__}: {exc}"


# The CPU plugin's repacked copy of the codes, per byte of codes, made at the first call (docs/bench.md, session 21).
REPACK_BYTES_PER_CODE = 1.0


def unavailable() -> str:
    """Why OpenVINO's product cannot run here ("" when it can): openvino not importable."""
    found = _openvino()
    return f"openvino is not importable here ({found})" if isinstance(found, str) else ""


def version() -> str:
    """The installed openvino's version ("" when it is not installed): a verdict measured with one version is not
    another's. Read from the package's metadata, not by importing it: every app start asks, to read a saved verdict."""
    try:
        return importlib.metadata.version("openvino")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _config(threads: int) -> dict:
    return {
        "INFERENCE_NUM_THREADS": threads,
        "INFERENCE_PRECISION_HINT": "f32",  # float32 activations and accumulation: the lossless rule
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,  # never round the activations to int8
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
    }


class Int8Product:
    """x·(q · scale)ᵀ for x [T, in] in float32 or bf16 (the answer in x's dtype), computed by OpenVINO's CPU plugin
    from `q` [out, in] int8 (shared, not copied: keep it alive and unchanged) and `scale` [out] float32. Raises
    RuntimeError (OpenVINO's own) when openvino is absent or the model does not compile."""

    def __init__(self, q: Tensor, scale: Tensor, threads: int, core: object | None = None) -> None:
        found = _openvino()
        if isinstance(found, str):
            raise RuntimeError(unavailable())
        ov, ops = found
        self._ov = ov
        self.out_features, self.in_features = q.shape
        codes = q.contiguous()
        self._codes = codes  # the constant reads this memory: held here as well as by the caller
        const = ops.constant(codes.numpy(), ov.Type.i8, shared_memory=True)
        weight = ops.multiply(
            ops.convert(const, ov.Type.f32), ops.constant(scale.float().reshape(-1, 1).numpy().copy())
        )
        x = ops.parameter([-1, self.in_features], ov.Type.f32)
        model = ov.Model([ops.matmul(x, weight, False, True)], [x])
        core = core if core is not None else ov.Core()
        compiled = core.compile_model(model, "CPU", _config(threads))
        self._request = compiled.create_infer_request()

    def __call__(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        self._request.set_input_tensor(self._ov.Tensor(flat.numpy(), shared_memory=True))
        self._request.infer()
        out = torch.from_numpy(self._request.get_output_tensor().data)  # the request's buffer: reused next call
        return out.clone() if x.dtype == torch.float32 else out.to(x.dtype)


# The two shapes the probe times, as [out, in] int8 codes: an attention projection's (Qwen3-30B-A3B's q_proj, as
# bandwidth's probes) and an output head's (Qwen's 151,936-token vocabulary). Which product is faster depends on the
# weight (docs/bench.md, "One verdict per weight size", session 23: in a decode here OpenVINO took the head in
# 0.63-0.70 of torch's time, and a k_proj in 1.5-2 times it): each shape has its verdict, and a weight takes the
# verdict of the shape its size is nearer to on a log scale (`size_class`).
PROBE_SHAPES = {"small": (bandwidth.HALF_PROBE_OUT, bandwidth.HALF_PROBE_IN), "large": (151936, 2048)}
PROBE_NAMES = {"small": "an attention projection", "large": "an output head"}  # each shape's, for people


def size_class(codes: int) -> str:
    """Which probe judges a weight of `codes` int8 codes: "small" or "large" (at and above the geometric mean of the
    two probes' sizes, 51 MB: every output head of the catalog's models, none of their attention weights)."""
    small, large = (math.prod(shape) for shape in PROBE_SHAPES.values())
    return "large" if codes >= math.sqrt(small * large) else "small"


def int8_ratio(dtype: torch.dtype, size: str = "small") -> float:
    """`measured_ratio` at torch's thread count now, measured once per process (a benchmark or the tests load many
    times; dtype_verdicts.py keeps the answer across processes)."""
    return _measured_ratio(dtype, torch.get_num_threads(), size)


@functools.cache
def _measured_ratio(dtype: torch.dtype, threads: int, size: str) -> float:
    return measured_ratio(dtype, threads, size=size)


def forget_measured() -> None:
    """`int8_ratio` measures again when next asked (a re-check of this computer)."""
    _measured_ratio.cache_clear()


def measured_ratio(dtype: torch.dtype, threads: int, repeats: int = 9, size: str = "small") -> float:
    """Seconds of OpenVINO's one-token product over torch's `_weight_int8pack_mm` with `dtype` activations (as
    expert_formats.Int8Weight runs it) on the same int8 weights: below 1 OpenVINO is faster here. The weights have
    `size`'s shape (PROBE_SHAPES), as many as make twice the last-level cache so both read DRAM as a decode does;
    each pass times torch then OpenVINO back to back and the median ratio counts (a busy machine slows both of a pair
    alike). Infinite where OpenVINO cannot run, compile or call here."""
    from fmoe_local.expert_formats import Int8Weight

    found = _openvino()
    if isinstance(found, str):
        return math.inf
    out_f, in_f = PROBE_SHAPES[size]
    # At least two small weights (as before the large probe: its saved verdicts keep their name); one large one
    # already outgrows most last-level caches twice.
    count = max(2 if size == "small" else 1, -(-2 * bandwidth.llc_bytes() // (out_f * in_f)))
    gen = torch.Generator().manual_seed(0)
    # Random codes for a small shape's rows, repeated down a larger one: drawing 311 MB of random codes takes two
    # seconds, and no kernel's speed depends on the values.
    rows = PROBE_SHAPES["small"][0]
    weights = [
        torch.randint(-127, 128, (rows, in_f), dtype=torch.int8, generator=gen).repeat(-(-out_f // rows), 1)[:out_f]
        for _ in range(count)
    ]
    scale = torch.full((out_f,), 0.01)
    torchs = [Int8Weight(q, scale) for q in weights]
    x = torch.full((1, in_f), 0.5, dtype=dtype)
    try:
        core = found[0].Core()
        ours = [Int8Product(q, scale, threads, core) for q in weights]
        with torch.inference_mode():
            for w, o in zip(
                torchs, ours, strict=True
            ):  # warm-up: OpenVINO repacks at its first call, torch picks its kernel
                w.linear(x, None)
                o(x)
            ratios = []
            for _ in range(repeats):
                start = time.perf_counter()
                for w in torchs:
                    w.linear(x, None)
                mid = time.perf_counter()
                for o in ours:
                    o(x)
                ratios.append((time.perf_counter() - mid) / (mid - start))
    except RuntimeError as exc:  # OpenVINO's errors are RuntimeError subclasses
        log.info("OpenVINO's int8 product did not run here (%s).", exc)
        return math.inf
    return float(np.median(ratios))
