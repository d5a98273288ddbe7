"""`fmoe-local bench matcher`: what the fMoE matcher's searches cost with a large map store, on this CPU.

Scope: one forward pass's map-store work as the fmoe policy does it — one semantic search when the pass starts, one
trajectory search per MoE layer (l = 1..L), one `add` (RDY against every stored map) when it ends — timed on a
store filled with random softmax maps and embeddings; and how often the sketched semantic side (semantic_index.py)
picks what the exact full scan picks: on that random store (the worst case: every cosine near 0), and, with
`--traces`, on the replay's request-map-mean semantic fallback of recorded traces, replayed map by map into a store
as the fmoe policy fills it; with `--demo-embeddings`, on running means of the demo model's token embeddings over
ShareGPT prompts (what semantic_mode "running_mean" gives each iteration; h = 256, so pass a smaller --sketch-dim). Not a test: it prints. It does NOT exercise the policy's planning or the cache.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fmoe_local.cli_args import whole
from fmoe_local.config import RuntimeConfig
from fmoe_local.maps import ExpertMap, MapPersistence, MapStore
from fmoe_local.policies.base import ModelShape

_TIE = 1e-6  # exact scores this close count as the same choice (duplicate maps tie)


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


@dataclass
class Agreement:
    """Sketched choices against the exact ones: semantic top-1 per search, most-redundant map per add."""

    searches: int = 0
    same_top1: int = 0
    top1_loss: float = 0.0  # summed exact cosine lost (exact best − exact cosine of the sketch's pick)
    adds: int = 0
    same_rdy: int = 0
    rdy_loss: float = 0.0

    def line(self, what: str) -> str:
        s, a = max(self.searches, 1), max(self.adds, 1)
        line = (
            f"  {what}: semantic top-1 {self.same_top1}/{self.searches} = {self.same_top1 / s:.4f} "
            f"(mean cosine lost {self.top1_loss / s:.2e})"
        )
        if self.adds:
            line += f"; RDY argmax {self.same_rdy}/{self.adds} = {self.same_rdy / a:.4f} (mean RDY lost {self.rdy_loss / a:.2e})"
        return line

    def count(self, best: float, picked: float, rdy: bool) -> None:
        """One choice: the exact best value and the exact value of what the sketched store picked."""
        loss = max(0.0, best - picked)
        if rdy:
            self.adds, self.same_rdy, self.rdy_loss = (
                self.adds + 1,
                self.same_rdy + (loss <= _TIE),
                self.rdy_loss + loss,
            )
        else:
            self.searches, self.same_top1, self.top1_loss = (
                self.searches + 1,
                self.same_top1 + (loss <= _TIE),
                self.top1_loss + loss,
            )


class _Filled(MapPersistence):
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
    num_maps: int = 32768,
    L: int = 26,
    J: int = 64,
    h: int = 2048,
    iterations: int = 32,
    seed: int = 0,
    sketch_dim: int = RuntimeConfig.sketch_dim,
    candidates: int = RuntimeConfig.sketch_candidates,
    agreement_queries: int = 0,
) -> tuple[MatcherCost, MatcherCost, Agreement | None]:
    """The pass's costs in wall and in CPU milliseconds; with `agreement_queries` > 0 also the sketch's agreement with an exact twin store on
    that many random queries (None without a sketch to compare)."""
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
    store = MapStore(shape, num_maps, 3, sketch_dim=sketch_dim, sketch_candidates=candidates)
    store.load_from(_Filled(maps))
    agreement = None
    if agreement_queries > 0 and 0 < sketch_dim < h:
        exact = MapStore(shape, num_maps, 3, sketch_dim=0)
        exact.load_from(_Filled(maps))
        agreement = _twin_agreement(store, exact, softmax_maps(agreement_queries), embeddings(agreement_queries))
        del exact
    del maps
    # Wall and CPU seconds of [trajectory, semantic, add]: on a shared machine the CPU time is the steadier figure
    # (it excludes waiting for a core), though both grow when other work crowds the memory bus.
    wall, cpu = np.zeros(3), np.zeros(3)

    def timed(i: int, search: Callable[..., object], *args: object) -> None:
        w, c = time.perf_counter(), time.process_time()
        search(*args)
        wall[i] += time.perf_counter() - w
        cpu[i] += time.process_time() - c

    for q, e in zip(softmax_maps(iterations), embeddings(iterations), strict=True):
        semantic = e if h else None
        timed(1, store.match_semantic, semantic)
        for depth in range(1, L + 1):
            timed(0, store.match_trajectory, q[:depth])
        timed(2, store.add, ExpertMap(q, semantic, 1))
    per = np.array([iterations * L, iterations, iterations]) / 1000.0
    wall_ms, cpu_ms = wall / per, cpu / per
    return MatcherCost(*wall_ms, L), MatcherCost(*cpu_ms, L), agreement


def _twin_agreement(store: MapStore, exact: MapStore, probs: np.ndarray, sems: np.ndarray) -> Agreement:
    """Queries against two stores of the same maps, one sketched, one exact; nothing is added. Both return exact
    scores (the sketched one for what it picked), so the exact store's answer is the best there is."""
    out = Agreement()
    for p, e in zip(probs, sems, strict=True):
        out.count(exact.match_semantic(e)[1], store.match_semantic(e)[1], rdy=False)
        out.count(exact.most_redundant(p, e)[1], store.most_redundant(p, e)[1], rdy=True)
    return out


