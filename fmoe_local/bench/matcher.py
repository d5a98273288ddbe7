"""`fmoe-local bench matcher`: what the fMoE matcher's searches cost with a large map store, on this CPU.

Scope: one forward pass's map-store work as the fmoe policy does it — one semantic search when the pass starts, one
trajectory search per MoE layer (l = 1..L), one `add` (RDY against every stored map) when it ends — timed on a
store filled with random softmax maps and embeddings. Not a test: it prints. It does NOT exercise the policy's
planning or the cache.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from fmoe_local.maps import ExpertMap, MapStore
from fmoe_local.policies.base import ModelShape


@dataclass(frozen=True)
class MatcherCost:
    trajectory_ms: float  # one trajectory search (per layer)
    semantic_ms: float  # one semantic search (per forward pass)
    add_ms: float  # storing the finished map (per forward pass)
    layers: int

    @property
    def per_layer_ms(self) -> float:
        """All of a pass's map-store work spread over its layers."""
        return self.trajectory_ms + (self.semantic_ms + self.add_ms) / self.layers


class _Filled:
    """A MapPersistence that hands `load_from` random maps: fills the store slot by slot without RDY per map."""

    def __init__(self, maps: list[ExpertMap]) -> None:
        self.maps = maps

    def load(self) -> list[tuple[int, ExpertMap]]:
        return list(enumerate(self.maps))

    def put(self, slot: int, expert_map: ExpertMap) -> None:
        pass

    def clear(self) -> None:
        pass


def bench_matcher(
    num_maps: int = 32768, L: int = 26, J: int = 64, h: int = 2048, iterations: int = 8, seed: int = 0
) -> MatcherCost:
    rng = np.random.default_rng(seed)
    shape = ModelShape(L, J, top_k=min(6, J), embed_dim=h)

    def softmax_maps(count: int) -> np.ndarray:
        logits = rng.standard_normal((count, L, J), dtype=np.float32) * 2.0
        e = np.exp(logits - logits.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def embeddings(count: int) -> np.ndarray:
        return rng.standard_normal((count, h), dtype=np.float32) if h else np.zeros((count, 0), np.float32)

    maps = [
        ExpertMap(p, e if h else None, 0) for p, e in zip(softmax_maps(num_maps), embeddings(num_maps), strict=True)
    ]
    store = MapStore(shape, capacity=num_maps, prefetch_distance=3)
    store.load_from(_Filled(maps))
    del maps
    traj = sem = add = 0.0
    for q, e in zip(softmax_maps(iterations), embeddings(iterations), strict=True):
        semantic = e if h else None
        t0 = time.perf_counter()
        store.match_semantic(semantic)
        sem += time.perf_counter() - t0
        for depth in range(1, L + 1):
            t0 = time.perf_counter()
            store.match_trajectory(q[:depth])
            traj += time.perf_counter() - t0
        t0 = time.perf_counter()
        store.add(ExpertMap(q, semantic, 1))
        add += time.perf_counter() - t0
    return MatcherCost(1000 * traj / (iterations * L), 1000 * sem / iterations, 1000 * add / iterations, L)


def add_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("matcher", help="time the fMoE matcher's map-store searches on a large store, on this CPU")
    m.add_argument("--maps", type=int, default=32768, help="maps in the store (default 32768)")
    m.add_argument("--layers", type=int, default=26, help="MoE layers (default 26, DeepSeek-V2-Lite)")
    m.add_argument("--experts", type=int, default=64, help="experts per layer (default 64)")
    m.add_argument("--embed-dim", type=int, default=2048, help="semantic embedding size (default 2048; 0 = none)")


def run(args: argparse.Namespace) -> int:
    c = bench_matcher(num_maps=args.maps, L=args.layers, J=args.experts, h=args.embed_dim)
    print(
        f"map store of {args.maps} maps, {args.layers} layers x {args.experts} experts, embeddings of "
        f"{args.embed_dim}, on this CPU:\n"
        f"  trajectory search (every layer)         {c.trajectory_ms:8.3f} ms\n"
        f"  semantic search (once per forward pass) {c.semantic_ms:8.3f} ms\n"
        f"  storing the map (once per forward pass) {c.add_ms:8.3f} ms\n"
        f"  all of it, per layer                    {c.per_layer_ms:8.3f} ms"
    )
    return 0
