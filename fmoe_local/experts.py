"""The experts implementation we register with transformers (ExpertsInterface): routed experts from cache slots.

Scope: the computation of one MoE layer's routed experts, numerically the same as transformers' `eager` loop
(ascending expert order, same ops, same accumulation) but reading weights from ExpertCache slots — or, for a miss
the miss planner sends to the host (miss_cost.py), computing it there from the host copy (cpu_experts.py). It does
NOT route (the model's own router did), prefetch, decide residency, or decide where a miss is computed.

Why a closure registered under a per-runtime name: transformers dispatches on `config._experts_implementation`, and
the function receives only the experts module; the closure maps that module to its MoE-layer index and engine
without injecting attributes into HF modules.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from fmoe_local import hf_internals
from fmoe_local.cache import ExpertCache
from fmoe_local.copier import Interrupted
from fmoe_local.cpu_experts import HostExperts, expert_forward
from fmoe_local.miss_cost import MissPlanner

_names = itertools.count()
# Up to this many routing entries, a Python set finds the distinct experts faster than torch.unique.
_SMALL = 256


class SlotRows(Mapping[str, torch.Tensor]):
    """One cache slot's weights by parameter name (views made only for the names the expert reads)."""

    __slots__ = ("_tensors", "_slot")

    def __init__(self, tensors: dict[str, torch.Tensor], slot: int) -> None:
        self._tensors, self._slot = tensors, slot

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name][self._slot]

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _slot_rows(cache: ExpertCache, slot: int) -> Mapping[str, torch.Tensor]:
    """A slot's weights as the expert reads them: through the host store's view (packed formats dequantise there,
    on the device, per expert computed)."""
    rows = SlotRows(cache.tensors, slot)
    view = getattr(cache.host, "view", None)
    return rows if view is None else view(rows)


def _device_expert(module: torch.nn.Module, x: torch.Tensor, cache: ExpertCache, s: int) -> torch.Tensor:
    """One expert from its cache slot, once the slot's copy is done (`before_use`: the compute stream waits)."""
    cache.before_use(s)
    return expert_forward(module, x, _slot_rows(cache, s))


@dataclass(frozen=True)
class HostMisses:
    """How this runtime handles misses now: the planner decides per miss, `experts` computes the host ones."""

    planner: MissPlanner
    experts: HostExperts


