"""PrefixCache: the KV caches of recent requests, kept so that a request sharing a prompt prefix prefills only the rest.

Scope: which kept cache serves a new prompt (the longest common token prefix), handing it over, taking the request's
cache back afterwards, and the byte budget (RuntimeConfig.prefix_cache_gb; the least recently used cache goes first).
It does NOT run the model, know a request's text, or touch the expert cache.

Ownership of a kept cache's buffers (kv_cache.GrowingCache: each full-attention layer written in place after its
filled part, so whoever extends a buffer overwrites what follows the tokens it shares): a buffer has one writer at a
time, the request it was handed to, which writes only after its first `shared` tokens; a kept cache is never
written while it is kept whole; and a buffer's first tokens that a kept cache still reads are never written.
- A prompt that extends every token of a kept cache (the next turn of a chat) is handed that cache: no longer kept,
  the request writes into the slack (a buffer grows by 1.5× when full), and `put` keeps it again at the end.
- A prompt that shares only its first `shared` tokens (a second request under the same system prompt, a
  regenerate, an edit) is handed the kept cache's buffers too, cut to `shared` in place, unless another kept cache
  still reads further into them. The kept cache stays kept, split: views of the buffers' first `shared` tokens and
  a copy of its other tokens (its tail, short for a chat turn: the last question and reply). A split cache reads up
  to `shared` of buffers a later cache owns: whoever takes those buffers later must share at least that much
  (`_read_up_to`), else it gets a copy.
- A prompt served from a split cache, or sharing less than another kept cache reads, gets a new cache holding a copy
  of the shared tokens, with room for the prompt and some of the reply (kv_cache.first_capacity).
So the first copy of a prefix is made only when a conversation goes back to a split cache (its next turn after
another request took its buffers), never by the request that shares it, and a decode step copies nothing. A kept
cache that its reply left without room grows between requests (`prepare`), not in the next turn's first pass.

Threads: a PrefixCache belongs to the thread that runs the model, the runtime's worker: `take` and `put` are called
only by Runtime._run around generate_ids, `prepare` by Runtime._run after the request's handle has finished, `clear`
only between requests (Runtime.reset_cache). The caches it holds
are that thread's too; nothing else reads them. A model reload builds a new Runtime, so an empty PrefixCache.

Exactness: a reused cache must hold what a fresh prefill of the same tokens computes, so that the reply is the one
the same request gets without reuse (tests/test_prefix_cache.py, every family). Where that cannot hold, nothing is
reused:
- a layer kind other than kv_cache's GrowingLayer and SlidingLayer (kv_cache.kv_layers): the
  model is never served from a kept cache;
- a sliding-window layer past its window keeps only its last window − 1 tokens and RETAIN more, and copies of
  those as they were when its request's prompt had been read and after its last BOUNDARY_MARKS boundary tokens
  (kv_cache.SlidingLayer's marks), so its cache is cut only where one of them holds the window before the cut
  (`_cut_point`: at the prompt's end, the next turn of a GPT-OSS chat; one token before it, a regenerate; at the
  start of its last message, another question under one system prompt; or within RETAIN tokens of those), else
  reused only whole, when the prompt extends every token it holds (GPT-OSS's every other layer; Mixtral, Qwen with
  a sliding_window);
- a RoPE whose frequencies follow the pass's length (longrope: Phi-3.5-MoE; dynamic NTK) computes a prefix
  differently once a pass reaches its original context: prompts longer than that are prefilled whole, and a cache
  that grew past it is not kept.
At least the prompt's last token is always prefilled: its logits give the reply's first token. MLA (DeepSeek) caches
its full keys and values per layer, so it is cut like any other.

Budget (cache_budget.prefix_budget_bytes): bytes on the device the KV cache lives on, on top of the running
request's own KV cache, counted as the buffers' whole capacity (their slack included), not only the tokens held,
each buffer once however many kept caches read it; least recently used dropped first. On a GPU, kept caches are
dropped before a request whose KV cache would not fit the free memory (counting its whole prompt, for the case where
it copies the prefix); the copy of a split cache's tail is dropped, with the split cache, when it finds no memory;
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

from fmoe_local.kv_cache import (
    RETAIN,
    GrowingCache,
    KVLayer,
    cache_for_prefix,
    cut_in_place,
    first_capacity,
    kv_layers,
    next_capacity,
)


@dataclass(eq=False)  # identity: list.remove must not compare the ids arrays
class _Entry:
    """A kept cache of the tokens `ids` [n]: whole (`cache`, which nobody writes while it is kept), or split, once a
    request sharing its first `split` tokens took its buffers over: `head` per layer views the first `split` tokens
    of those buffers (which the request and whoever takes them from it only write after), `tail` is a copy of the
    rest; a sliding-window layer keeps its own tensors whole in `head` (its update never writes into them), no tail."""

    ids: np.ndarray
    cache: GrowingCache | None = None
    head: list[KVLayer] | None = None
    tail: list[KVLayer | None] | None = None
    split: int = 0

    def segments(self) -> list[list[KVLayer]]:
        """Each layer's tokens as consecutive pieces (kv_cache.cache_for_prefix)."""
        if self.cache is not None:
            return [[layer] for layer in kv_layers(self.cache)]
        return [[h] if t is None else [h, t] for h, t in zip(self.head, self.tail, strict=True)]

    def shape(self) -> list[KVLayer]:
        """Each layer's length and window (what `_cuttable` reads)."""
        if self.cache is not None:
            return kv_layers(self.cache)
        return [h if h.window is not None else KVLayer(None, None, len(self.ids), None) for h in self.head]

    def tensors(self) -> list[torch.Tensor]:
        return [t for segs in self.segments() for seg in segs for t in seg.tensors()]

    def buffer(self) -> int | None:
        """The growing buffers this entry reads, by the storage of its first growing layer's keys (None: none)."""
        return _buffer(self.head if self.cache is None else kv_layers(self.cache))


