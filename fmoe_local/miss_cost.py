"""Miss handling: what one miss costs copied versus computed on the CPU, measured once per machine and model, and
the decision `auto` makes from it for each miss.

Scope: `MissCosts` (the figures: copy time = expert bytes / measured host→device bandwidth, CPU time = measured
time of this model's expert shape with the chosen kernel at 1 and at `PROBE_TOKENS` tokens), `probe` (measures them
at load on the model's own host experts), and `MissPlanner` (mode + figures → "compute this miss on the host?").
It does NOT compute experts (cpu_experts.py) or count anything (cache.py).

Decision (auto): a miss of an expert that `tokens` tokens need goes to the CPU when cpu_s(tokens) < copy_s. Decode
(one token) usually goes to the CPU; a prefill's expert serves many tokens, its CPU time grows with them while the
copy's does not, so it is copied. Without a GPU there is no copy worth making (it would duplicate the expert in
RAM), so auto computes every miss on the CPU; a CPU slower than the copy even at one token is never chosen, and
`explain` says why.

Threads: the planner is read by the forward thread; it is replaced (never mutated) between requests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from fmoe_local import cpu_experts, hardware
from fmoe_local.cpu_experts import NATIVE, Kernel

PROBE_TOKENS = 16  # the second point of cpu_s(tokens): prefill-sized, still quick to time
PROBE_MAX_EXPERTS = 64
PROBE_MIN_BYTES = 64 * 1024**2
PROBE_MAX_BYTES = 1024**3  # more than the last-level cache of consumer CPUs: the probe reads from DRAM like a miss
H2D_PROBE_MB = 64


@dataclass(frozen=True)
class MissCosts:
    """The figures auto decides with, for one model on one machine (`to_dict`/`from_dict` to save and reuse)."""

    device: str  # "cuda" or "cpu": where the cache lives
    fmt: str  # stored format of the host experts (cpu_experts.FORMAT_OF_DTYPE)
    expert_bytes: int
    h2d_gbps: float  # measured host→device GB/s; 0 without a GPU
    cpu_kernel: str  # the kernel the CPU path uses
    cpu_s_1: float  # seconds for one expert and one token
    cpu_s_n: float  # seconds for one expert and `probe_tokens` tokens
    probe_tokens: int = PROBE_TOKENS
    probe_experts: int = 0  # how many distinct experts were cycled through
    kernels: dict[str, float] = field(default_factory=dict)  # every candidate's seconds per expert at one token

    @property
    def has_gpu(self) -> bool:
        return self.device != "cpu" and self.h2d_gbps > 0

    @property
    def copy_s(self) -> float:
        """Seconds to copy one expert to the device (infinite without a GPU: no copy is worth making)."""
        return self.expert_bytes / (self.h2d_gbps * 1e9) if self.has_gpu else math.inf

    def cpu_s(self, tokens: int) -> float:
        """Seconds for the CPU to compute one expert for `tokens` tokens: the line through the two measured points
        (weights read once, then per-token work), never below the one-token time."""
        if tokens <= 1 or self.probe_tokens <= 1:
            return self.cpu_s_1
        per_token = max(0.0, self.cpu_s_n - self.cpu_s_1) / (self.probe_tokens - 1)
        return self.cpu_s_1 + per_token * (tokens - 1)

    def prefer_cpu(self, tokens: int) -> bool:
        return self.cpu_s(tokens) < self.copy_s

    def cpu_token_limit(self) -> int:
        """The most tokens for which the CPU still beats the copy (0: never; a large number: always)."""
        if not self.has_gpu:
            return 1 << 30
        if not self.prefer_cpu(1):
            return 0
        per_token = max(0.0, self.cpu_s_n - self.cpu_s_1) / max(1, self.probe_tokens - 1)
        if per_token <= 0:
            return 1 << 30
        return 1 + int((self.copy_s - self.cpu_s_1) / per_token)

    def explain(self, mode: str) -> str:
        """One sentence for the Stats tab: the figures and what `mode` does with them."""
        cpu = f"the CPU computes one of this model's experts in {self.cpu_s_1 * 1e3:.2f} ms ({self.cpu_kernel})"
        if not self.has_gpu:
            return (
                f"No GPU: every miss is computed on the CPU, the only meaningful choice here; {cpu}."
                if mode != "copy"
                else f"No GPU: misses are copied within RAM because miss handling is set to copy; {cpu}."
            )
        copy = f"a copy takes {self.copy_s * 1e3:.2f} ms at the measured {self.h2d_gbps:.1f} GB/s"
        if mode == "copy":
            return f"Every miss is copied (miss handling: copy); {cpu}, {copy}."
        if mode == "cpu":
            return f"Every miss is computed on the CPU (miss handling: cpu); {cpu}, {copy}."
        limit = self.cpu_token_limit()
        if limit == 0:
            return f"Every miss is copied: {cpu}, slower than the copy ({copy}), so auto never chooses the CPU."
        if limit >= 1 << 30:
            return f"Every miss is computed on the CPU: {cpu}, faster than the copy ({copy}) at any token count."
        return (
            f"Misses needed by up to {limit} tokens (decode) are computed on the CPU, larger ones (prefill) copied: "
            f"{cpu}, {copy}."
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> MissCosts:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


class MissPlanner:
    """Decides, per miss, whether the forward pass computes it on the host: `on_host(tokens)`."""

    def __init__(self, mode: str, costs: MissCosts, forced: str | None = None) -> None:
        self.mode = forced or mode  # a policy may force its own (cpu_moe computes every miss on the CPU)
        self.costs = costs

    def on_host(self, tokens: int) -> bool:
        if self.mode == "copy":
            return False
        if self.mode == "cpu" or not self.costs.has_gpu:
            return True
        return self.costs.prefer_cpu(tokens)

    def explain(self) -> str:
        return self.costs.explain(self.mode)


def format_of(dtype: torch.dtype) -> str:
    fmt = cpu_experts.FORMAT_OF_DTYPE.get(dtype)
    if fmt is None:
        raise ValueError(f"No CPU expert path for experts stored as {dtype}; use miss handling copy.")
    return fmt


def probe_experts(host: object, max_bytes: int = PROBE_MAX_BYTES) -> list[Mapping[str, torch.Tensor]]:
    """Real experts to time, taken from the RAM tier in (layer, expert) order, spread over the layers: enough bytes
    to exceed the last-level cache (so they come from DRAM, as a miss does), within `max_bytes`."""
    target = min(max(2 * hardware.llc_bytes(), PROBE_MIN_BYTES), max_bytes)
    in_ram = getattr(host, "in_ram", lambda layer, expert: True)
    keys = [(e % host.num_layers, e // host.num_layers) for e in range(host.num_layers * host.num_experts)]
    keys = [(layer, (expert + layer) % host.num_experts) for layer, expert in keys]  # every layer, varied ids
    chosen = [k for k in keys if in_ram(*k)] or keys[:4]  # no RAM tier: a few reads from disk
    count = max(1, min(PROBE_MAX_EXPERTS, len(chosen), math.ceil(target / max(host.expert_bytes, 1))))
    view = getattr(host, "view", lambda rows: rows)  # packed formats: timed with their dequantising
    return [view(host.read(*k)) for k in chosen[:count]]


def probe(
    host: object,
    module: torch.nn.Module,
    device: torch.device,
    experts: Sequence[Mapping[str, torch.Tensor]] | None = None,
    h2d_gbps: float | None = None,
) -> tuple[MissCosts, Kernel]:
    """Measure the figures for this model here: host→device bandwidth, and every CPU kernel for its stored format
    on its own experts (only NATIVE on a CPU device: there the CPU path must equal the device path bit for bit)."""
    from fmoe_local import hf_internals

    fmt = format_of(host.param_dtype)
    transposed = hf_internals.is_transposed(module)
    candidates = [NATIVE] if device.type == "cpu" else cpu_experts.kernels_for(fmt, transposed)
    samples = list(experts) if experts is not None else probe_experts(host)
    hidden = _hidden_size(host, transposed)
    timings = [cpu_experts.time_kernel(k, module, samples, hidden, tokens=1, passes=2) for k in candidates]
    kernel = cpu_experts.choose(timings, candidates)
    chosen = next(t for t in timings if t.kernel == kernel.name)
    many = cpu_experts.time_kernel(kernel, module, samples[:8], hidden, tokens=PROBE_TOKENS, passes=2)
    if h2d_gbps is None:
        h2d_gbps = hardware.host_to_device_gbps(H2D_PROBE_MB) if device.type == "cuda" else 0.0
    name = f"{fmt} native" if kernel is NATIVE else kernel.name
    costs = MissCosts(
        device=device.type,
        fmt=fmt,
        expert_bytes=int(host.expert_bytes),
        h2d_gbps=float(h2d_gbps),
        cpu_kernel=name,
        cpu_s_1=chosen.seconds,
        cpu_s_n=max(many.seconds, chosen.seconds),
        probe_experts=len(samples),
        kernels={(f"{fmt} native" if t.kernel == NATIVE.name else t.kernel): t.seconds for t in timings},
    )
    return costs, kernel


def kernel_named(costs: MissCosts, device: torch.device) -> Kernel:
    """The kernel saved figures name (NATIVE on a CPU device, whatever they say)."""
    if device.type == "cpu" or costs.cpu_kernel == f"{costs.fmt} native":
        return NATIVE
    for k in cpu_experts.kernels_for(costs.fmt):
        if k.name == costs.cpu_kernel:
            return k
    raise ValueError(f"The saved CPU kernel '{costs.cpu_kernel}' is not available; measure again.")


def _hidden_size(host: object, transposed: bool) -> int:
    shapes = getattr(host, "dense_shapes", None) or host.param_shapes  # packed stores: the dense shapes
    shape = shapes["down_proj"]  # [H, I], or [I, H] in GPT-OSS's layout
    return int(shape[1] if transposed else shape[0])
