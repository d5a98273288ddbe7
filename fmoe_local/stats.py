"""Per-request statistics: what the UI shows under a reply and the CLI prints with --json.

Scope: counting and summarising. It does NOT time anything itself or touch the cache; the runtime feeds it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestStats:
    ttft_s: float = 0.0  # time to first generated token
    tpot_s: float = 0.0  # mean time per output token after the first
    tokens: int = 0  # generated tokens
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those a kept KV cache held (prefix_cache.py): not prefilled again
    hits: int = 0  # resident and copied when needed
    late: int = 0  # being prefetched when needed: the forward pass waited for the rest of the copy
    misses: int = 0  # not in the cache when needed: loaded on demand, or computed on the host (on_host)
    on_host: int = 0  # of the misses, those the CPU computed from the host copy instead of loading them
    prefetched: int = 0  # experts copied by the prefetcher
    prefetch_wasted: int = 0  # prefetched experts evicted (or still unused at the end) without being used
    bytes_moved: int = 0  # host → device expert bytes
    stall_s: float = 0.0  # forward-pass time spent waiting for on-demand loads
    host_s: float = 0.0  # forward-pass time spent computing misses on the host (on_host)
    cache_gb_used: float = 0.0
    finish_reason: str = ""
    # [L][J] counts for the heatmap; lists so that the object is JSON-ready.
    layer_hits: list[list[int]] = field(default_factory=list)
    layer_misses: list[list[int]] = field(default_factory=list)
    layer_late: list[list[int]] = field(default_factory=list)
    layer_prefetched: list[list[int]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Hits over all accesses; a late prefetch is not a hit (DESIGN.md, "Hits, late and misses")."""
        total = self.hits + self.late + self.misses
        return self.hits / total if total else 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.tpot_s if self.tpot_s > 0 else 0.0

    @property
    def per_layer_hit_rate(self) -> list[float]:
        out = []
        late = self.layer_late or [[] for _ in self.layer_hits]
        for h, m, x in zip(self.layer_hits, self.layer_misses, late, strict=True):
            total = sum(h) + sum(m) + sum(x)
            out.append(sum(h) / total if total else 0.0)
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["tokens_per_s"] = self.tokens_per_s
        d["per_layer_hit_rate"] = self.per_layer_hit_rate
        return d


class LayerCounters:
    """Hit/late/miss/prefetch counts per (layer, expert), shared by the cache and the replay benchmark."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.hits = np.zeros((num_layers, num_experts), np.int64)
        self.late = np.zeros((num_layers, num_experts), np.int64)
        self.misses = np.zeros((num_layers, num_experts), np.int64)
        self.on_host = np.zeros((num_layers, num_experts), np.int64)  # the misses computed from the host copy
        self.prefetched = np.zeros((num_layers, num_experts), np.int64)
        self.prefetch_used = 0
        self.prefetch_wasted = 0
        self.bytes_moved = 0
        self.stall_s = 0.0
        self.host_s = 0.0  # written by the forward thread only (experts.py)

    def snapshot(self) -> LayerCounters:
        c = LayerCounters(*self.hits.shape)
        c.hits, c.misses, c.prefetched = self.hits.copy(), self.misses.copy(), self.prefetched.copy()
        c.late, c.on_host = self.late.copy(), self.on_host.copy()
        c.prefetch_used, c.prefetch_wasted = self.prefetch_used, self.prefetch_wasted
        c.bytes_moved, c.stall_s, c.host_s = self.bytes_moved, self.stall_s, self.host_s
        return c

    def since(self, before: LayerCounters) -> LayerCounters:
        c = LayerCounters(*self.hits.shape)
        c.hits, c.misses = self.hits - before.hits, self.misses - before.misses
        c.late = self.late - before.late
        c.on_host = self.on_host - before.on_host
        c.prefetched = self.prefetched - before.prefetched
        c.prefetch_used = self.prefetch_used - before.prefetch_used
        c.prefetch_wasted = self.prefetch_wasted - before.prefetch_wasted
        c.bytes_moved = self.bytes_moved - before.bytes_moved
        c.stall_s = self.stall_s - before.stall_s
        c.host_s = self.host_s - before.host_s
        return c

    def fill(self, stats: RequestStats) -> None:
        stats.hits, stats.misses = int(self.hits.sum()), int(self.misses.sum())
        stats.late, stats.layer_late = int(self.late.sum()), self.late.tolist()
        stats.on_host, stats.host_s = int(self.on_host.sum()), float(self.host_s)
        stats.prefetched, stats.prefetch_wasted = int(self.prefetched.sum()), int(self.prefetch_wasted)
        stats.bytes_moved, stats.stall_s = int(self.bytes_moved), float(self.stall_s)
        stats.layer_hits, stats.layer_misses = self.hits.tolist(), self.misses.tolist()
        stats.layer_prefetched = self.prefetched.tolist()