def _buffer(layers: list[KVLayer]) -> int | None:
    for layer in layers:
        if layer.window is None and layer.keys is not None:
            return layer.keys.untyped_storage().data_ptr()
    return None


def _bytes(tensors: list[torch.Tensor]) -> int:
    """Memory the tensors keep alive: whole storages, each once (views share one; a buffer's slack counts)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


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


# Boundary tokens of a prompt after which its sliding-window layers mark the window (PrefixCache `boundaries`), at
# 4.6 MB a mark on GPT-OSS-20B in bf16: on a harmony prompt the first reaches the start of the last message's text,
# the others earlier messages.
BOUNDARY_MARKS = 4


def _cuttable(layers: list[KVLayer], tokens: int) -> bool:
    """Whether the first `tokens` tokens can be taken from these layers exactly: every sliding-window layer has the
    window before them (KVLayer.window_at)."""
    return all(layer.window is None or layer.window_at(tokens) is not None for layer in layers)


def _cut_point(layers: list[KVLayer], shared: int) -> int:
    """The most of the first `shared` tokens these layers can give exactly (0: none). A sliding-window layer has the
    window before every point from its first token held + window − 1 up to its length, in what it holds now and in
    each mark: the largest such point not past `shared` ends one of those ranges, or is `shared`."""
    points = {shared}
    for layer in layers:
        if layer.window is not None:
            points.add(min(shared, layer.length))
            points.update(min(shared, mark[2]) for mark in layer.marks)
    return next((point for point in sorted(points, reverse=True) if point > 0 and _cuttable(layers, point)), 0)


class PrefixCache:
    def __init__(
        self,
        model_config: PretrainedConfig,
        budget_bytes: int,
        free_bytes: Callable[[], int | None] = lambda: None,
        boundaries: frozenset[int] = frozenset(),
    ) -> None:
        """`budget_bytes`: what the kept caches may take together (cache_budget.prefix_budget_bytes). `free_bytes`:
        memory free now where the KV cache lives (CUDA), asked before a request so that kept caches are dropped
        before the request's own KV cache runs the device out of memory; None where nothing is to be checked.
        `boundaries`: the token ids a chat template writes between messages (the tokenizer's special tokens), after
        which a later request may part from this one: a sliding-window layer marks what it holds after the last
        BOUNDARY_MARKS of them in a prompt (the start of its last message: requests under one system prompt)."""
        self._config = model_config
        self.budget_bytes = budget_bytes
        self._free_bytes = free_bytes
        self._entries: list[_Entry] = []  # least recently used first
        self._rope_limit = rope_length_limit(model_config)
        layers = kv_layers(self.new_cache())
        self.supported = layers is not None
        # Only a sliding-window layer marks anything: a model without one is spared finding them in every prompt.
        sliding = self.supported and any(layer.window is not None for layer in layers)
        self._boundaries = np.fromiter(boundaries if sliding else (), dtype=np.int64)

    @property
    def enabled(self) -> bool:
        return self.supported and self.budget_bytes > 0

    @property
    def held_bytes(self) -> int:
        """What the kept caches keep alive: each buffer once, at its capacity."""
        return _bytes([t for e in self._entries for t in e.tensors()])

    def __len__(self) -> int:
        return len(self._entries)

    def new_cache(self, capacity: int = 0) -> GrowingCache:
        return GrowingCache(self._config, capacity)

    def clear(self) -> None:
        self._entries.clear()

    def take(self, prompt: Sequence[int], new_tokens: int = 0) -> tuple[GrowingCache, int]:
        """A KV cache for `prompt` and how many of its first tokens it already holds (0: a fresh cache): the kept
        cache's own buffers where no other kept cache reads what the request will write, else a copy of the shared
        tokens (the module docstring). `new_tokens`: tokens the request may still add (the reply), for the room
        check and a new cache's capacity."""
        cache, reused = self._take(prompt, new_tokens)
        cache.begin(self._points(prompt) if self.enabled else ())
        return cache, reused

    def _points(self, prompt: Sequence[int]) -> tuple[int, ...]:
        """Where in `prompt` a sliding-window layer marks what it holds besides the prompt's end: after its last
        boundary tokens, up to BOUNDARY_MARKS of them, each more than RETAIN tokens before the next mark (a mark
        serves cuts up to RETAIN tokens before it: one nearer would hold nothing new)."""
        if not len(self._boundaries) or len(prompt) < 2:
            return ()
        at = np.flatnonzero(np.isin(np.asarray(prompt[:-1], dtype=np.int64), self._boundaries)) + 1
        points, nearest = [], len(prompt)
        for p in reversed(at.tolist()):
            if len(points) == BOUNDARY_MARKS:
                break
            if p < nearest - RETAIN:
                points.append(p)
                nearest = p
        return tuple(reversed(points))

    def _take(self, prompt: Sequence[int], new_tokens: int) -> tuple[GrowingCache, int]:
        if not self.enabled or len(prompt) < 2 or (self._rope_limit is not None and len(prompt) > self._rope_limit):
            return self._fresh(prompt, new_tokens)
        ids = np.asarray(prompt, dtype=np.int64)
        best: tuple[_Entry, int] | None = None
        for entry in reversed(self._entries):  # the most recently used first: it wins a tie
            shared = _cut_point(entry.shape(), min(common_prefix(entry.ids, ids), len(ids) - 1))
            if shared > (best[1] if best else 0):
                best = (entry, shared)
        if best is None:
            return self._fresh(prompt, new_tokens)
        entry, shared = best
        per_token = _bytes(entry.tensors()) / len(entry.ids)
        self._entries.remove(entry)
        if entry.cache is not None and shared >= self._read_up_to(entry.buffer()):
            self._make_room(len(prompt) - shared + new_tokens, per_token)
            if shared < len(entry.ids):
                self._split(entry, shared)
            return entry.cache, shared
        if shared < len(entry.ids):
            self._entries.append(entry)  # stays kept, now the most recently used
        self._make_room(len(prompt) + new_tokens, per_token)
        copy = cache_for_prefix(self._config, entry.segments(), shared, first_capacity(len(prompt), new_tokens))
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
        nbytes = _bytes([t for layer in layers for t in layer.tensors()])
        if nbytes > self.budget_bytes:
            fit = _cut_point(layers, int(n * self.budget_bytes // nbytes))
            if fit < 1:
                return
            del cache
            cache = self._copy(layers, fit)
            if cache is None:
                return
            n = fit
        kept = np.asarray(ids[:n], dtype=np.int64)
        # A kept cache this one extends is redundant: any prompt it serves, this one serves as far — but for the
        # cut points only its sliding-window layers' marks have (a regenerate of the turn before, its messages'
        # starts), not worth its bytes.
        self._entries = [e for e in self._entries if not (len(e.ids) <= n and common_prefix(e.ids, kept) == len(e.ids))]
        self._entries.append(_Entry(kept, cache))
        while len(self._entries) > 1 and self.held_bytes > self.budget_bytes:
            self._entries.pop(0)

    def prepare(self) -> None:
        """Between requests: room in the most recently kept cache for the next request that extends it (the next
        turn of a chat, the next step of an agent), so that its first pass writes in place instead of copying the
        whole conversation into a larger buffer inside its time to first token (kv_cache.next_capacity). Only within
        the budget (older caches go first, least recently used first) and, on a GPU, only in free memory; a cache
        that cannot grow stays as it is, and the pass that needs the room makes it, as without this."""
        if not self._entries or self._entries[-1].cache is None:
            return
        entry = self._entries[-1]
        room = entry.cache.room()
        target = next_capacity(*room) if room is not None else None
        if target is None:
            return
        grown = _bytes(entry.tensors()) * target / room[1]
        free = self._free_bytes()
        if grown > self.budget_bytes or (free is not None and free < grown):
            return
        try:
            entry.cache.reserve(target)
        except (torch.OutOfMemoryError, MemoryError):
            return
        while len(self._entries) > 1 and self.held_bytes > self.budget_bytes:
            self._entries.pop(0)

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _read_up_to(self, buffer: int | None) -> int:
        """How many first tokens of `buffer` split entries still read: no one may write below that."""
        if buffer is None:
            return 0
        return max((e.split for e in self._entries if e.cache is None and e.buffer() == buffer), default=0)

    def _split(self, entry: _Entry, shared: int) -> None:
        """Hand `entry`'s buffers to a request that writes after their first `shared` tokens: the entry stays kept
        as views of those and a copy of the rest (dropped if that copy finds no memory); the cache is cut to
        `shared` in place."""
        layers = kv_layers(entry.cache)
        try:
            tail = [
                None
                if layer.window is not None or layer.keys is None
                else KVLayer(
                    layer.keys[:, :, shared:].clone(), layer.values[:, :, shared:].clone(), layer.length - shared, None
                )
                for layer in layers
            ]
        except (torch.OutOfMemoryError, MemoryError):
            tail = None
        if tail is not None:
            head = [
                layer
                if layer.window is not None or layer.keys is None
                else KVLayer(layer.keys[:, :, :shared], layer.values[:, :, :shared], shared, None)
                for layer in layers
            ]
            self._entries.append(_Entry(entry.ids, head=head, tail=tail, split=shared))
        cut_in_place(entry.cache, shared)

    def _fresh(self, prompt: Sequence[int], new_tokens: int) -> tuple[GrowingCache, int]:
        if self._entries:
            last = self._entries[-1]
            self._make_room(len(prompt) + new_tokens, _bytes(last.tensors()) / len(last.ids))
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
        go; its sliding-window layers' window before them is copied too: `_cuttable`); kept caches are dropped
        (least recently used first) while the copy runs out of memory, and None when even that does not help."""
        while True:
            try:
                copies = [
                    [KVLayer(*(t.clone() for t in layer.window_at(tokens)), tokens, layer.window)]
                    if layer.keys is not None and layer.window is not None
                    else [layer]
                    for layer in layers
                ]
                return cache_for_prefix(self._config, copies, tokens, tokens)
            except (torch.OutOfMemoryError, MemoryError):
                if not self._entries:
                    return None
                self._entries.pop(0)
