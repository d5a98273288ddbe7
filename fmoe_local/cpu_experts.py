"""Computing a routed expert on the host, from its host copy: the kernels, and the choice among them by measurement.

Scope: a `Kernel` is the pair of products an expert needs (`linear`: x·Wᵀ for [out, in] rows, `matmul`: x·W for
GPT-OSS's [in, out] rows) for one stored weight format; `KERNELS` lists the candidates per format (fp32, bf16, fp16
here; int8 and int4 over torch's packed CPU layouts); `measure`/`choose` time them on real expert rows and keep the
fastest; `HostExperts` runs one expert of one layer on the host with the chosen kernel. It does NOT decide which
misses go to the CPU (miss_cost.py does), read the routing, or touch the device.

Why a choice at all: on a CPU without bf16 units a plain bf16 GEMV crawls while fp32 runs near memory speed (an
upcast pays), and on one with them (AVX512-BF16, AMX) the native bf16 product wins; only a measurement on the
machine tells (docs/bench.md, "CPU experts"). Quantized formats plug in by adding their kernels to `KERNELS` under
their format name, each with a `pack` that turns dense [out, in] weights into what its `linear` reads.

Exactness: a kernel that is not `native` computes in another precision than the checkpoint's (an upcast computes
in fp32, the packed formats dequantize). `HostExperts` therefore uses `NATIVE` — the very ops experts.py runs on
the device — whenever the device is the CPU, so the CPU path there computes what the device path does (for float
formats bit for bit, as transformers eager); the one exception is int8 computed in float32, where
`INT8_BLOCKS_ON_CPU` (eager's float32 product of the dequantised weights, in blocks) is measured against it
(`device_candidates`). The choice among all kernels happens only where the device is a GPU.

Threads: `HostExperts.forward` runs on the forward thread; a read of a disk-tier expert runs on its own reader
thread with the cache's deadline and interrupt, so a stuck read cannot hold the forward thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fmoe_local import expert_formats
from fmoe_local.cache import ExpertLoadError
from fmoe_local.copier import Interrupted, Landing, Loader, LoadTimeout
from fmoe_local.expert_formats import PACKED_WEIGHTS, Int4Weight, Int8Weight
from fmoe_local.host import HostStore

Tensor = torch.Tensor
# Rows upcast per block: a few MB of fp32 stays in the core's L2 while the product reads it.
UPCAST_BLOCK_BYTES = 1 << 20
FORMAT_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Kernel:
    """One way to compute an expert's products on the CPU for weights stored in `fmt`.

    `linear(x [T, in], w, bias | None) -> [T, out]` for [out, in] rows; `matmul(x [T, in], w) -> [T, out]` for
    [in, out] rows (GPT-OSS). `pack(dense [out, in] float) -> w` makes the stored form from dense weights (the
    benchmark and tests; a host store of that format holds it already). `precision` says what it computes in.
    """

    name: str
    fmt: str
    precision: str
    linear: Callable[[Tensor, object, Tensor | None], Tensor]
    matmul: Callable[[Tensor, object], Tensor] | None = None
    pack: Callable[[Tensor], object] = field(default=lambda w: w)

    def stored_bytes(self, w: object) -> int:
        if isinstance(w, Tensor):
            return w.numel() * w.element_size()
        return sum(t.numel() * t.element_size() for t in vars(w).values() if isinstance(t, Tensor))


# ---- float formats ---------------------------------------------------------------------------------------------------
def _native_linear(x: Tensor, w: Tensor | Int8Weight | Int4Weight, bias: Tensor | None) -> Tensor:
    if isinstance(w, PACKED_WEIGHTS):  # a packed parameter computed by a library product (PackedRows)
        return w.linear(x, bias)
    return F.linear(x.to(w.dtype), w, bias)


def _native_matmul(x: Tensor, w: Tensor) -> Tensor:
    return x.to(w.dtype) @ w


def _upcast_linear(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x.float(), w.float(), None if bias is None else bias.float())


def _upcast_matmul(x: Tensor, w: Tensor) -> Tensor:
    return x.float() @ w.float()


def _blocked_linear(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x·Wᵀ with W upcast to fp32 a block of rows at a time: the fp32 copy never leaves the cache."""
    rows = max(16, UPCAST_BLOCK_BYTES // (4 * w.shape[1]))
    xf = x.float()
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    for start in range(0, w.shape[0], rows):
        torch.mm(xf, w[start : start + rows].float().t(), out=out[:, start : start + rows])
    return out if bias is None else out + bias.float()


def _blocked_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x·W for W [in, out]: blocks of input rows, accumulated in fp32."""
    rows = max(16, UPCAST_BLOCK_BYTES // (4 * w.shape[1]))
    xf = x.float()
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32)
    for start in range(0, w.shape[0], rows):
        out.addmm_(xf[:, start : start + rows], w[start : start + rows].float())
    return out


NATIVE = Kernel("native", "any", "the stored dtype", _native_linear, _native_matmul)


def _float_kernels(fmt: str, dtype: torch.dtype) -> list[Kernel]:
    def pack(w: Tensor) -> Tensor:
        return w.to(dtype).contiguous()

    native = Kernel(f"{fmt} native", fmt, fmt, _native_linear, _native_matmul, pack)
    if dtype == torch.float32:
        return [native]
    return [
        native,
        Kernel(f"{fmt}→fp32 whole", fmt, "fp32", _upcast_linear, _upcast_matmul, pack),
        Kernel(f"{fmt}→fp32 blocks", fmt, "fp32", _blocked_linear, _blocked_matmul, pack),
    ]


# ---- packed integer formats (torch's weight-only CPU products, expert_formats.Int8Weight / Int4Weight) ---------------
def pack_int8(w: Tensor) -> Int8Weight:
    parts = expert_formats.pack_int8(w)
    return Int8Weight(parts["q"], parts["scale"])


def _int4_packer(dtype: torch.dtype) -> Callable[[Tensor], Int4Weight]:
    def pack(w: Tensor) -> Int4Weight:
        parts = expert_formats.pack_int4(w, dtype)
        return Int4Weight(Int4Weight.from_portable(parts["q"]), parts["sz"], expert_formats.int4_group(w.shape[1]))

    return pack


def _product_in(dtype: torch.dtype) -> Callable[[Tensor, object, Tensor | None], Tensor]:
    def linear(x: Tensor, w: Int8Weight | Int4Weight, bias: Tensor | None) -> Tensor:
        return w.linear(x.to(dtype), None if bias is None else bias.to(dtype))

    return linear


def _int8_upcast_linear(x: Tensor, w: Int8Weight, bias: Tensor | None) -> Tensor:
    rows = max(16, UPCAST_BLOCK_BYTES // (4 * w.q.shape[1]))
    xf = x.float()
    out = torch.empty(x.shape[0], w.q.shape[0], dtype=torch.float32)
    for start in range(0, w.q.shape[0], rows):
        block = w.q[start : start + rows].float() * w.scale[start : start + rows, None]
        torch.mm(xf, block.t(), out=out[:, start : start + rows])
    return out if bias is None else out + bias.float()


def _int8_blocks_or_native(x: Tensor, w: object, bias: Tensor | None) -> Tensor:
    """NATIVE, but an int8 parameter dequantised a block of rows at a time into float32 and multiplied there."""
    if isinstance(w, Int8Weight):
        return _int8_upcast_linear(x, w, bias).to(x.dtype)
    return _native_linear(x, w, bias)


# On a CPU device computing in float32, torch's int8 product with float32 activations is sometimes slower than
# dequantising int8 in cache-sized blocks and using the float32 product (one thread here: 13 against 5.6 ms per
# Qwen3 expert), sometimes much faster (two threads on the same busy machine: 44 against 260 ms): measured at load.
INT8_BLOCKS_ON_CPU = Kernel("int8→fp32 blocks (CPU device)", "int8", "fp32", _int8_blocks_or_native, _native_matmul)


def device_candidates(expert_format: str, dtype: torch.dtype, transposed: bool = False) -> list[Kernel]:
    """The kernels a CPU device may compute its experts with: NATIVE (the device path's own ops: for int8 and int4
    torch's weight-only products), and for int8 in float32 also INT8_BLOCKS_ON_CPU, which computes eager's product
    of the same dequantised float32 weights (in blocks of rows); the probe keeps the faster. int4 has no such
    alternative: torch's product beat dequantising by 2× even with float32 activations (docs/bench.md)."""
    if expert_format == "int8" and dtype == torch.float32 and not transposed:
        return [NATIVE, INT8_BLOCKS_ON_CPU]
    return [NATIVE]


KERNELS: dict[str, list[Kernel]] = {
    "fp32": _float_kernels("fp32", torch.float32),
    "bf16": _float_kernels("bf16", torch.bfloat16),
    "fp16": _float_kernels("fp16", torch.float16),
    "int8": [
        Kernel(
            "int8 _weight_int8pack_mm bf16", "int8", "bf16 activations", _product_in(torch.bfloat16), pack=pack_int8
        ),
        Kernel("int8 _weight_int8pack_mm", "int8", "fp32 activations", _product_in(torch.float32), pack=pack_int8),
        Kernel("int8→fp32 blocks", "int8", "fp32", _int8_upcast_linear, pack=pack_int8),
    ],
    "int4": [
        Kernel(
            "int4 _weight_int4pack_mm_for_cpu bf16",
            "int4",
            "bf16 activations",
            _product_in(torch.bfloat16),
            pack=_int4_packer(torch.bfloat16),
        ),
        Kernel(
            "int4 _weight_int4pack_mm_for_cpu",
            "int4",
            "fp32 activations",
            _product_in(torch.float32),
            pack=_int4_packer(torch.float32),
        ),
    ],
}


def kernels_for(fmt: str, transposed: bool = False) -> list[Kernel]:
    """The candidates for weights stored in `fmt` (GPT-OSS's [in, out] rows need a `matmul`)."""
    if fmt not in KERNELS:
        raise ValueError(f"No CPU expert kernel for weights stored as '{fmt}'. Known formats: {', '.join(KERNELS)}.")
    found = [k for k in KERNELS[fmt] if k.matmul is not None or not transposed]
    if not found:
        raise ValueError(f"No CPU expert kernel reads '{fmt}' weights in the [in, out] layout; use miss handling copy.")
    return found


# ---- one expert ------------------------------------------------------------------------------------------------------
def expert_forward(module: torch.nn.Module, x: Tensor, rows: Mapping[str, object], kernel: Kernel = NATIVE) -> Tensor:
    """One expert on its tokens x [T, H], written exactly as the eager loop of the module's class writes it, with the
    products done by `kernel` (NATIVE: eager's own ops). `rows`: the expert's weights by parameter name."""
    from fmoe_local import hf_internals

    if hf_internals.is_transposed(module):
        # GPT-OSS layout: [H, 2I] and [I, H], interleaved gate/up, with biases.
        gate_up = kernel.matmul(x, rows["gate_up_proj"])
        if hf_internals.has_bias(module):
            gate_up = gate_up + rows["gate_up_proj_bias"]
        h = hf_internals.apply_gate(module, gate_up)
        out = kernel.matmul(h, rows["down_proj"])
        if hf_internals.has_bias(module):
            out = out + rows["down_proj_bias"]
        return out

    def bias(name: str) -> Tensor | None:
        return rows[name] if name in rows else None

    if hf_internals.has_gate(module):
        h = hf_internals.apply_gate(module, kernel.linear(x, rows["gate_up_proj"], bias("gate_up_proj_bias")))
    else:
        h = hf_internals.activation(module)(kernel.linear(x, rows["up_proj"], bias("up_proj_bias")))
    return kernel.linear(h, rows["down_proj"], bias("down_proj_bias"))


# ---- measuring -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelTiming:
    kernel: str
    tokens: int
    seconds: float  # per expert, best pass
    bytes_per_expert: int

    @property
    def gbps(self) -> float:
        return self.bytes_per_expert / self.seconds / 1e9 if self.seconds > 0 else 0.0


def time_kernel(
    kernel: Kernel,
    module: torch.nn.Module,
    experts: Sequence[Mapping[str, object]],
    hidden: int,
    tokens: int = 1,
    passes: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> KernelTiming:
    """Seconds per expert of `kernel` over `experts` (cycled: with more bytes than the last-level cache holds, every
    expert comes from DRAM as a real miss does), the best of `passes` passes after one warm-up call."""
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expert_forward(module, x, experts[0], kernel)
        best = float("inf")
        for _ in range(passes):
            t0 = clock()
            for rows in experts:
                expert_forward(module, x, rows, kernel)
            best = min(best, (clock() - t0) / len(experts))
    size = sum(kernel.stored_bytes(w) for w in experts[0].values())
    return KernelTiming(kernel.name, tokens, best, size)


def choose(timings: Sequence[KernelTiming], kernels: Sequence[Kernel]) -> Kernel:
    """The fastest kernel at one token (decode: where the CPU path matters); ties keep the listed order."""
    by_name = {k.name: k for k in kernels}
    best = min(timings, key=lambda t: t.seconds)
    return by_name[best.kernel]


# ---- the runtime's host experts --------------------------------------------------------------------------------------
class HostExperts:
    """Runs one expert of one MoE layer on the host from the host store's copy, with one kernel.

    The kernel is NATIVE on a CPU device (the device path's ops), or INT8_BLOCKS_ON_CPU where the probe measured it
    faster; on a GPU it is the measured fastest for the stored format (`choose`). Rows held in RAM are read in place; a read from the disk tier runs on this
    object's reader thread and is waited for with a deadline and the interrupt, like the cache's on-demand loads.
    A failed read raises ExpertLoadError (a sentence).
    """

    def __init__(self, host: HostStore, kernel: Kernel = NATIVE) -> None:
        self.host = host
        self.kernel = kernel
        self._loader: Loader | None = None  # started on the first disk-tier read

    def rows(self, layer: int, expert: int, interrupt: threading.Event, timeout_s: float) -> Mapping[str, Tensor]:
        try:
            # Packed formats: dequantised per expert computed, through the store's view.
            if self.host.in_ram(layer, expert):
                return self.host.view(self.host.read(layer, expert))
            return self.host.view(self._bounded_read(layer, expert, interrupt, timeout_s))
        except (Interrupted, LoadTimeout, ExpertLoadError):
            raise
        except Exception as exc:  # noqa: BLE001 - any read failure becomes the request's sentence
            raise _load_error(layer, expert, exc) from exc

    def _bounded_read(
        self, layer: int, expert: int, interrupt: threading.Event, timeout_s: float
    ) -> Mapping[str, Tensor]:
        if self._loader is None:
            self._loader = Loader("fmoe-host-reader")
        landing, box = Landing(), {}

        def job() -> None:
            try:
                box["rows"] = self.host.read(layer, expert)
            except Exception as exc:  # noqa: BLE001 - handed to the waiter through the landing
                landing.set(_load_error(layer, expert, exc))
                return
            landing.set()

        what = f"expert {expert} of MoE layer {layer}"
        token = self._loader.submit(job)
        try:
            landing.wait_until(time.perf_counter() + timeout_s, interrupt, what)
        except (LoadTimeout, Interrupted):
            # A read that may never return keeps its thread; the next reads go on a fresh one, so none waits behind
            # it (the late result is dropped with `box`).
            self._loader.abandon(token)
            raise
        return box["rows"]

    def forward(
        self,
        module: torch.nn.Module,
        layer: int,
        expert: int,
        x: Tensor,  # [T, H] on the host
        interrupt: threading.Event,
        timeout_s: float,
    ) -> Tensor:
        """[T, H] host tensor out, in the kernel's precision (the caller casts it)."""
        return expert_forward(module, x, self.rows(layer, expert, interrupt, timeout_s), self.kernel)

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()
            self._loader = None


def _load_error(layer: int, expert: int, exc: BaseException) -> ExpertLoadError:
    error = ExpertLoadError(
        f"Could not read expert {expert} of MoE layer {layer}: {exc} If this repeats, the model files may be "
        "damaged: download the model again."
    )
    error.__cause__ = exc
    return error
