"""Cost-model presets for the replay benchmark: per-model expert sizes and per-layer compute time.

Scope: published architecture dimensions of seven MoE models (from each model's config.json on the Hugging Face
Hub, named in `source`), and the arithmetic that turns them into the replay's three costs: bytes of one expert
(bf16 or 4-bit), host→device bandwidth, and the time one MoE layer computes on an RTX 4090-class GPU. It does NOT
measure anything (fmoe_bench/live.py does, on a real GPU) and does not know about traces or policies.

Derivation of the compute time (decode, one token, one MoE layer): decoding is memory-bound, so the time is the
bytes of weights the layer reads — attention + router + shared experts (bf16) + the K routed experts (bf16 or
4-bit) — over an effective 70 % of the RTX 4090's 1008 GB/s, plus a fixed 50 µs for kernel launches (≈10
kernels × 5 µs). A pass over n tokens (prefill) takes at least 2 · active params · n FLOPs at an effective 50 % of
the 4090's 165 TFLOPS dense BF16 tensor rate; the replay takes the larger of the two. KV-cache reads are left
out (short contexts). 4-bit means 4.25 bits per weight (4-bit values + one 16-bit scale per 64 weights, or
MXFP4's 8-bit scale per 32); expert biases stay bf16.

CPU time of one expert (miss handling cpu/auto): the weights read once at the rate the chosen CPU kernel reaches
(`CPU_EXPERT_GBPS`, GB/s of stored bytes) plus 2 · expert params FLOPs per further token at `CPU_FLOPS`. Both are
measured, not quoted: `fmoe-local bench cpu-experts` on the machine named in `CPU_SOURCE` (docs/bench.md, "CPU
experts"); `--cpu-gbs` replaces the first with a user's own figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fmoe_local.expert_formats import BITS as EXPERT_BITS
from fmoe_local.miss_cost import PROBE_TOKENS, MissCosts

GPU_NAME = "RTX 4090-class"
GPU_MEM_BW = 1008e9  # B/s, GDDR6X, NVIDIA RTX 4090 spec sheet
GPU_BF16_FLOPS = 165e12  # dense BF16 tensor with FP32 accumulate, Ada Lovelace whitepaper
MEM_EFFICIENCY = 0.70
FLOP_EFFICIENCY = 0.50
LAUNCH_OVERHEAD_S = 50e-6
PCIE4_X16_BW = 25e9  # B/s host→device, pinned memory, PCIe 4.0 x16 (32 GB/s theoretical)
# Bits per weight by expert format (expert_formats.BITS); "4bit" is the generic 4.25 (scale per 64, or MXFP4's).
BITS = EXPERT_BITS | {"4bit": 4.25}
# Measured with `fmoe-local bench cpu-experts --shapes deepseek-v2-lite` (docs/bench.md, "CPU experts").
CPU_EXPERT_GBPS = 6.9  # GB/s of stored expert bytes: bf16 native at one token, one thread (DRAM read: 19 GB/s)
CPU_FLOPS = 89e9  # FLOP/s: the slope from 1 to 16 tokens of the same kernel (2.51 → 5.42 ms per expert)
CPU_SOURCE = "bench cpu-experts --threads 1 on the project's 2-core AVX2 machine without bf16 units, 2026-11-25"


def gqa_attention_params(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """q and o projections (heads·head_dim) plus k and v (kv_heads·head_dim), biases ignored."""
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


@dataclass(frozen=True)
class Preset:
    name: str
    source: str  # where the dimensions come from
    num_layers: int  # L: MoE layers (dense layers are not offloaded and not counted)
    num_experts: int  # J
    top_k: int  # K
    hidden: int  # H
    expert_intermediate: int  # I of one routed expert
    attention_params: int  # per layer
    shared_params: int = 0  # per MoE layer: shared experts (+ their gate), always resident
    expert_bias: bool = False  # gpt-oss experts carry biases

    @property
    def expert_params(self) -> int:
        """gate, up and down projections: 3·H·I weights (gpt-oss adds 2I + H biases)."""
        bias = 2 * self.expert_intermediate + self.hidden if self.expert_bias else 0
        return 3 * self.hidden * self.expert_intermediate + bias

    def expert_bytes(self, dtype: str = "bf16") -> int:
        bias = (2 * self.expert_intermediate + self.hidden) * 2 if self.expert_bias else 0
        weights = 3 * self.hidden * self.expert_intermediate
        return int(round(weights * _bits(dtype) / 8)) + bias

    @property
    def layer_active_params(self) -> int:
        """Weights one token touches in one MoE layer: attention, router, shared and K routed experts."""
        router = self.hidden * self.num_experts
        return self.attention_params + router + self.shared_params + self.top_k * self.expert_params

    def layer_time_s(self, dtype: str = "bf16") -> float:
        """Decode time of one MoE layer for one token (memory-bound; see the module docstring)."""
        resident = (self.attention_params + self.hidden * self.num_experts + self.shared_params) * 2
        read = resident + self.top_k * self.expert_bytes(dtype)
        return read / (GPU_MEM_BW * MEM_EFFICIENCY) + LAUNCH_OVERHEAD_S

    def cpu_expert_s(self, dtype: str = "bf16", cpu_gbps: float = CPU_EXPERT_GBPS) -> tuple[float, float]:
        """CPU seconds of one expert at one token, and per further token (see the module docstring)."""
        return self.expert_bytes(dtype) / (cpu_gbps * 1e9), 2 * self.expert_params / CPU_FLOPS

    def token_flop_time_s(self) -> float:
        """Compute-bound time of one layer per token (prefill)."""
        return 2 * self.layer_active_params / (GPU_BF16_FLOPS * FLOP_EFFICIENCY)

    def total_expert_bytes(self, dtype: str = "bf16") -> int:
        return self.num_layers * self.num_experts * self.expert_bytes(dtype)


def _bits(dtype: str) -> float:
    if dtype not in BITS:
        raise ValueError(f"Unknown expert format '{dtype}'. Use one of: {', '.join(BITS)}.")
    return BITS[dtype]


_HUB = "https://huggingface.co/{}/blob/main/config.json"

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "mixtral-8x7b",
            _HUB.format("mistralai/Mixtral-8x7B-v0.1"),
            32,
            8,
            2,
            4096,
            14336,
            gqa_attention_params(4096, 32, 8, 128),
        ),
        Preset(
            "qwen1.5-moe-a2.7b",
            _HUB.format("Qwen/Qwen1.5-MoE-A2.7B"),
            24,
            60,
            4,
            2048,
            1408,
            gqa_attention_params(2048, 16, 16, 128),
            shared_params=3 * 2048 * 5632 + 2048,  # one shared expert (I=5632) and its sigmoid gate
        ),
        Preset(
            "phi-3.5-moe",
            _HUB.format("microsoft/Phi-3.5-MoE-instruct"),
            32,
            16,
            2,
            4096,
            6400,
            gqa_attention_params(4096, 32, 8, 128),
        ),
        Preset(
            "olmoe-1b-7b",
            _HUB.format("allenai/OLMoE-1B-7B-0924"),
            16,
            64,
            8,
            2048,
            1024,
            gqa_attention_params(2048, 16, 16, 128),
        ),
        Preset(
            "deepseek-v2-lite",
            _HUB.format("deepseek-ai/DeepSeek-V2-Lite"),
            26,  # 27 layers, first_k_dense_replace = 1
            64,
            6,
            2048,
            1408,
            # MLA without q-LoRA: q (16·192), kv_a (512+64), kv_b (512 → 16·(128+128)), o (16·128)
            2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048,
            shared_params=2 * 3 * 2048 * 1408,  # two shared experts
        ),
        Preset(
            "qwen3-30b-a3b",
            _HUB.format("Qwen/Qwen3-30B-A3B"),
            48,
            128,
            8,
            2048,
            768,
            gqa_attention_params(2048, 32, 4, 128),
        ),
        Preset(
            "gpt-oss-20b",
            _HUB.format("openai/gpt-oss-20b"),
            24,
            32,
            4,
            2880,
            2880,
            gqa_attention_params(2880, 64, 8, 64),
            expert_bias=True,
        ),
    )
}


@dataclass(frozen=True)
class CostModel:
    """The replay's costs. Build with `cost_model(...)`; every field can be overridden from the CLI."""

    expert_bytes: int
    bandwidth: float  # B/s host→device
    layer_time_s: float  # one MoE layer, one decode token
    token_flop_time_s: float  # one MoE layer, per token when compute-bound (prefill)
    cpu_s_1: float = math.inf  # the CPU computes one expert for one token (miss handling cpu/auto)
    cpu_s_per_token: float = 0.0  # and each further token

    def cpu_s(self, tokens: int) -> float:
        return self.cpu_s_1 + max(0, tokens - 1) * self.cpu_s_per_token

    def miss_costs(self) -> MissCosts:
        """The runtime's figures for the same costs, so the replay's auto decides exactly as the runtime's does."""
        return MissCosts(
            device="cuda",
            fmt="preset",
            expert_bytes=self.expert_bytes,
            h2d_gbps=self.bandwidth / 1e9,
            cpu_kernel="preset",
            cpu_s_1=self.cpu_s_1,
            cpu_s_n=self.cpu_s(PROBE_TOKENS),
        )

    def layer_s(self, tokens: int) -> float:
        return max(self.layer_time_s, tokens * self.token_flop_time_s)

    @property
    def load_s(self) -> float:
        """Host→device time of one expert (what an on-demand miss stalls)."""
        return self.expert_bytes / self.bandwidth


