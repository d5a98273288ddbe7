"""PrefixCache: the KV caches of recent requests, kept so that a request sharing a prompt prefix prefills only the rest.

Scope: which kept cache serves a new prompt (the longest common token prefix), handing it over, taking the request's
cache back afterwards, and the byte budget (RuntimeConfig.prefix_cache_gb; the least recently used cache goes first).
It does NOT run the model, know a request's text, or touch the expert cache.

Ownership of a kept cache's buffers (kv_cache.GrowingCache: each full-attention layer written in place after its
filled part, so whoever extends a buffer overwrites what follows the tokens it shares): a kept cache is written only
by the one request it is handed to, and a kept cache is never written while it is kept.
- A prompt that extends every token of a kept cache (the next turn of a chat) is handed that cache itself: it is no
  longer kept, the request writes its tokens into the slack (a buffer grows by 1.5× when full), and `put` keeps it
  again at the end, capacity and all. Nothing is copied.
- A prompt that shares only part of a kept cache (a regenerate, an edit, a second request under the same system
  prompt) gets a new cache holding a copy of the shared tokens, with room for the prompt and some of the reply
  (kv_cache.first_capacity): the kept one stays as it was for its own conversation. That copy is the one copy of
  the prefix a request makes, as DynamicLayer's concatenation made it before (docs/bench.md, "A KV cache with room
  to grow"); the decode steps after it copy nothing.

Threads: a PrefixCache belongs to the thread that runs the model, the runtime's worker: `take` and `put` are called
only by Runtime._run around generate_ids, `clear` only between requests (Runtime.reset_cache). The caches it holds
are that thread's too; nothing else reads them. A model reload builds a new Runtime, so an empty PrefixCache.

Exactness: a reused cache must hold what a fresh prefill of the same tokens computes, so that the reply is the one
the same request gets without reuse (tests/test_prefix_cache.py, every family). Where that cannot hold, nothing is
reused:
- a layer kind other than a GrowingLayer or transformers' sliding-window dynamic layer (kv_cache.kv_layers): the
  model is never served from a kept cache;
- a sliding-window layer past its window keeps only its last window − 1 tokens, so its cache cannot be cut short:
  such a cache is reused only whole, when the prompt extends every token it holds (the next turn of a chat), never
  for a regenerate or an edit (GPT-OSS's every other layer; Mixtral, Qwen with a sliding_window);
- a RoPE whose frequencies follow the pass's length (longrope: Phi-3.5-MoE; dynamic NTK) computes a prefix
  differently once a pass reaches its original context: prompts longer than that are prefilled whole, and a cache
  that grew past it is not kept.
At least the prompt's last token is always prefilled: its logits give the reply's first token. MLA (DeepSeek) caches
its full keys and values per layer, so it is cut like any other.

Budget (cache_budget.prefix_budget_bytes): bytes on the device the KV cache lives on, on top of the running
request's own KV cache, counted as the buffers' whole capacity (their slack included), not only the tokens held;
least recently used dropped first. On a GPU, kept caches are dropped before a request whose KV cache would not fit
the free memory (a request sharing part of a kept cache needs room for its whole prompt: it copies the prefix), and
the copy that trims a cache over the whole budget drops kept caches and retries when it runs out of memory, else
keeps nothing.

Offloading: a reused prefix's experts are not loaded again — the prefill runs only the new tokens, and the policy
observes that pass as it ran (its expert map is the routing the cache had to serve). The semantic embedding still
covers the whole prompt (observe.py: `RoutingObserver.begin_request(reused_ids)`), so the semantic match finds the
same past maps as without reuse. A recorded trace holds the rows computed: `bench record`, `live` and `overhead`
set prefix_cache_gb=0 so that their prompts are prefilled whole, as their earlier figures were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PretrainedConfig

from fmoe_local.kv_cache import GrowingCache, KVLayer, cache_for_prefix, first_capacity, kv_layers


@dataclass(eq=False)  # identity: list.remove must not compare the ids arrays
class _Entry:
    ids: np.ndarray  # the tokens the cache holds, in order [n]
    cache: GrowingCache
    nbytes: int


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def rope_length_limit(config: PretrainedConfig) -> int | None:
    """The longest prompt a kept cache may serve for this model's RoPE: the original context of a longrope or
    dynamic RoPE (whose frequencies switch when a pass reaches it), None when positions never change meaning."""
    params = getattr(config, "rope_parameters", None) or {}
    groups = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    limits = []
    for group in groups:
        kind = str(group.get("rope_type", "default"))
        if kind == "longrope" or "dynamic" in kind:
            limits.append(int(group.get("original_max_position_embeddings") or config.max_position_embeddings))
    return min(limits) if limits else None


def _held_bytes(layers: list[KVLayer]) -> int:
    """Memory the layers keep alive: whole storages (a sliding-window layer's states are views of a larger one)."""
    storages = {}
    for layer in layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _cuttable(layers: list[KVLayer], tokens: int) -> bool:
    """Whether the first `tokens` tokens can be taken from these layers exactly: every sliding-window layer still
    holds all it has seen, or nothing is cut."""
    return all(layer.window is None or layer.length < layer.window or layer.length == tokens for layer in layers)


class PrefixCache:
    def __init__(
        self,
        model_config: PretrainedConfig,
        budget_bytes: int,
        free_bytes: Callable[[], int | None] = lambda: None,
    ) -> None:
        """`budget_bytes`: what the kept caches may take together (cache_budget.prefix_budget_bytes). `free_bytes`:
        memory free now where the KV cache lives (CUDA), asked before a request so that kept caches are dropped
        before the request's own KV cache runs the device out of memory; None where nothing is to be checked."""
        self._config = model_config
        self.budget_bytes = budget_bytes
        self._free_bytes = free_bytes
        self._entries: list[_Entry] = []  # least recently used first
        self._rope_limit = rope_length_limit(model_config)
        self.supported = kv_layers(self.new_cache()) is not None

    @property
    def enabled(self) -> bool:
        return self.supported and self.budget_bytes > 0

    @property
    def held_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def new_cache(self, capacity: int = 0) -> GrowingCache:
        return GrowingCache(self._config, capacity)

    def clear(self) -> None:
        self._entries.clear()

    def take(self, prompt: Sequence[int], new_tokens: int = 0) -> tuple[GrowingCache, int]:
        """A KV cache for `prompt` and how many of its first tokens it already holds (0: a fresh cache). A kept
        cache the prompt extends is handed over whole (no longer kept); one sharing less stays kept, and the request
        gets a copy of its shared tokens (the module docstring). `new_tokens`: tokens the request may still add (the
        reply), for the room check and the new cache's capacity."""
        if not self.enabled or len(prompt) < 2 or (self._rope_limit is not None and len(prompt) > self._rope_limit):
            return self._fresh(prompt, new_tokens)
        ids = np.asarray(prompt, dtype=np.int64)
        best: tuple[_Entry, list[KVLayer], int] | None = None
        for entry in reversed(self._entries):  # the most recently used first: it wins a tie
            shared = min(common_prefix(entry.ids, ids), len(ids) - 1)
            if shared > (best[2] if best else 0):
                layers = kv_layers(entry.cache)
                if layers is not None and _cuttable(layers, shared):
                    best = (entry, layers, shared)
        if best is None:
            return self._fresh(prompt, new_tokens)
        entry, layers, shared = best
        self._entries.remove(entry)
        if shared == len(entry.ids):
            self._make_room(len(prompt) - shared + new_tokens, entry.nbytes / len(entry.ids))
            return entry.cache, shared
        self._entries.append(entry)  # stays kept, now the most recently used
        self._make_room(len(prompt) + new_tokens, entry.nbytes / len(entry.ids))
        copy = cache_for_prefix(self._config, layers, shared, first_capacity(len(prompt), new_tokens))
        if copy is None:
            return self._fresh(prompt, new_tokens)
        return copy, shared

    def put(self, ids: Sequence[int], cache: GrowingCache) -> None:
        """Keep `cache` (after a request that ended between two forward passes), which holds the first tokens of
        `ids` (prompt + reply; the reply's last token was never run). A cache whose layers disagree on their length
        (a forward pass cut short) is dropped; one over the whole budget keeps only the tokens that fit."""
        layers = kv_layers(cache) if self.enabled else None
        if not layers:
            return
        n = layers[0].length
        if n == 0 or n > len(ids) or any(layer.length != n for layer in layers):
            return
        if self._rope_limit is not None and n > self._rope_limit:
            return
        nbytes = _held_bytes(layers)
        if nbytes > self.budget_bytes:
            fit = int(n * self.budget_bytes // nbytes)
            if fit < 1 or not _cuttable(layers, fit):
                return
            del cache
            cache = self._copy(layers, fit)
            if cache is None:
                return
            layers = kv_layers(cache)
            n, nbytes = fit, _held_bytes(layers)
        kept = np.asarray(ids[:n], dtype=np.int64)
        # A kept cache this one extends is redundant: any prompt it serves, this one serves as far.
        self._entries = [e for e in self._entries if not (len(e.ids) <= n and common_prefix(e.ids, kept) == len(e.ids))]
        while self._entries and self.held_bytes + nbytes > self.budget_bytes:
            self._entries.pop(0)
        self._entries.append(_Entry(kept, cache, nbytes))

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _fresh(self, prompt: Sequence[int], new_tokens: int) -> tuple[GrowingCache, int]:
        if self._entries:
            per_token = self._entries[-1].nbytes / len(self._entries[-1].ids)
            self._make_room(len(prompt) + new_tokens, per_token)
        return self.new_cache(first_capacity(len(prompt), new_tokens)), 0

    def _make_room(self, tokens: int, per_token: float) -> None:
        """Drop kept caches, least recently used first, while the device has less free memory than the request's
        KV cache will grow by: a kept prefix must never be why a request runs out of memory."""
        need = tokens * per_token
        while self._entries:
            free = self._free_bytes()
            if free is None or free >= need:
                return
            self._entries.pop(0)

    def _copy(self, layers: list[KVLayer], tokens: int) -> GrowingCache | None:
        """A new cache holding a copy of the first `tokens` tokens of `layers`, without slack (it must let the rest
        go; its sliding-window layers, which hold all they have seen, are copied too); kept caches are dropped
        (least recently used first) while the copy runs out of memory, and None when even that does not help."""
        while True:
            try:
                copies = [
                    KVLayer(
                        layer.keys[:, :, :tokens].clone(), layer.values[:, :, :tokens].clone(), tokens, layer.window
                    )
                    if layer.keys is not None and layer.window is not None
                    else layer
                    for layer in layers
                ]
                return cache_for_prefix(self._config, copies, tokens, tokens)
            except (torch.OutOfMemoryError, MemoryError):
                if not self._entries:
                    return None
                self._entries.pop(0)
