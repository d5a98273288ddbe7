"""The experts implementation we register with transformers (ExpertsInterface): routed experts from cache slots.

Scope: the computation of one MoE layer's routed experts, numerically the same as transformers' `eager` loop
(ascending expert order, same ops, same accumulation) but reading weights from ExpertCache slots. It does NOT route
(the model's own router did), prefetch, or decide residency.

Why a closure registered under a per-runtime name: transformers dispatches on `config._experts_implementation`, and
the function receives only the experts module; the closure maps that module to its MoE-layer index and engine
without injecting attributes into HF modules.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fmoe_local import hf_internals
from fmoe_local.cache import ExpertCache
from fmoe_local.copier import Interrupted

_names = itertools.count()
# Up to this many routing entries, a Python set finds the distinct experts faster than torch.unique.
_SMALL = 256


def expert_forward(module: torch.nn.Module, x: torch.Tensor, w: dict[str, torch.Tensor], s: int) -> torch.Tensor:
    """One expert on its tokens, written exactly as the eager loop of the module's class writes it."""
    if hf_internals.is_transposed(module):
        # GPT-OSS layout: [H, 2I] and [I, H], interleaved gate/up, with biases.
        gate_up = x @ w["gate_up_proj"][s]
        if hf_internals.has_bias(module):
            gate_up = gate_up + w["gate_up_proj_bias"][s]
        h = hf_internals.apply_gate(module, gate_up)
        out = h @ w["down_proj"][s]
        if hf_internals.has_bias(module):
            out = out + w["down_proj_bias"][s]
        return out

    def bias(name: str) -> torch.Tensor | None:
        return w[name][s] if name in w else None

    if hf_internals.has_gate(module):
        h = hf_internals.apply_gate(module, F.linear(x, w["gate_up_proj"][s], bias("gate_up_proj_bias")))
    else:
        h = hf_internals.activation(module)(F.linear(x, w["up_proj"][s], bias("up_proj_bias")))
    return F.linear(h, w["down_proj"][s], bias("down_proj_bias"))


class OffloadedExperts:
    """Binds experts modules to MoE-layer indices and a cache; `register()` installs it in transformers."""

    def __init__(self, layer_of: dict[int, int], cache_getter: Callable[[], ExpertCache]) -> None:
        self._layer_of = layer_of  # id(experts module) → MoE-layer index
        self._cache = cache_getter
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
        out = torch.zeros_like(hidden_states)
        if top_k_index.shape[0] == 1:
            # Decode (one token): its expert list is the routing decision itself; reading it is the layer's one
            # device→host sync, as in eager, and the rows need no masks.
            chosen = top_k_index[0].tolist()  # [K]
            if len(set(chosen)) == len(chosen) and len(chosen) <= cache.capacity:
                return self._one_token(module, layer, cache, hidden_states, chosen, top_k_weights, out)
        # The routing decision has to reach the host to know what to load: one sync per layer, as in eager.
        if top_k_index.numel() <= _SMALL:
            needed = sorted(set(top_k_index.view(-1).tolist()))  # a few ids: cheaper than torch.unique's dispatch
        else:
            needed = torch.unique(top_k_index).tolist()
        needed = [e for e in needed if 0 <= e < module.num_experts]
        for start in range(0, len(needed), cache.capacity):
            chunk = needed[start : start + cache.capacity]
            slots = cache.acquire(layer, chunk)
            try:
                for e, s in zip(chunk, slots, strict=True):
                    # Same row order as eager: its mask is [K, T], so rows come ordered by top-k position first.
                    top_k_pos, token_idx = torch.where((top_k_index == e).T)
                    current = expert_forward(module, hidden_states[token_idx], cache.tensors, s)
                    current = current * top_k_weights[token_idx, top_k_pos, None]
                    out.index_add_(0, token_idx, current.to(out.dtype))
            finally:
                cache.release(slots)
        return out

    @staticmethod
    def _one_token(
        module: torch.nn.Module,
        layer: int,
        cache: ExpertCache,
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
        slots = cache.acquire(layer, needed)
        try:
            for e, s in zip(needed, slots, strict=True):
                k = pos[e]
                current = expert_forward(module, hidden_states, cache.tensors, s)
                current = current * top_k_weights[:, k : k + 1]
                out.add_(current.to(out.dtype))
        finally:
            cache.release(slots)
        return out