class OffloadedExperts:
    """Binds experts modules to MoE-layer indices and a cache; `register()` installs it in transformers.

    `misses_getter` gives the current miss handling (None or a planner in "copy" mode: every miss is loaded). A miss
    the planner sends to the host is computed there from the host copy: the layer's hidden states go to the host
    once, the device experts are launched first (on a GPU they run while the CPU computes), and the results are
    added in ascending expert order, as eager adds them.
    """

    def __init__(
        self,
        layer_of: dict[int, int],
        cache_getter: Callable[[], ExpertCache],
        misses_getter: Callable[[], HostMisses | None] = lambda: None,
    ) -> None:
        self._layer_of = layer_of  # id(experts module) → MoE-layer index
        self._cache = cache_getter
        self._misses = misses_getter
        self.name = f"fmoe_local_{next(_names)}"

    def register(self) -> str:
        ref = weakref.ref(self)

        def forward(module, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001 - transformers' signature
            this = ref()
            if this is None:
                raise RuntimeError("This model's fmoe-local runtime was closed; load the model again.")
            return this(module, hidden_states, top_k_index, top_k_weights)

        hf_internals.register_experts_implementation(self.name, forward)
        return self.name

    def __call__(
        self,
        module: torch.nn.Module,
        hidden_states: torch.Tensor,  # [T, H]
        top_k_index: torch.Tensor,  # [T, K]
        top_k_weights: torch.Tensor,  # [T, K]
    ) -> torch.Tensor:
        layer = self._layer_of[id(module)]
        cache = self._cache()
        if cache.interrupt.is_set():
            # Stop reaches a long prefill at the next MoE layer instead of after the whole forward pass.
            raise Interrupted("Stopped.")
        misses = self._misses()
        if misses is not None and misses.planner.mode == "copy":
            misses = None
        out = torch.zeros_like(hidden_states)
        if top_k_index.shape[0] == 1:
            # Decode (one token): its expert list is the routing decision itself; reading it is the layer's one
            # device→host sync, as in eager, and the rows need no masks.
            chosen = top_k_index[0].tolist()  # [K]
            if len(set(chosen)) == len(chosen) and len(chosen) <= cache.capacity:
                return self._one_token(module, layer, cache, misses, hidden_states, chosen, top_k_weights, out)
        # The routing decision has to reach the host to know what to load: one sync per layer, as in eager.
        if top_k_index.numel() <= _SMALL:
            flat = top_k_index.view(-1).tolist()  # a few ids: cheaper than torch.unique's dispatch
            counts = Counter(flat)
        else:
            ids, n = torch.unique(top_k_index, return_counts=True)
            counts = dict(zip(ids.tolist(), n.tolist(), strict=True))
        needed = sorted(e for e in counts if 0 <= e < module.num_experts)
        on_host = None if misses is None else (lambda e: misses.planner.on_host(counts[e]))
        routing_host = None  # top_k_index on the host, made once if some expert runs there
        for start in range(0, len(needed), cache.capacity):
            chunk = needed[start : start + cache.capacity]
            slots = cache.acquire(layer, chunk, on_host)
            try:
                host_x = None
                if min(slots) < 0:
                    host_x = hidden_states.to("cpu")  # [T, H]
                    routing_host = top_k_index.to("cpu") if routing_host is None else routing_host
                pending = []  # device experts are launched before the host ones run
                for e, s in zip(chunk, slots, strict=True):
                    if s < 0:
                        pending.append(None)
                        continue
                    # Same row order as eager: its mask is [K, T], so rows come ordered by top-k position first.
                    top_k_pos, token_idx = torch.where((top_k_index == e).T)
                    current = _device_expert(module, hidden_states[token_idx], cache, s)
                    pending.append((top_k_pos, token_idx, current))
                t0 = time.perf_counter()
                for i, (e, s) in enumerate(zip(chunk, slots, strict=True)):
                    if s >= 0:
                        continue
                    top_k_pos, token_idx = torch.where((routing_host == e).T)
                    current = misses.experts.forward(
                        module, layer, e, host_x[token_idx], cache.interrupt, cache.load_timeout_s
                    )
                    device = hidden_states.device
                    pending[i] = (top_k_pos.to(device), token_idx.to(device), current.to(device, hidden_states.dtype))
                if host_x is not None:
                    cache.counters.host_s += time.perf_counter() - t0
                for top_k_pos, token_idx, current in pending:
                    current = current * top_k_weights[token_idx, top_k_pos, None]
                    out.index_add_(0, token_idx, current.to(out.dtype))
            finally:
                cache.release([s for s in slots if s >= 0])
        return out

    @staticmethod
    def _one_token(
        module: torch.nn.Module,
        layer: int,
        cache: ExpertCache,
        misses: HostMisses | None,
        hidden_states: torch.Tensor,  # [1, H]
        chosen: list[int],  # [K] distinct expert ids, in top-k order
        top_k_weights: torch.Tensor,  # [1, K]
        out: torch.Tensor,  # [1, H] zeros
    ) -> torch.Tensor:
        """Eager's loop for a single token, without its masks: same experts in the same (ascending) order, and the
        same ops on the same values (the whole row for `hidden_states[token_idx]`, a [1, 1] weight slice for
        `top_k_weights[token_idx, top_k_pos, None]`, an in-place add for `index_add_` of one row)."""
        pos = {e: k for k, e in enumerate(chosen) if 0 <= e < module.num_experts}
        needed = sorted(pos)
        if not needed:  # every entry masked: the general path would not touch the cache either
            return out
        on_host = None if misses is None else (lambda e: misses.planner.on_host(1))
        slots = cache.acquire(layer, needed, on_host)
        try:
            if min(slots) >= 0:
                for e, s in zip(needed, slots, strict=True):
                    k = pos[e]
                    current = _device_expert(module, hidden_states, cache, s)
                    current = current * top_k_weights[:, k : k + 1]
                    out.add_(current.to(out.dtype))
                return out
            host_x = hidden_states.to("cpu")  # [1, H]
            # The device experts first: on a GPU they run while the CPU computes the others.
            currents = [None if s < 0 else _device_expert(module, hidden_states, cache, s) for s in slots]
            t0 = time.perf_counter()
            for i, (e, s) in enumerate(zip(needed, slots, strict=True)):
                if s < 0:
                    current = misses.experts.forward(module, layer, e, host_x, cache.interrupt, cache.load_timeout_s)
                    currents[i] = current.to(hidden_states.device, hidden_states.dtype)
            cache.counters.host_s += time.perf_counter() - t0
            for e, current in zip(needed, currents, strict=True):
                k = pos[e]
                current = current * top_k_weights[:, k : k + 1]
                out.add_(current.to(out.dtype))
        finally:
            cache.release([s for s in slots if s >= 0])
        return out