def cost_model(
    preset: str,
    dtype: str = "bf16",
    bandwidth_gbs: float | None = None,
    expert_mb: float | None = None,
    layer_time_ms: float | None = None,
    cpu_gbs: float | None = None,
) -> CostModel:
    """The preset's costs with optional overrides (GB/s and MB are 1e9 and 1e6 bytes)."""
    if preset not in PRESETS:
        raise ValueError(f"Unknown preset '{preset}'. Choose one of: {', '.join(PRESETS)}.")
    p = PRESETS[preset]
    if cpu_gbs is not None and cpu_gbs <= 0:
        raise ValueError("The CPU's GB/s must be a positive number.")
    cpu_1, cpu_token = p.cpu_expert_s(dtype, cpu_gbs or CPU_EXPERT_GBPS)
    cm = CostModel(p.expert_bytes(dtype), PCIE4_X16_BW, p.layer_time_s(dtype), p.token_flop_time_s(), cpu_1, cpu_token)
    if bandwidth_gbs is not None:
        cm = replace(cm, bandwidth=bandwidth_gbs * 1e9)
    if expert_mb is not None:
        cpu_1 = expert_mb * 1e6 / ((cpu_gbs or CPU_EXPERT_GBPS) * 1e9)
        cm = replace(cm, expert_bytes=int(expert_mb * 1e6), cpu_s_1=cpu_1)
    if layer_time_ms is not None:
        cm = replace(cm, layer_time_s=layer_time_ms / 1e3)
    for name, value in (("bandwidth", cm.bandwidth), ("expert size", cm.expert_bytes), ("layer time", cm.layer_time_s)):
        if value <= 0:
            raise ValueError(f"The {name} must be a positive number.")
    return cm


def preset_table() -> str:
    """Markdown table of every preset (docs/bench.md)."""
    head = (
        "| preset | L (MoE) | J | K | H | I | expert MB bf16 | expert MB 4-bit | all experts GB bf16 "
        "| layer ms bf16 | layer ms 4-bit | expert load ms @25 GB/s bf16 | expert CPU ms bf16 (1 token) | source |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for p in PRESETS.values():
        rows.append(
            f"| {p.name} | {p.num_layers} | {p.num_experts} | {p.top_k} | {p.hidden} | {p.expert_intermediate} "
            f"| {p.expert_bytes('bf16') / 1e6:.1f} | {p.expert_bytes('4bit') / 1e6:.1f} "
            f"| {p.total_expert_bytes('bf16') / 1e9:.1f} | {p.layer_time_s('bf16') * 1e3:.3f} "
            f"| {p.layer_time_s('4bit') * 1e3:.3f} | {p.expert_bytes('bf16') / PCIE4_X16_BW * 1e3:.2f} "
            f"| {p.cpu_expert_s('bf16')[0] * 1e3:.2f} "
            f"| [config.json]({p.source}) |"
        )
    return head + "\n".join(rows) + "\n"
