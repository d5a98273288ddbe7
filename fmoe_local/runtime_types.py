"""What the Runtime hands its callers (runtime.py): the events of `stream` — `TextDelta` per token, then one
`Finished` with the request's statistics — and `ModelInfo`, the loaded model as `Runtime.info` describes it.

Plain frozen dataclasses, light to import (no torch): the UI and the OpenAI-compatible API check events against
them without loading the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from fmoe_local.stats import RequestStats


@dataclass(frozen=True)
class TextDelta:
    text: str
    token_id: int


@dataclass(frozen=True)
class Finished:
    text: str
    token_ids: list[int]
    stats: RequestStats
    reason: str  # "stop" (end of sequence), "length", "context" (the model's context is full), "cancelled", "error"
    error: str = ""

    @classmethod
    def failed(cls, error: str) -> Finished:
        """A request that ended before any text with `error`, a sentence for the user."""
        return cls("", [], RequestStats(finish_reason="error"), "error", error=error)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    family: str
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    resident_bytes: int
    device: str
    dtype: str
    cache_experts: int
    cache_gb: float
    policy: str
    prefetch_distance: int
    store_capacity: int
    miss_handling: str = "copy"  # in force: the setting, or the one the policy forces (cpu_moe: cpu)
    host_ram_bytes: int = 0  # expert weights held in RAM (the rest are read from disk per use)
    expert_format: str = "bf16"  # how experts are stored in RAM and the cache (auto resolved: expert_formats.py)
    dense_format: str = "bf16"  # how the dense linear weights are stored (auto resolved: dense_formats.py)
    # What multiplies them packed int8: "openvino", "torch" or both ("" not int8; dense_formats.product_name).
    dense_product: str = ""
    # OpenVINO's repacked copy of the dense int8 codes, counted in `resident_bytes` (RAM held) but not read per token
    # beside them: a token reads the copy instead of the codes.
    dense_repacked_bytes: int = 0
