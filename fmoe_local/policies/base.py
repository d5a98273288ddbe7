"""The policy interface: what every prefetch/eviction policy (fmoe and its peers) implements.

Scope: the contract only. Policies see expert keys, gate probabilities and semantic embeddings — never the cache's
internals, tensors or threads. The same policy objects are driven by the live runtime (experts.py/prefetcher.py)
and by the replay benchmark (bench/replay.py), which is what makes comparisons fair by construction.

Layers here are MoE-layer indices 0..L-1 (dense layers are not counted). Probabilities are float32 numpy arrays
over all J experts of a layer; a prefill iteration passes the mean over its tokens.

Threading contract (runtime): `begin_iteration`/`observe_layer` run on the background matcher thread;
`record_access`/`choose_victim` run on the forward thread and must never wait for the matcher (keep them cheap,
lock-free or under a lock the matcher holds only briefly).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

ExpertKey = tuple[int, int]  # (moe_layer, expert)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int  # L: MoE layers
    num_experts: int  # J: routed experts per layer
    top_k: int  # K: experts the router picks per token
    embed_dim: int = 0  # h: size of the semantic embedding (0 = none available)


@dataclass(frozen=True)
class Prefetch:
    """Ask for (layer, expert) to be made resident; larger priority is copied first."""

    layer: int
    expert: int
    priority: float


@runtime_checkable
class Policy(Protocol):
    name: str
    # True when observe_layer wants `lookahead`: layer l+1's router applied to layer l's hidden state.
    needs_lookahead: bool

    def begin_request(self, request_id: int) -> None: ...

    def begin_iteration(self, semantic: np.ndarray | None) -> list[Prefetch]:
        """A new forward pass starts. `semantic` [h] is its semantic embedding (None when unavailable)."""
        ...

    def observe_layer(self, layer: int, probs: np.ndarray, lookahead: np.ndarray | None = None) -> list[Prefetch]:
        """The router of `layer` produced `probs` [J]. Returns the prefetches to queue now."""
        ...

    def record_access(self, layer: int, experts: Sequence[int], hits: Sequence[bool]) -> None:
        """The forward pass used these experts of `layer`; hits[i] says whether experts[i] was resident."""
        ...

    def choose_victim(self, candidates: Sequence[ExpertKey], current_layer: int) -> ExpertKey:
        """Pick the resident expert to evict among `candidates` (never empty, never in use)."""
        ...

    def end_iteration(self) -> None:
        """The forward pass finished: its expert map is complete."""
        ...

    def end_request(self) -> None:
        """The request ended (finished or stopped): drop its live trajectory."""
        ...
