"""Measured speeds of this machine's memory and links: pinned host→GPU copies, DRAM reads, the CPU's last-level cache,
and a one-token product in bf16 against float32 (`cpu_keeps_half`: does this CPU decode bf16 about as fast?).

Scope: each function measures (or reads) one figure when called, allocating what it measures with; callers decide
when (miss_cost.py at a model's first load, fmoe_bench/cpu_experts.py). It does NOT probe what the machine has
(hardware.py) or decide anything from the figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from fmoe_local.catalog import GB


def host_to_device_gbps(size_mb: int = 256, repeats: int = 3) -> float:
    """Measured pinned host→GPU copy bandwidth in GB/s; 0.0 without CUDA. Allocates `size_mb` on both sides."""
    import torch

    if not torch.cuda.is_available():
        return 0.0
    n = size_mb * 1_000_000
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)  # warm-up: first copy pays for context setup
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return n * repeats / elapsed / GB


def llc_bytes(default: int = 32 * 1024**2) -> int:
    """Size of the CPU's last-level cache in bytes (Linux sysfs); `default` where the platform does not say."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or default


def dram_read_gbps(size_mb: int = 0, repeats: int = 3) -> float:
    """Measured DRAM read bandwidth in GB/s: a sum over a float32 array four times the last-level cache (at least
    1 GB unless `size_mb` says otherwise), all threads, the best of `repeats` passes."""
    import torch

    n = (size_mb * 1_000_000 if size_mb else max(4 * llc_bytes(), 1_000_000_000)) // 4
    data = torch.ones(n, dtype=torch.float32)
    data.sum()  # first touch already happened in ones(); this warms the kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return n * 4 / best / GB


# Half precision is kept on the CPU when its one-token product is at most this much slower than float32's: it holds
# half the RAM (a model that fits in bf16 may spill to disk in fp32), which is worth a little compute.
HALF_DECODE_SLACK = 1.1
HALF_PROBE_IN, HALF_PROBE_OUT = 2048, 4096  # a non-expert projection's shape (Qwen3-30B-A3B's q_proj)


def half_decode_ratio(dtype: object, repeats: int = 7) -> float:
    """Seconds of a one-token product x·Wᵀ with W in half precision `dtype` over the same with W in float32: below
    1 the half product decodes faster. W is [4096, 2048] × as many matrices as make twice the last-level cache in
    float32, so both read DRAM as decode does. Each pass times float32 then half back to back and the median of the
    passes' ratios counts: a busy machine slows both of a pair alike. A dtype this torch cannot compute on the CPU
    measures as infinitely slow."""
    import torch
    import torch.nn.functional as F

    count = max(2, -(-2 * llc_bytes() // (HALF_PROBE_IN * HALF_PROBE_OUT * 4)))
    full = [torch.full((HALF_PROBE_OUT, HALF_PROBE_IN), 0.01) for _ in range(count)]
    try:
        half = [w.to(dtype) for w in full]
        pairs = ((torch.full((1, HALF_PROBE_IN), 0.5), full), (torch.full((1, HALF_PROBE_IN), 0.5, dtype=dtype), half))
        return _median_ratio(pairs, F.linear, repeats)
    except (RuntimeError, TypeError):  # e.g. "not implemented for 'BFloat16'" on an old CPU build
        return float("inf")


def _median_ratio(pairs: list, product: Callable[[object, object], object], repeats: int) -> float:
    """The median over `repeats` passes of (seconds of the second pair's products) / (the first's); each pass times
    both back to back, so a busy machine slows both alike. `pairs`: two (x, [w, …]); `product(x, w)`."""
    import torch

    ratios = []
    with torch.inference_mode():
        for x, ws in pairs:
            product(x, ws[0])  # warm-up: the first call picks the kernel
        for _ in range(repeats):
            seconds = []
            for x, ws in pairs:
                start = time.perf_counter()
                for w in ws:
                    product(x, w)
                seconds.append(time.perf_counter() - start)
            ratios.append(seconds[1] / seconds[0])
    return sorted(ratios)[len(ratios) // 2]


def cpu_keeps_half(dtype: object) -> bool:
    """Does this CPU decode with weights in half precision `dtype` about as fast as in float32 (measured)?"""
    return half_decode_ratio(dtype) <= HALF_DECODE_SLACK


def products_decode_ratio(fmt: str, repeats: int = 3) -> float:
    """Seconds of torch's one-token weight-only product for packed `fmt` ("int8" or "int4", expert_formats'
    Int8Weight / Int4Weight) with bf16 activations over the same with float32 ones: below 1 bf16 decodes faster.
    Two weights of `half_decode_ratio`'s shape with constant codes (no packing): the gap is the kernels' arithmetic
    (3–10× here), not memory, so two suffice and the probe costs well under a second. Each pass times float32 then
    bf16, the median ratio counts. Where torch lacks the product it measures as infinitely slow."""
    import torch

    from fmoe_local.expert_formats import Int4Weight, Int8Weight, int4_group

    shape = (HALF_PROBE_OUT, HALF_PROBE_IN)
    group = int4_group(HALF_PROBE_IN)
    packed = None  # int4: torch's CPU layout of constant codes, made once (the products' speed does not hang on them)

    def weight(dtype: torch.dtype) -> object:
        if fmt == "int8":
            return Int8Weight(torch.full(shape, 77, dtype=torch.int8), torch.full((HALF_PROBE_OUT,), 0.01))
        sz = torch.full((HALF_PROBE_IN // group, HALF_PROBE_OUT, 2), 0.01, dtype=dtype)
        return Int4Weight(packed.clone(), sz, group)

    try:
        if fmt not in ("int8", "int4"):
            raise ValueError(f"No weight-only product for '{fmt}'.")
        if fmt == "int4":
            packed = Int4Weight.from_portable(torch.full((HALF_PROBE_OUT, HALF_PROBE_IN // 2), 0x97, dtype=torch.uint8))
        pairs = [
            (torch.full((1, HALF_PROBE_IN), 0.5, dtype=d), [weight(d) for _ in range(2)])
            for d in (torch.float32, torch.bfloat16)
        ]
        return _median_ratio(pairs, lambda x, w: w.linear(x, None), repeats)
    except (RuntimeError, TypeError, NotImplementedError, ValueError):  # a build without the product
        return float("inf")


def cpu_products_prefer_bf16(fmt: str) -> bool:
    """Does this CPU compute torch's weight-only products for `fmt` faster with bf16 activations than with float32
    ones (measured)? On CPUs without bf16 units they are 4–11× faster so (docs/bench.md, "Session 15")."""
    return products_decode_ratio(fmt) < 1.0
