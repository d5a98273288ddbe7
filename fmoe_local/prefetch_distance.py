"""Prefetch distance from the model and the link: how many layers ahead a prefetch must be planned to land in time.

Scope: `distance_for(load_s, layer_s, num_layers)`, a pure rule, and `decode_layer_s`, the layer time a request's
decode shows. It does NOT measure the link (miss_cost.py measures copies; the replay's presets model both) and
changes no default by itself. Both users apply the same rule: `bench replay --prefetch-distance auto` to the cost
model's copy and layer times, the runtime (`RuntimeConfig.prefetch_distance_auto`, engine.py) to the copy time
miss_cost.py measured at load and the layer time of each finished request's decode.

Rule: d = ⌈copy time of one expert / compute time of one layer⌉ + 1, within 1 … L − 1. A prefetch planned after
layer l's router for layer l + d has the compute of d layers to copy in, so d ≥ copy / layer lets one copy land on
an idle link; the one layer more is slack for the copies queued ahead of it (the link is rarely idle). Shorter
distances make the copy late; longer ones predict from less of the current iteration. Measured (docs/bench.md,
"Generalising"): DeepSeek-V2-Lite at 25 GB/s copies an expert in 2.4 layer times → d = 4, +1.1 to +1.2 points of
hit rate over the paper's 3 on both halves of both shared traces; Mixtral-8x7B in 12.1 → d = 14 on the traces
folded to 8 experts, top-2: +1.7 to +1.9 points over 3 (6 was worse than 3, 13 between).
"""

from __future__ import annotations

import math


def decode_layer_s(decode_s: float, waited_s: float, tokens: int, num_layers: int) -> float | None:
    """Compute time per MoE layer of one request's decode: its decode time less the time it waited for experts
    (loads, late prefetches, misses computed on the host), per decode step and MoE layer; None when it has no
    decode step to measure or the waits took all of it. A layer's share of attention and the dense layers counts:
    that is time a copy overlaps with too, as in the presets' layer time."""
    if tokens < 1 or num_layers < 1:
        return None
    compute = decode_s - waited_s
    return compute / (tokens * num_layers) if compute > 0 else None


def max_distance(num_layers: int) -> int:
    """The furthest prefetch distance a model of `num_layers` MoE layers has a use for: L − 1 (a prefetch for
    layer l + d must land on a layer of the same pass), 1 for a one-layer model (the next pass's)."""
    return max(1, num_layers - 1)


def distance_for(load_s: float, layer_s: float, num_layers: int) -> int:
    """The prefetch distance for experts that take `load_s` to copy and layers that compute for `layer_s`."""
    if load_s <= 0 or layer_s <= 0:
        raise ValueError("Give the expert copy time and the layer time as positive numbers of seconds.")
    return max(1, min(max_distance(num_layers), math.ceil(load_s / layer_s) + 1))
