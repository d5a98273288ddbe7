"""Offload: where every routed expert is and where it is computed — the one object the forward pass asks.

Scope: owns the expert cache (cache.py), the prefetcher and its queue (prefetcher.py), the policy both of them
call, and the miss handling (miss_cost.py's planner, cpu_experts.py's host experts). The forward pass asks it for a
layer's experts (`acquire`) and gets, per expert, a device slot or −1, "compute it from the host copy"
(`host_expert`); the engine brackets requests and changes settings through it. It does NOT run the model
(engine.py, experts.py) or decide what to prefetch or evict (the policy does).

Threads — the one rule for all the state below:
- Every public method is called by the thread that runs the model (the runtime's worker, which is the forward
  thread); the settings methods (`set_policy`, `set_miss_handling`, `set_load_timeout`, `resize`, `reset`) only
  between requests. Nothing else may touch the cache, the prefetch queue or the policy.
- Two threads work for it and are never called from outside: the prefetcher's worker (runs the policy's matcher —
  begin_request / begin_iteration / observe_layer / end_iteration / end_request — and the prefetch copies) and the
  cache's loader (runs on-demand reads, so that a read stuck in the kernel cannot hold the forward thread).
- The policy is called only from here. record_access and choose_victims run under the cache's lock — from the
  forward thread for an access or a miss's slot, from the prefetcher's worker for a prefetch's slot — so never
  concurrently with each other; the matcher calls run on the prefetcher's worker and may overlap them, so a policy
  guards what the two groups share (fmoe: its own lock) and never waits for the matcher in record_access or
  choose_victims.
- Every wait has a deadline (`load_timeout_s`) and ends within 50 ms of `interrupt` (Stop, close); a failure on a
  worker reaches the forward thread as ExpertLoadError or PrefetcherFailed, never as a hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from fmoe_local.cache import ExpertCache, ExpertLoadError
from fmoe_local.copier import Interrupted
from fmoe_local.cpu_experts import HostExperts, Kernel, expert_forward
from fmoe_local.host import HostStore
from fmoe_local.miss_cost import MissCosts, MissPlanner
from fmoe_local.policies.base import ExpertKey, Policy
from fmoe_local.prefetcher import Prefetcher, PrefetcherFailed
from fmoe_local.stats import LayerCounters


class SlotRows(Mapping[str, torch.Tensor]):
    """One cache slot's weights by parameter name (views made only for the names the expert reads)."""

    __slots__ = ("_tensors", "_slot")

    def __init__(self, tensors: dict[str, torch.Tensor], slot: int) -> None:
        self._tensors, self._slot = tensors, slot

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name][self._slot]

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self):  # noqa: ANN204 - Mapping's signature
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class Offload:
    def __init__(
        self,
        host: HostStore,
        device: torch.device,
        capacity: int,
        policy: Policy,
        counters: LayerCounters,
        costs: MissCosts,
        kernel: Kernel,
        *,
        miss_handling: str = "auto",
        load_timeout_s: float = 60.0,
        copy_chunk_bytes: int = 32 * 1024**2,
        synchronous: bool = False,
        interrupt: threading.Event | None = None,
        pinned_bytes: int = 0,
        streams: object | None = None,
    ) -> None:
        """`pinned_bytes`: on a GPU, how much of the host store's RAM experts to page-lock (Offload.pinned_bytes
        says how much was). `streams`: the cache's CUDA operations (tests pass a fake, cache.py says why)."""
        self.host = host
        self.device = device
        self.counters = counters
        self.costs = costs
        self.interrupt = interrupt or threading.Event()
        self._copy_chunk_bytes = copy_chunk_bytes
        self._load_timeout_s = load_timeout_s
        self._policy = policy
        self._streams = streams
        self.cache = self._new_cache(capacity)
        # Before any copying thread exists: pinning moves the RAM experts into their blocks.
        self.pinned_bytes = self.cache.pin_host(pinned_bytes)
        self._prefetcher = Prefetcher(self.cache, policy, synchronous=synchronous)
        self._host_experts = HostExperts(host, kernel)
        self._mode = miss_handling
        self._planner = self._new_planner()
        self._broken = ""  # set when a resize could not allocate its cache: every access says so until one can
        self._tell_capacity()

    def _new_cache(self, capacity: int) -> ExpertCache:
        return ExpertCache(
            self.host,
            capacity,
            self.device,
            self._policy,
            self.counters,
            self.interrupt,
            self._load_timeout_s,
            copy_chunk_bytes=self._copy_chunk_bytes,
            streams=self._streams,
        )

    def _new_planner(self) -> MissPlanner:
        # A policy may force its own miss handling (cpu_moe computes every miss on the CPU).
        return MissPlanner(self._mode, self.costs, self._policy.miss_handling)

    def _tell_capacity(self) -> None:
        """Policies that place experts by the cache's size (cpu_moe) learn it whenever a cache or policy is made."""
        self._policy.set_capacity(self.cache.capacity)

    # ---- what the rest of the runtime reads ----------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def host_kernel(self) -> Kernel:
        """The kernel misses computed on the host use (measured at load: miss_cost.probe)."""
        return self._host_experts.kernel

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def miss_handling(self) -> str:
        """The miss handling in force: the setting, or what the policy forces."""
        return self._planner.mode

    def explain_misses(self) -> str:
        """One sentence: what the miss handling does with the measured figures, and why (the Stats tab shows it)."""
        return self._planner.explain()

    @property
    def per_layer(self) -> bool:
        """Whether the running forward pass is handled layer by layer (False once every expert is resident)."""
        return self._prefetcher.per_layer

    # ---- forward thread: one MoE layer ---------------------------------------------------------------------------
    def acquire(self, layer: int, experts: Sequence[int], tokens: Callable[[int], int] | None = None) -> list[int]:
        """The slots of `experts` of `layer`, pinned until `release`; −1 for a miss to compute from the host copy
        (`host_expert`) once this returns: the other misses' copies are under way by then, so the CPU's share and the
        link's run at once — what the miss planner plans the layer's misses for. `tokens(expert)`: how many tokens
        the expert computes, what the planner weighs (None: one each)."""
        if self._broken:
            raise ExpertLoadError(self._broken)
        if self.interrupt.is_set():
            # Stop reaches a long prefill at the next MoE layer instead of after the whole forward pass.
            raise Interrupted("Stopped.")
        planner = self._planner
        if planner.mode == "copy":
            return self.cache.acquire(layer, experts)
        count = tokens or (lambda e: 1)
        return self.cache.acquire(layer, experts, lambda missing: planner.plan([count(e) for e in missing]))

    def device_expert(self, module: torch.nn.Module, x: torch.Tensor, slot: int) -> torch.Tensor:
        """One expert computed from its acquired slot, once the slot's copy is done (on CUDA the compute stream waits
        for it; the host never does). Packed formats dequantise here, through the host store's view."""
        self.cache.before_use(slot)
        rows = SlotRows(self.cache.tensors, slot)
        return expert_forward(module, x, self.host.view(rows))

    def host_expert(self, module: torch.nn.Module, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """A miss `acquire` gave −1, computed by the CPU from the host copy; `x` is on the host. Its time counts as
        host time in the request's statistics."""
        t0 = time.perf_counter()
        try:
            return self._host_experts.forward(module, layer, expert, x, self.interrupt, self._load_timeout_s)
        finally:
            self.counters.host_s += time.perf_counter() - t0

    def release(self, slots: Sequence[int]) -> None:
        """The layer is done with the slots `acquire` gave (−1 entries are ignored)."""
        self.cache.release([s for s in slots if s >= 0])

    # ---- forward thread: requests and forward passes --------------------------------------------------------------
    def publish(self, kind: str, layer: int = -1, value: object = None, lookahead: object = None) -> None:
        """The router observer's events (begin_iteration, layer) for the matcher; never blocks on it."""
        self._prefetcher.publish(kind, layer, value, lookahead)

    def begin_request(self, request_id: int) -> None:
        self._prefetcher.publish("begin_request", value=request_id)

    def end_iteration(self) -> None:
        """A forward pass ended: raises PrefetcherFailed for a background failure since the last one."""
        self._prefetcher.raise_if_failed()
        self._prefetcher.publish("end_iteration")

    def end_request(self, timeout_s: float) -> PrefetcherFailed | None:
        """Close the request's bookkeeping, even after a failure; returns (not raises) a background failure found
        now, or a worker that did not go idle within `timeout_s`, for the caller to report if nothing else failed."""
        error: PrefetcherFailed | None = None
        try:
            self._prefetcher.publish("end_request")
        except PrefetcherFailed as exc:
            error = exc
        if not self._prefetcher.wait_idle(timeout_s) and error is None:
            error = PrefetcherFailed(
                f"Expert prediction did not finish within {timeout_s:.0f} s: a read from the model files may be "
                "stuck. Check the disk, or load the model again."
            )
        self.cache.drop_unused_prefetches()
        return error

    def raise_if_failed(self) -> None:
        self._prefetcher.raise_if_failed()

    def resident(self) -> list[ExpertKey]:
        return self.cache.resident()

    def resident_bytes(self) -> int:
        return self.cache.resident_bytes()

    # ---- between requests: settings ------------------------------------------------------------------------------
    def wait_idle(self, timeout_s: float) -> bool:
        return self._prefetcher.wait_idle(timeout_s)

    def set_policy(self, policy: Policy) -> None:
        """A new policy for the matcher and the cache alike (its forced miss handling, its capacity)."""
        self._prefetcher.set_policy(policy)
        self._policy = policy
        self.cache.policy = policy
        self._planner = self._new_planner()
        self._tell_capacity()

    def set_miss_handling(self, mode: str) -> None:
        self._mode = mode
        self._planner = self._new_planner()

    def set_load_timeout(self, seconds: float) -> None:
        self._load_timeout_s = seconds
        self.cache.load_timeout_s = seconds

    def resize(self, capacity: int) -> None:
        """A new, cold cache of `capacity` slots. The old slots are freed first, so both never sit on the device
        together; raises (with the old cache gone) when the new one cannot be allocated."""
        self._prefetcher.wait_idle(self._load_timeout_s)
        self.cache.close()
        self.cache.tensors.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            self.cache = self._new_cache(capacity)
        except BaseException:
            # The old cache is gone: no request may use it (a hit would read freed slots, a miss wait on a closed
            # loader until its deadline). Each says this sentence until a resize succeeds.
            self._broken = "The expert cache could not be set up again. Load the model again (Models tab)."
            raise
        self._broken = ""
        self._prefetcher.cache = self.cache
        self._tell_capacity()

    def reset(self) -> None:
        """Every expert back to RAM only: a cold cache of the same size."""
        self.resize(self.cache.capacity)

    def close(self) -> None:
        self.interrupt.set()
        self._prefetcher.close()
        self.cache.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy may still read a pinned block when the host store closes
        self.cache.tensors.clear()
        self._host_experts.close()
