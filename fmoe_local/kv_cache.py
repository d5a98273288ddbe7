"""GrowingCache: a KV cache whose full-attention layers are written in place into buffers with room to grow.

Why: transformers' DynamicLayer concatenates every pass's keys and values onto what it holds, into new tensors, so a
decode step copies the whole context once per layer, and the first pass over a kept prefix (prefix_cache.py) copies
the prefix. A GrowingLayer holds buffers [B, heads, capacity, D], writes a pass's tokens into the slack after the
filled part, and hands attention a view of the filled part ([B, heads, length, D]: a slice, so strided between heads;
torch's SDPA and the eager path read it as they read a contiguous tensor, at the same speed — docs/bench.md). A pass
past the capacity reallocates to 1.5× (at least what it needs) and copies once: amortised, never a failure other
than the device's own out-of-memory. A kept cache that its reply filled is grown between requests instead
(`next_capacity`, which prefix_cache.PrefixCache.prepare applies), so that the next turn's first pass does not copy.

Scope: the layer and the cache that uses it for every full-attention layer of a config; sliding-window layers stay
transformers' DynamicSlidingWindowLayer (they keep only a window, so their copy is bounded). It is built through
transformers' public cache API: DynamicCache(config=…) decides each layer's kind, and its plain DynamicLayers (a
public class) are replaced by GrowingLayer, a DynamicLayer whose `update` writes in place. It does NOT decide what
is kept between requests nor who may write a kept buffer: prefix_cache.py does (a buffer is written only by the
request that owns it).

Threads: a cache belongs to the thread running the model (the runtime's worker), as every KV cache does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, DynamicLayer, PretrainedConfig

from fmoe_local import hf_internals

GROWTH = 1.5  # a full buffer's next capacity, relative: amortised O(1) copies per token, at most 1/3 unused
REPLY_ROOM = 256  # reply tokens a new cache has room for at first; a longer reply grows it
NEXT_ROOM = 64  # a kept cache with less room than this grows between requests (PrefixCache.prepare)


def first_capacity(prompt_tokens: int, new_tokens: int) -> int:
    """The room a request's new cache starts with: its prompt and up to REPLY_ROOM tokens of reply (not all that
    max_new_tokens allows, which may be the whole context: most replies end long before)."""
    return prompt_tokens + min(new_tokens, REPLY_ROOM)


class GrowingLayer(DynamicLayer):
    """A full-attention layer's keys and values in buffers with room: `keys`/`values` are views of their first
    `length` tokens; `update` writes the new tokens after them in place."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.length = 0
        self._wanted = capacity  # tokens to allocate room for at the first write
        self._k: torch.Tensor | None = None  # [B, H, capacity, D]
        self._v: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        cap = max(self._wanted, key_states.shape[-2])
        self._k = key_states.new_empty((*key_states.shape[:-2], cap, key_states.shape[-1]))
        self._v = value_states.new_empty((*value_states.shape[:-2], cap, value_states.shape[-1]))
        self._expose()
        self.is_initialized = True

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` tokens in all (before the first write: allocated then)."""
        if self._k is None:
            self._wanted = max(self._wanted, tokens)
        elif tokens > self.capacity:
            self._reallocate(tokens)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._reallocate(max(end, int(self.capacity * GROWTH)))
        self._k[:, :, self.length : end].copy_(key_states)
        self._v[:, :, self.length : end].copy_(value_states)
        self.length = end
        self._expose()
        return self.keys, self.values

    def write_prefix(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start as a copy of `keys`/`values` [B, H, n, D] (the first tokens of another cache), with room as
        reserved."""
        self.lazy_initialization(keys, values)
        self.length = 0
        self.update(keys, values)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"Cropping by a positive count ({tokens_to_remove}) is not supported: pass a negative one."
            )
        if self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._expose()

    def reset(self) -> None:
        self.length = 0
        self._k = self._v = None
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._k, self._v = self._k.repeat_interleave(repeats, dim=0), self._v.repeat_interleave(repeats, dim=0)
            self._expose()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices, ...], self._v[indices, ...]
            self._expose()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._k = self._k.index_select(0, beam_idx.to(self._k.device))
            self._v = self._v.index_select(0, beam_idx.to(self._v.device))
            self._expose()

    def _reallocate(self, capacity: int) -> None:
        k = self._k.new_empty((*self._k.shape[:-2], capacity, self._k.shape[-1]))
        v = self._v.new_empty((*self._v.shape[:-2], capacity, self._v.shape[-1]))
        k[:, :, : self.length].copy_(self._k[:, :, : self.length])
        v[:, :, : self.length].copy_(self._v[:, :, : self.length])
        self._k, self._v = k, v
        self._expose()

    def _expose(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]


class GrowingCache(DynamicCache):
    """transformers' DynamicCache for `config`, each plain full-attention layer a GrowingLayer with room for
    `capacity` tokens (more are added as needed)."""

    def __init__(self, config: PretrainedConfig, capacity: int = 0) -> None:
        super().__init__(config=config)
        self.layers = [GrowingLayer(capacity) if type(layer) is DynamicLayer else layer for layer in self.layers]
        if self.layer_class_to_replicate is DynamicLayer:  # a config naming no layers: they are added as used
            self.layer_class_to_replicate = GrowingLayer

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` tokens in every growing layer (a copy now for a layer that has less, none later)."""
        for layer in self.layers:
            if isinstance(layer, GrowingLayer):
                layer.reserve(tokens)

    def room(self) -> tuple[int, int] | None:
        """(tokens held, the least capacity) over the growing layers that hold tokens; None when none does."""
        layers = [layer for layer in self.layers if isinstance(layer, GrowingLayer) and layer.capacity]
        if not layers:
            return None
        return max(layer.length for layer in layers), min(layer.capacity for layer in layers)


def next_capacity(length: int, capacity: int) -> int | None:
    """The capacity a kept cache of `length` tokens grows to before the next request, None when it has room enough
    (NEXT_ROOM): a reply fills the room its cache was made with, so the next turn's first pass would otherwise copy
    the whole conversation into a larger buffer inside that turn's time to first token. The growth is what that pass
    would make (GROWTH), and at least REPLY_ROOM, so that copies stay amortised."""
    if capacity - length >= NEXT_ROOM:
        return None
    return max(length + REPLY_ROOM, int(capacity * GROWTH))


@dataclass(frozen=True)
class KVLayer:
    """One layer of a cache as prefix_cache.py needs it."""

    keys: torch.Tensor | None  # [B, heads, held, D]; None before the layer's first update
    values: torch.Tensor | None
    length: int  # tokens the layer has seen (a sliding-window layer holds only the last window − 1 of them)
    window: int | None  # the sliding window, None for full attention


def kv_layers(cache: DynamicCache) -> list[KVLayer] | None:
    """Each layer of `cache`; None when one is of a kind other than a GrowingLayer or transformers' sliding-window
    dynamic layer (linear attention, quantised, offloaded, a plain DynamicLayer…), which this module does not cut."""
    out = []
    for layer in cache.layers:
        window = hf_internals.sliding_window(layer)
        if window is None and not isinstance(layer, GrowingLayer):
            return None
        held = layer.is_initialized and layer.keys is not None
        keys, values = (layer.keys, layer.values) if held else (None, None)
        out.append(KVLayer(keys, values, layer.get_seq_length(), window))
    return out


def cache_for_prefix(
    config: PretrainedConfig, layers: Sequence[Sequence[KVLayer]], tokens: int, capacity: int
) -> GrowingCache | None:
    """A GrowingCache for `config` holding the first `tokens` tokens of `layers` (each layer's tokens: its segments
    one after the other), with room for `capacity`: its growing layers a copy (they will be written after it), its
    sliding-window layers views of their one segment (their update never writes into what they hold; they must hold
    all they have seen: prefix_cache's `_cuttable`). None when the layers are not this config's."""
    cache = GrowingCache(config, capacity)
    if len(cache.layers) != len(layers):
        return None
    for target, segments in zip(cache.layers, layers, strict=True):
        if segments[0].keys is None:
            continue
        window = segments[0].window
        if isinstance(target, GrowingLayer) and all(seg.window is None for seg in segments):
            pieces, left = [], tokens
            for seg in segments:
                n = min(left, seg.keys.shape[-2])
                pieces.append((seg.keys[:, :, :n], seg.values[:, :, :n]))
                left -= n
            if left:
                return None
            target.write_prefix(*pieces[0])
            for keys, values in pieces[1:]:
                target.update(keys, values)
        elif len(segments) == 1 and window is not None and hf_internals.sliding_window(target) == window:
            hf_internals.hold_views(target, segments[0].keys[:, :, :tokens], segments[0].values[:, :, :tokens])
        else:
            return None
    return cache


def cut_in_place(cache: GrowingCache, tokens: int) -> None:
    """Make `cache` hold only its first `tokens` tokens, without a copy: its growing layers' next tokens go after
    them, into the same buffers; its sliding-window layers (which must hold all they have seen) hold views of their
    first tokens, so the tensors they held stay as they were for whoever still reads them."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.crop(tokens - layer.length)
        elif layer.is_initialized and layer.keys is not None:
            hf_internals.hold_views(layer, layer.keys[:, :, :tokens], layer.values[:, :, :tokens])
