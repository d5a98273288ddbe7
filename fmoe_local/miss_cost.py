"""Miss handling: what one miss costs copied versus computed on the CPU, measured once per machine and model, and
how `auto` shares a layer's misses between the two.

Scope: `MissCosts` (the figures: copy time = expert bytes / measured host→device bandwidth, CPU time = measured
time of this model's expert shape with the chosen kernel at 1 and at `PROBE_TOKENS` tokens), `probe` (measures them
at load on the model's own host experts), and `MissPlanner` (mode + figures → which of a layer's misses the host
computes). It does NOT compute experts (cpu_experts.py) or count anything (cache.py).

Decision (auto), per layer: the copies of a layer's misses are issued first and land while the forward thread
computes the host's share, so the link and the CPU work at once and the layer waits for whichever finishes last.
`MissPlanner.plan` shares the misses by list scheduling on those two: in order of decreasing CPU time (an expert
many prefill tokens need goes to the link first, its CPU time grows with them while the copy's does not), each miss
goes to the one that would finish it earlier given what it already has; a tie is copied (a copied expert stays
resident for the next token). So a CPU slower than the copy still takes a miss when the link is busy enough, and a
CPU faster than it still leaves some to the link. Without a GPU there is no copy worth making (it would duplicate
the expert in RAM), so auto computes every miss on the CPU; `explain` says what the figures make of it.

The overlap is whole for page-locked host experts (their landing is the DMA issued); for the others the loader's
copy into a staging buffer comes before the landing, so less of the link's time runs under the CPU's. A policy with
a `miss_handling` attribute forces the mode (cpu_moe: cpu). The figures are measured at load and may be saved by the
app and handed back to a later load (`Runtime.load(..., miss_costs=)`), reused when they fit the model and device.
Precision: on a CPU device the CPU path runs the device path's own ops (bit-identical, cpu_experts.NATIVE); on a GPU
it runs the measured fastest kernel, which may compute in float32 where the GPU computes in bf16.

Threads: the planner is read by the forward thread; it is replaced (never mutated) between requests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from fmoe_local import bandwidth, cpu_experts
from fmoe_local.cpu_experts import NATIVE, Kernel
from fmoe_local.host import HostStore

PROBE_TOKENS = 16  # the second point of cpu_s(tokens): prefill-sized, still quick to time
PROBE_MAX_EXPERTS = 64
PROBE_MIN_BYTES = 64 * 1024**2
PROBE_MAX_BYTES = 1024**3  # more than the last-level cache of consumer CPUs: the probe reads from DRAM like a miss
H2D_PROBE_MB = 64
EXPLAIN_MAX_MISSES = 64  # the most misses of one layer the Stats sentence considers


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

    def explain(self, mode: str, why: str = "") -> str:
        """One sentence for the Stats tab: the figures and what `mode` does with them. `why`: who chose `mode`
        (default: the miss handling setting)."""
        why = why or f"miss handling: {mode}"
        cpu = f"the CPU computes one of this model's experts in {self.cpu_s_1 * 1e3:.2f} ms ({self.cpu_kernel})"
        if not self.has_gpu:
            return (
                f"No GPU: every miss is computed on the CPU, the only meaningful choice here; {cpu}."
                if mode != "copy"
                else f"No GPU: misses are copied within RAM because miss handling is set to copy; {cpu}."
            )
        copy = f"a copy takes {self.copy_s * 1e3:.2f} ms at the measured {self.h2d_gbps:.1f} GB/s"
        if mode == "copy":
            return f"Every miss is copied ({why}); {cpu}, {copy}."
        if mode == "cpu":
            return f"Every miss is computed on the CPU ({why}); {cpu}, {copy}."
        planner = MissPlanner("auto", self)
        first = next((n for n in range(1, EXPLAIN_MAX_MISSES + 1) if any(planner.plan([1] * n))), 0)
        if not first:
            return (
                f"Every miss is copied: {cpu}, so much slower than the copy ({copy}) that even a layer with "
                f"{EXPLAIN_MAX_MISSES} misses finishes sooner copying them all."
            )
        share = sum(planner.plan([1] * EXPLAIN_MAX_MISSES)) / EXPLAIN_MAX_MISSES
        start = (
            "a layer's lone one-token miss is computed on the CPU"
            if first == 1
            else f"a layer's lone one-token miss is copied, and the CPU takes a share from {first} misses on"
        )
        return (
            f"Each layer's misses are shared between the copy link and the CPU, which work at once, so that the last "
            f"finishes soonest: {cpu}, {copy}. So {start}; of many misses about {share:.0%} go to the CPU, and an "
            "expert many prefill tokens need costs the CPU more, so it is copied sooner."
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> MissCosts:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


class MissPlanner:
    """Decides which of a layer's misses the forward pass computes on the host: `plan(tokens)`."""

    def __init__(self, mode: str, costs: MissCosts, forced: str | None = None) -> None:
        self.mode = forced or mode  # a policy may force its own (cpu_moe computes every miss on the CPU)
        self.costs = costs
        # Said when the policy overrides the setting: the Settings tab still shows the setting's value.
        self.why = (
            f"the policy's own choice; the miss handling setting, {mode}, applies to other policies"
            if (forced and forced != mode)
            else ""
        )

    def plan(self, tokens: Sequence[int]) -> list[bool]:
        """For a layer's misses, needed by `tokens[i]` tokens each: True for those the host computes, False for
        those copied (list scheduling on the link and the CPU under auto; the module docstring says why)."""
        if self.mode == "copy":
            return [False] * len(tokens)
        if self.mode == "cpu" or not self.costs.has_gpu:
            return [True] * len(tokens)
        copy_s = self.costs.copy_s
        cpu = [self.costs.cpu_s(t) for t in tokens]
        on_host = [False] * len(tokens)
        link_end = cpu_end = 0.0
        for i in sorted(range(len(tokens)), key=cpu.__getitem__, reverse=True):  # stable: ties keep their order
            if cpu_end + cpu[i] < link_end + copy_s:
                on_host[i], cpu_end = True, cpu_end + cpu[i]
            else:
                link_end += copy_s
        return on_host

    def explain(self) -> str:
        return self.costs.explain(self.mode, self.why)


