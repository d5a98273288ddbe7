"""Measured speeds of this machine's memory and links: pinned host→GPU copies, DRAM reads, the CPU's last-level cache.

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
