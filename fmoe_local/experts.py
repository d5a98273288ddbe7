"""The experts implementation we register with transformers (ExpertsInterface): routed experts from cache slots.

Scope: the computation of one MoE layer's routed experts, numerically the same as transformers' `eager` loop
(ascending expert order, same ops, same accumulation), each expert computed where the Offload (offload.py) says:
from its cache slot, or — a miss sent to the host — by the CPU from the host copy. It does NOT route (the model's
own router did), prefetch, decide residency, or decide where a miss is computed.

Why a closure registered under a per-runtime name: transformers dispatches on `config._experts_implementation`, and
the function receives only the experts module; the closure maps that module to its MoE-layer index and engine
without injecting attributes into HF modules.
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter

import torch

from fmoe_local import hf_internals
from fmoe_local.offload import Offload

_names = itertools.count()
# Up to this many routing entries, a Python set finds the distinct experts faster than torch.unique.
_SMALL = 256


class OffloadedExperts:
    """Binds experts modules to MoE-layer indices and an Offload; `register()` installs it in transformers.

    A miss the Offload sends to the host is computed there: the layer's hidden states go to the host once, the device
    experts are launched first (on a GPU they run while the CPU computes), and the results are added in ascending
    expert order, as eager adds them.
    """

    def __init__(self, layer_of: dict[int, int], offload: Offload) -> None:
        self._layer_of = layer_of  # id(experts module) → MoE-layer index
        self._offload = offload  # lives as long as the engine: a resize replaces the cache inside it
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
        offload = self._offload
        out = torch.zeros_like(hidden_states)
        if top_k_index.shape[0] == 1:
            # Decode (one token): its expert list is the routing decision itself; reading it is the layer's one
            # device→host sync, as in eager, and the rows need no masks.
            chosen = top_k_index[0].tolist()  # [K]
            if len(set(chosen)) == len(chosen) and len(chosen) <= offload.capacity:
                return self._one_token(module, layer, offload, hidden_states, chosen, top_k_weights, out)
        # The routing decision has to reach the host to know what to load: one sync per layer, as in eager.
        if top_k_index.numel() <= _SMALL:
            flat = top_k_index.view(-1).tolist()  # a few ids: cheaper than torch.unique's dispatch
            counts = Counter(flat)
        else:
            ids, n = torch.unique(top_k_index, return_counts=True)
            counts = dict(zip(ids.tolist(), n.tolist(), strict=True))
        needed = sorted(e for e in counts if 0 <= e < module.num_experts)
        routing_host = None  # top_k_index on the host, made once if some expert runs there
        for start in range(0, len(needed), offload.capacity):
            chunk = needed[start : start + offload.capacity]
            slots = offload.acquire(layer, chunk, counts.__getitem__)
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
                    current = offload.device_expert(module, hidden_states[token_idx], s)
                    pending.append((top_k_pos, token_idx, current))
                for i, (e, s) in enumerate(zip(chunk, slots, strict=True)):
                    if s >= 0:
                        continue
                    top_k_pos, token_idx = torch.where((routing_host == e).T)
                    current = offload.host_expert(module, layer, e, host_x[token_idx])
                    device = hidden_states.device
                    pending[i] = (top_k_pos.to(device), token_idx.to(device), current.to(device, hidden_states.dtype))
                for top_k_pos, token_idx, current in pending:
                    current = current * top_k_weights[token_idx, top_k_pos, None]
                    out.index_add_(0, token_idx, current.to(out.dtype))
            finally:
                offload.release(slots)
        return out

    @staticmethod
    def _one_token(
        module: torch.nn.Module,
        layer: int,
        offload: Offload,
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
        slots = offload.acquire(layer, needed)
        try:
            if min(slots) >= 0:
                for e, s in zip(needed, slots, strict=True):
                    k = pos[e]
                    current = offload.device_expert(module, hidden_states, s)
                    current = current * top_k_weights[:, k : k + 1]
                    out.add_(current.to(out.dtype))
                return out
            host_x = hidden_states.to("cpu")  # [1, H]
            # The device experts first: on a GPU they run while the CPU computes the others.
            currents = [None if s < 0 else offload.device_expert(module, hidden_states, s) for s in slots]
            for i, (e, s) in enumerate(zip(needed, slots, strict=True)):
                if s < 0:
                    current = offload.host_expert(module, layer, e, host_x)
                    currents[i] = current.to(hidden_states.device, hidden_states.dtype)
            for e, current in zip(needed, currents, strict=True):
                k = pos[e]
                current = current * top_k_weights[:, k : k + 1]
                out.add_(current.to(out.dtype))
        finally:
            offload.release(slots)
        return out
