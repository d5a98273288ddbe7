"""Fold a routing trace onto fewer experts per layer: a stand-in for few-expert models (Mixtral's top-2 of 8).

Scope: `fold(trace, J, K)` returns a new `Trace` whose distributions are the source's folded the way `bench live
--synthetic` folds them (`synthetic.fold_trace`: trace expert e counts for expert e mod J, probabilities summed;
the selected experts are the top-K of the folded distribution), with the same layers, requests and forward passes;
`parse_fold("8x2")`. It does NOT replay anything (replay.py) and keeps no embeddings' meaning beyond copying them.

Why a fold and not a recording: no few-expert routing is shared with the repository. Folding keeps the real
temporal structure of the routing (which experts follow which, request by request) while giving each layer J
experts and top-K, so a policy tuned on 64-expert top-6 routing can be checked where a wrong guess costs more.
"""

from __future__ import annotations

import numpy as np

from fmoe_bench.synthetic import fold_trace
from fmoe_local.traces import Trace


def parse_fold(text: str) -> tuple[int, int]:
    """'8x2' → (8 experts, top-2); a sentence saying what to write otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"Write the fold as EXPERTSxTOPK, e.g. 8x2 (got '{text}').")
    experts, k = int(parts[0]), int(parts[1])
    if experts < 1 or not 1 <= k <= experts:
        raise ValueError(f"A fold needs at least one expert and 1 ≤ top-k ≤ experts (got {experts}x{k}).")
    return experts, k


def fold(trace: Trace, num_experts: int, top_k: int) -> Trace:
    """The trace with every layer's routing folded onto `num_experts` experts and top-`top_k` (module docstring)."""
    if num_experts > trace.num_experts:
        raise ValueError(
            f"A fold can only merge experts: the trace has {trace.num_experts} per layer, fewer than {num_experts}."
        )
    if top_k > trace.top_k:
        raise ValueError(f"The trace selects {trace.top_k} experts per layer; fold to top-{trace.top_k} or fewer.")
    folded = fold_trace(trace, trace.num_layers, num_experts, top_k)
    probs = folded.probs  # [T, L, J]
    ids = folded.ids.astype(np.int16)  # [T, L, K]
    return Trace(
        f"{trace.model} folded to {num_experts} experts, top-{top_k}",
        trace.num_layers,
        num_experts,
        top_k,
        trace.seq_ids.copy(),
        trace.iter_ids.copy(),
        trace.phase.copy(),
        ids,
        np.take_along_axis(probs, folded.ids, axis=2),
        probs,
        None if trace.embeddings is None else trace.embeddings.copy(),
        trace.seq_labels,
        trace.seq_texts,
    )