def format_of(dtype: torch.dtype) -> str:
    fmt = cpu_experts.FORMAT_OF_DTYPE.get(dtype)
    if fmt is None:
        raise ValueError(f"No CPU expert path for experts stored as {dtype}; use miss handling copy.")
    return fmt


def probe_experts(host: HostStore, max_bytes: int = PROBE_MAX_BYTES) -> list[Mapping[str, torch.Tensor]]:
    """Real experts to time, taken from the RAM tier in (layer, expert) order, spread over the layers: enough bytes
    to exceed the last-level cache (so they come from DRAM, as a miss does), within `max_bytes`."""
    target = min(max(2 * bandwidth.llc_bytes(), PROBE_MIN_BYTES), max_bytes)
    keys = [(e % host.num_layers, e // host.num_layers) for e in range(host.num_layers * host.num_experts)]
    keys = [(layer, (expert + layer) % host.num_experts) for layer, expert in keys]  # every layer, varied ids
    chosen = [k for k in keys if host.in_ram(*k)] or keys[:4]  # no RAM tier: a few reads from disk
    count = max(1, min(PROBE_MAX_EXPERTS, len(chosen), math.ceil(target / max(host.expert_bytes, 1))))
    return [host.view(host.read(*k)) for k in chosen[:count]]  # packed formats: timed with their dequantising


def probe(
    host: HostStore,
    module: torch.nn.Module,
    device: torch.device,
    experts: Sequence[Mapping[str, torch.Tensor]] | None = None,
    h2d_gbps: float | None = None,
) -> tuple[MissCosts, Kernel]:
    """Measure the figures for this model here: host→device bandwidth, and every CPU kernel for its stored format
    on its own experts (on a CPU device only its own ops, and for int8 in float32 the one alternative that computes
    the same product: cpu_experts.device_candidates)."""
    from fmoe_local import hf_internals

    fmt = format_of(host.param_dtype)
    transposed = hf_internals.is_transposed(module)
    if device.type == "cpu":
        candidates = cpu_experts.device_candidates(host.expert_format, host.param_dtype, transposed)
    else:
        candidates = cpu_experts.kernels_for(fmt, transposed)
    samples = list(experts) if experts is not None else probe_experts(host)
    hidden = _hidden_size(host, transposed)
    timings = [cpu_experts.time_kernel(k, module, samples, hidden, tokens=1, passes=2) for k in candidates]
    kernel = cpu_experts.choose(timings, candidates)
    chosen = next(t for t in timings if t.kernel == kernel.name)
    many = cpu_experts.time_kernel(kernel, module, samples[:8], hidden, tokens=PROBE_TOKENS, passes=2)
    if h2d_gbps is None:
        h2d_gbps = bandwidth.host_to_device_gbps(H2D_PROBE_MB) if device.type == "cuda" else 0.0
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
    """The kernel saved figures name (on a CPU device NATIVE unless they name INT8_BLOCKS_ON_CPU, its one
    alternative)."""
    if device.type == "cpu":
        return cpu_experts.INT8_BLOCKS_ON_CPU if costs.cpu_kernel == cpu_experts.INT8_BLOCKS_ON_CPU.name else NATIVE
    if costs.cpu_kernel == f"{costs.fmt} native":
        return NATIVE
    for k in cpu_experts.kernels_for(costs.fmt):
        if k.name == costs.cpu_kernel:
            return k
    raise ValueError(f"The saved CPU kernel '{costs.cpu_kernel}' is not available; measure again.")


def _hidden_size(host: HostStore, transposed: bool) -> int:
    shape = host.dense_shapes["down_proj"]  # [H, I], or [I, H] in GPT-OSS's layout
    return int(shape[1] if transposed else shape[0])
