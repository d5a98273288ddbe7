"""Measured speeds of this machine's memory and links: pinned host→GPU copies, DRAM reads, the CPU's last-level cache,
and a one-token product in bf16 against float32 (`cpu_keeps_half`: does this CPU decode bf16 about as fast?).

Scope: each function measures (or reads) one figure when called, allocating what it measures with; callers decide
when (miss_cost.py at a model's first load, fmoe_bench/cpu_experts.py). It does NOT probe what the machine has
(hardware.py) or decide anything from the figures.
"""

from __future__ import annotations

import time
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
        ratios = []
        with torch.inference_mode():
            for x, ws in pairs:
                F.linear(x, ws[0])  # warm-up: the first call picks the kernel
            for _ in range(repeats):
                seconds = []
                for x, ws in pairs:
                    start = time.perf_counter()
                    for w in ws:
                        F.linear(x, w)
                    seconds.append(time.perf_counter() - start)
                ratios.append(seconds[1] / seconds[0])
    except (RuntimeError, TypeError):  # e.g. "not implemented for 'BFloat16'" on an old CPU build
        return float("inf")
    return sorted(ratios)[len(ratios) // 2]


def cpu_keeps_half(dtype: object) -> bool:
    """Does this CPU decode with weights in half precision `dtype` about as fast as in float32 (measured)?"""
    return half_decode_ratio(dtype) <= HALF_DECODE_SLACK
