"""The policy interface: what every prefetch/eviction policy (fmoe and its peers) implements.

Scope: the contract only. Policies see expert keys, gate probabilities and semantic embeddings — never the cache's
internals, tensors or threads. The same policy objects are driven by the live runtime (experts.py/prefetcher.py)
and by the replay benchmark (fmoe_bench/replay.py), which is what makes comparisons fair by construction.

Layers here are MoE-layer indices 0..L-1 (dense layers are not counted). Probabilities are float32 numpy arrays
over all J experts of a layer; a prefill iteration passes the mean over its tokens.

Extras only some policies need have a default in `Policy` itself (every policy subclasses it, so callers call them
directly): `reconfigure(prefetch_distance=, store_capacity=)` retunes in place (default: cannot, a new policy is
made); `observe_iteration(probs[L, J], semantic)` learns from a whole forward pass without predicting (a complete
cache, a replay's warm-up; default: begin_iteration + observe_layer per layer + end_iteration, which a policy may
do faster); `set_capacity(slots)` is called with the cache's slot count whenever a cache is made (runtime and replay
alike; default: nothing); and `miss_handling` ("cpu") overrides the configured miss handling (cpu_moe: every miss
is computed on the CPU; default None: the setting).

Prefetches come back as any Sequence[Prefetch]: a list, or a PrefetchBatch when a policy predicts many at once.

Threading contract (runtime): `begin_iteration`/`observe_layer` run on the prefetcher (matcher) thread.
`record_access` and `choose_victims` are called with the cache's lock held, so never at the same time as each
other: `record_access` by the forward thread, `choose_victims` by the forward thread (a miss claiming a slot) or
by the prefetcher thread (a prefetch claiming one). Both may run while the matcher is in `observe_layer`, and must
never wait for it (keep them cheap, under a lock the matcher holds only briefly, as fmoe does). The replay calls
everything from one thread.
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


class PrefetchBatch(Sequence[Prefetch]):
    """Many prefetches held as three arrays; a Sequence of Prefetch for everyone else.

    For policies that predict whole layers at once (moe_infinity queues up to 2K experts for every later layer,
    after every layer): building an object per item cost more than the replay's whole simulation.
    """

    def __init__(self, layers: np.ndarray, experts: np.ndarray, priorities: np.ndarray) -> None:
        self.layers = np.asarray(layers, np.int64).reshape(-1)
        self.experts = np.asarray(experts, np.int64).reshape(-1)
        self.priorities = np.asarray(priorities, np.float64).reshape(-1)

    def __len__(self) -> int:
        return self.layers.size

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return PrefetchBatch(self.layers[i], self.experts[i], self.priorities[i])
        return Prefetch(int(self.layers[i]), int(self.experts[i]), float(self.priorities[i]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


class CandidateKeys(Sequence[ExpertKey]):
    """Eviction candidates held as two arrays (layers, experts); a Sequence of (layer, expert) for everyone else.

    The replay evicts about a million times per trace: policies read the arrays (split_keys) instead of
    converting hundreds of tuples each time, and only the chosen victims become tuples. `in_order`: the caller
    promises ascending (layer, expert) order, so ties may be broken by position (policies._common.lowest).
    `codes`: layer · J + expert when the caller has them (indices into a raveled [L, J] array; _common.flat_codes).
    """

    def __init__(
        self, layers: np.ndarray, experts: np.ndarray, in_order: bool = False, codes: np.ndarray | None = None
    ) -> None:
        self.layers, self.experts, self.in_order, self.codes = layers, experts, in_order, codes

    def __len__(self) -> int:
        return self.layers.size

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            codes = None if self.codes is None else self.codes[i]
            return CandidateKeys(self.layers[i], self.experts[i], self.in_order and (i.step or 1) > 0, codes)
        return int(self.layers[i]), int(self.experts[i])


def prefetch_arrays(prefetches: Sequence[Prefetch]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(layers, experts, priorities) of any prefetch sequence, without copying a PrefetchBatch."""
    if isinstance(prefetches, PrefetchBatch):
        return prefetches.layers, prefetches.experts, prefetches.priorities
    n = len(prefetches)
    layers = np.fromiter((p.layer for p in prefetches), np.int64, count=n)
    experts = np.fromiter((p.expert for p in prefetches), np.int64, count=n)
    priorities = np.fromiter((p.priority for p in prefetches), np.float64, count=n)
    return layers, experts, priorities


@runtime_checkable
class Policy(Protocol):
    name: str
    # True when observe_layer wants `lookahead`: layer l+1's router applied to layer l's hidden state.
    needs_lookahead: bool

    def begin_request(self, request_id: int) -> None: ...

    def begin_iteration(self, semantic: np.ndarray | None) -> Sequence[Prefetch]:
        """A new forward pass starts. `semantic` [h] is its semantic embedding (None when unavailable)."""
        ...

    def observe_layer(self, layer: int, probs: np.ndarray, lookahead: np.ndarray | None = None) -> Sequence[Prefetch]:
        """The router of `layer` produced `probs` [J]. Returns the prefetches to queue now."""
        ...

    def record_access(self, layer: int, experts: Sequence[int], hits: Sequence[bool]) -> None:
        """The forward pass used these experts of `layer`; hits[i] says whether experts[i] was resident."""
        ...

    def choose_victims(self, candidates: Sequence[ExpertKey], current_layer: int, count: int = 1) -> list[ExpertKey]:
        """The `count` resident experts to evict among `candidates` (never empty, never in use), first victim first.

        Must equal picking one victim, removing it from `candidates`, and picking again: the cache's rules
        (slot_table.py) ask once for every slot an access's misses need, and ask again one at a time only when a
        slot frees up later; both must give what asking one at a time would.
        """
        ...

    def end_iteration(self) -> None:
        """The forward pass finished: its expert map is complete."""
        ...

    def end_request(self) -> None:
        """The request ended (finished or stopped): drop its live trajectory."""
        ...

    # --- extras with a default (module docstring) ----------------------------------------------------------------
    miss_handling: str | None = None  # the miss handling this policy forces, or None: the configured one

    def observe_iteration(self, probs: np.ndarray, semantic: np.ndarray | None) -> None:
        """Learn from a whole forward pass, `probs` [L, J], without predicting (its prefetches are dropped)."""
        self.begin_iteration(semantic)
        for layer, row in enumerate(probs):
            self.observe_layer(layer, row)
        self.end_iteration()

    def set_capacity(self, slots: int) -> None:
        """A cache of `slots` slots was made (policies that place experts by the cache's size use it)."""

    def reconfigure(self, prefetch_distance: int | None = None, store_capacity: int | None = None) -> bool:
        """Retune in place, keeping what was learnt; False: this policy cannot, and the caller makes a new one."""
        return False