def trace_agreement(
    path: str,
    capacity: int,
    prefetch_distance: int = RuntimeConfig.prefetch_distance,
    sketch_dim: int = RuntimeConfig.sketch_dim,
    candidates: int = RuntimeConfig.sketch_candidates,
) -> tuple[Agreement, int]:
    """Every map of a trace added in order, with the replay's semantic input, to a sketched store (what the fmoe
    policy does); before each add, its semantic search and most-redundant choice are scored against a brute-force
    cosine over a mirror of the store's contents. Returns (agreement, the semantic input's size h)."""
    from fmoe_bench.replay import build_schedule
    from fmoe_local.traces import load_trace

    schedule = build_schedule(load_trace(path))
    shape = schedule.shape
    L, h = shape.num_layers, shape.embed_dim
    store = MapStore(shape, capacity, prefetch_distance, sketch_dim=sketch_dim, sketch_candidates=candidates)
    flat = np.zeros((capacity, L * shape.num_experts), np.float32)  # [C, L·J] mirror of the stored maps
    emb = np.zeros((capacity, h), np.float32)  # [C, h] mirror of the stored embeddings
    has = np.zeros(capacity, bool)
    flat_norm, emb_norm = np.zeros(capacity, np.float32), np.zeros(capacity, np.float32)  # [C] mirrors' row norms
    w = min(prefetch_distance, L) / L
    out = Agreement()
    for i, (probs, sem) in enumerate(zip(schedule.probs, schedule.semantics, strict=True)):
        n, p = len(store), probs.reshape(-1)
        if n and sem is not None and has[:n].any():
            cos = _cosines(emb[:n], emb_norm[:n], sem)
            exact = np.where(has[:n], cos, -np.inf)
            out.count(float(exact.max()), float(exact[store.match_semantic(sem)[0]]), rdy=False)
        if n:
            s_traj = _cosines(flat[:n], flat_norm[:n], p)
            s_sem = s_traj if sem is None else np.where(has[:n], _cosines(emb[:n], emb_norm[:n], sem), s_traj)
            rdy = w * s_sem + (1 - w) * s_traj
            out.count(float(rdy.max()), float(rdy[store.most_redundant(probs, sem)[0]]), rdy=True)
        slot = store.add(ExpertMap(probs, sem, int(schedule.request_of[i])))
        flat[slot], has[slot] = p, sem is not None
        emb[slot] = 0.0 if sem is None else sem
        flat_norm[slot], emb_norm[slot] = np.linalg.norm(flat[slot]), np.linalg.norm(emb[slot])
    return out, h


def embedding_agreement(
    sketch_dim: int, candidates: int, maps: int = 32768, queries: int = 2000, prompts: Path | None = None
) -> tuple[Agreement, int]:
    """Semantic top-1 of a sketched store against an exact twin, on embeddings with real token structure: running
    means of the demo model's input embeddings over the first 64 tokens of ShareGPT prompts (stored: the first 1500
    prompts, up to `maps` rows; queries: the next prompts at tokens 4, 8, 12, 16). Returns (agreement, h)."""
    from safetensors import safe_open
    from tokenizers import Tokenizer

    from fmoe_bench.prompts import read_prompts, shared_data_dir
    from fmoe_local.demo import demo_model_dir

    weights = demo_model_dir()
    with safe_open(str(weights / "model.safetensors"), "np") as f:
        table = f.get_tensor("model.embed_tokens.weight").astype(np.float32)  # [vocab, h]
    tokenizer = Tokenizer.from_file(str(weights / "tokenizer.json"))
    texts = read_prompts(prompts or shared_data_dir() / "prompts" / "sharegpt-first-turn-2000.json")

    def running_means(text: str, limit: int) -> np.ndarray:
        rows = table[tokenizer.encode(text).ids[:limit]]  # [t, h]
        return np.cumsum(rows, 0) / np.arange(1, rows.shape[0] + 1, dtype=np.float32)[:, None]

    stored = np.concatenate([running_means(t, 64) for t in texts[:1500]])[:maps]
    asked = np.concatenate([running_means(t, 16)[3::4] for t in texts[1500:]])[:queries]
    h = table.shape[1]
    shape = ModelShape(1, 2, 1, h)
    probs = np.full((1, 2), 0.5, np.float32)  # routing plays no part in a semantic search
    filled = _Filled([ExpertMap(probs, e, 0) for e in stored])
    store = MapStore(shape, len(stored), 1, sketch_dim=sketch_dim, sketch_candidates=candidates)
    exact = MapStore(shape, len(stored), 1, sketch_dim=0)
    store.load_from(filled), exact.load_from(filled)
    out = Agreement()
    for q in asked:
        out.count(exact.match_semantic(q)[1], store.match_semantic(q)[1], rdy=False)
    return out, h


def _cosines(rows: np.ndarray, norms: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Brute-force cosines, 64 rows per BLAS call: one big gemv goes multi-threaded and crawls on a busy machine."""
    dots = np.concatenate([rows[a : a + 64] @ q for a in range(0, rows.shape[0], 64)])
    return dots / np.maximum(norms * np.linalg.norm(q), 1e-12)


def add_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("matcher", help="time the fMoE matcher's map-store searches on a large store, on this CPU")
    m.add_argument("--maps", type=whole(1), default=32768, help="maps in the store (default 32768)")
    m.add_argument("--layers", type=whole(1), default=26, help="MoE layers (default 26, DeepSeek-V2-Lite)")
    m.add_argument("--experts", type=whole(1), default=64, help="experts per layer (default 64)")
    m.add_argument("--embed-dim", type=whole(0), default=2048, help="semantic embedding size (default 2048; 0 = none)")
    m.add_argument(
        "--sketch-dim",
        type=whole(0),
        default=RuntimeConfig.sketch_dim,
        help=f"k of the semantic sketch (default {RuntimeConfig.sketch_dim}; 0 = exact full scan)",
    )
    m.add_argument(
        "--candidates",
        type=whole(1),
        default=RuntimeConfig.sketch_candidates,
        help=f"maps re-ranked exactly after the sketch (default {RuntimeConfig.sketch_candidates})",
    )
    m.add_argument(
        "--agreement-queries",
        type=whole(0),
        default=64,
        help="random queries checked against an exact twin store (default 64; 0 = skip, halves the memory)",
    )
    m.add_argument(
        "--demo-embeddings",
        action="store_true",
        help="also check the sketch on running means of the demo model's token embeddings (h=256: use --sketch-dim < 256)",
    )
    m.add_argument("--traces", nargs="*", default=[], help="also check the sketch's choices on these traces")
    m.add_argument(
        "--trace-capacity",
        type=whole(1),
        default=RuntimeConfig.store_capacity,
        help=f"store capacity for --traces (default {RuntimeConfig.store_capacity}, as the replay)",
    )


def run(args: argparse.Namespace) -> int:
    c, cpu, agreement = bench_matcher(
        num_maps=args.maps,
        L=args.layers,
        J=args.experts,
        h=args.embed_dim,
        sketch_dim=args.sketch_dim,
        candidates=args.candidates,
        agreement_queries=args.agreement_queries,
    )
    sketched = 0 < args.sketch_dim < args.embed_dim
    search = f"sketch k={args.sketch_dim}, {args.candidates} re-ranked" if sketched else "exact full scan"
    print(
        f"map store of {args.maps} maps, {args.layers} layers x {args.experts} experts, embeddings of "
        f"{args.embed_dim} ({search}), on this CPU (wall ms, CPU ms of this process):\n"
        f"  trajectory search (every layer)         {c.trajectory_ms:8.3f} {cpu.trajectory_ms:8.3f}\n"
        f"  semantic search (once per forward pass) {c.semantic_ms:8.3f} {cpu.semantic_ms:8.3f}\n"
        f"  storing the map (once per forward pass) {c.add_ms:8.3f} {cpu.add_ms:8.3f}\n"
        f"  all of it, per layer                    {c.per_layer_ms:8.3f} {cpu.per_layer_ms:8.3f}"
    )
    if agreement is not None:
        print("sketched choices equal to the exact ones (ties count as equal):")
        print(agreement.line(f"random maps and embeddings, {args.agreement_queries} queries (worst case)"))
    for path in args.traces:
        a, h = trace_agreement(path, args.trace_capacity, sketch_dim=args.sketch_dim, candidates=args.candidates)
        print(a.line(f"{path.rsplit('/', 1)[-1]}, request-map-mean fallback h={h}, C={args.trace_capacity}"))
    if args.demo_embeddings:
        a, h = embedding_agreement(args.sketch_dim, args.candidates)
        sketch = f"k={args.sketch_dim}" if 0 < args.sketch_dim < h else "no sketch (k ≥ h)"
        print(a.line(f"demo-model token-embedding running means h={h}, {sketch}, m={args.candidates}"))
    return 0
