"""GrowingCache: a KV cache whose full-attention layers are written in place into buffers with room to grow.

Why: transformers' DynamicLayer concatenates every pass's keys and values onto what it holds, into new tensors, so a
decode step copies the whole context once per layer, and the first pass over a kept prefix (prefix_cache.py) copies
the prefix. A GrowingLayer holds buffers [B, heads, capacity, D], writes a pass's tokens into the slack after the
filled part, and hands attention a view of the filled part ([B, heads, length, D]: a slice, so strided between heads;
torch's SDPA and the eager path read it as they read a contiguous tensor, at the same speed — docs/bench.md). A pass
past the capacity reallocates to 1.5× (at least what it needs) and copies once: amortised, never a failure other
than the device's own out-of-memory. A kept cache that its reply filled is grown between requests instead
(`next_capacity`, which prefix_cache.PrefixCache.prepare applies), so that the next turn's first pass does not copy.

A sliding-window layer (GPT-OSS's every other layer) is a SlidingLayer: attention sees what transformers' own
sliding-window layer gives it (the last window − 1 tokens and the pass's, with the same mask sizes), but it keeps
RETAIN tokens more, and copies of what it held when the request's prompt had been read and at a few points inside
it (its marks), so that a kept cache can be cut short (prefix_cache.py) within those: one token before the prompt's
end (a regenerate), at it (the next turn of a GPT-OSS chat, whose template drops the reply's analysis channel from
the next prompt, so that it parts from the kept tokens right after the last prompt), or at the start of the prompt's
last message (another question under the same system prompt). transformers' layer keeps only the window: such a
cache could be reused only whole, which a GPT-OSS chat never is.

Scope: the two layers and the cache that uses them. It is built through transformers' public cache API:
DynamicCache(config=…) decides each layer's kind, and its plain DynamicLayers are replaced by GrowingLayer, its
sliding-window layers by SlidingLayer (both DynamicLayers, a public class, with the layer interface's
`get_mask_sizes`/`is_sliding`). It does NOT decide what is kept between requests nor who may write a kept buffer:
prefix_cache.py does (a buffer is written only by the request that owns it).

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
# Tokens a SlidingLayer keeps beyond its window − 1: how far back from where it is, or from a mark, a kept cache can
# be cut. A regenerate needs one; more covers a short edit at the prompt's end, at 64 tokens' keys and values a layer.
RETAIN = 64


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


class SlidingLayer(DynamicLayer):
    """A sliding-window layer that keeps RETAIN tokens more than its window needs, and its marks (module docstring).
    `keys`/`values` hold the last tokens it has seen (`length` of them seen); `marks` are (keys, values, length):
    what it held after the request's first pass (its prompt), and the same at each of `points` that pass went
    through (where a later request may part from this one: the start of the prompt's last message), copies of their
    own."""

    is_sliding = True

    def __init__(self, sliding_window: int) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.length = 0
        self.marks: tuple[tuple[torch.Tensor, torch.Tensor, int], ...] = ()
        self.marking = True  # the next update is a request's first pass: mark after it
        self.points: tuple[int, ...] = ()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty((*key_states.shape[:-2], 0, key_states.shape[-1]))
        self.values = value_states.new_empty((*value_states.shape[:-2], 0, value_states.shape[-1]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.length
        first = start - self.keys.shape[-2]  # the position of `keys`' first token below
        self.length += key_states.shape[-2]
        # New tensors, as transformers' layer makes: what a kept cache or a mark holds is never written.
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        held = self.sliding_window - 1 + RETAIN
        self.keys, self.values = keys[:, :, -held:], values[:, :, -held:]
        if self.marking:
            # Copies: a view would keep the whole prompt's keys alive in a kept cache whose last pass this was (a
            # one-token reply). The layer and its last mark share one: neither is ever written.
            self.keys, self.values = self.keys.clone(), self.values.clone()
            marks = []
            for p in self.points:
                if start < p < self.length:  # a point this pass goes through: the tokens just before it
                    window = slice(max(0, p - first - held), p - first)
                    marks.append((keys[:, :, window].clone(), values[:, :, window].clone(), p))
            self.marks = (*marks, (self.keys, self.values, self.length))
            self.marking = False
        visible = self.sliding_window - 1 + key_states.shape[-2]
        return keys[:, :, -visible:], values[:, :, -visible:]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv length, kv offset) of the mask, as transformers' sliding-window layer gives them: the window before
        the pass and the pass."""
        offset = max(self.length - self.sliding_window + 1, 0)
        if self.length >= self.sliding_window:
            return self.sliding_window - 1 + query_length, offset
        return self.length + query_length, offset

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.sliding_window

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("A sliding-window layer is cut by `hold`, from what it keeps (prefix_cache.py).")

    def reset(self) -> None:
        self.length, self.marks, self.marking, self.points = 0, (), True, ()
        super().reset()

    def begin(self, points: tuple[int, ...] = ()) -> None:
        """The next update is a request's first pass (its prompt, or what it does not reuse of it): mark after it,
        and at each of `points` it goes through."""
        self.marking, self.points = True, points

    def hold(self, keys: torch.Tensor, values: torch.Tensor, seen: int) -> None:
        """Go on from `seen` tokens, of which `keys`/`values` are the last ones (KVLayer.window_at): views of another
        cache's, which this layer never writes. Its marks, of other tokens, go."""
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.length = keys, values, seen
        self.marks, self.marking = (), True


class GrowingCache(DynamicCache):
    """transformers' DynamicCache for `config`, each plain full-attention layer a GrowingLayer with room for
    `capacity` tokens (more are added as needed), each sliding-window one a SlidingLayer."""

    def __init__(self, config: PretrainedConfig, capacity: int = 0) -> None:
        super().__init__(config=config)
        self.layers = [self._ours(layer, capacity) for layer in self.layers]
        if self.layer_class_to_replicate is DynamicLayer:  # a config naming no layers: they are added as used
            self.layer_class_to_replicate = GrowingLayer

    @staticmethod
    def _ours(layer: object, capacity: int) -> object:
        if type(layer) is DynamicLayer:
            return GrowingLayer(capacity)
        window = hf_internals.sliding_window(layer)
        return layer if window is None else SlidingLayer(window)

    def begin(self, points: tuple[int, ...] = ()) -> None:
        """A request takes this cache: its sliding-window layers mark what they hold after its first pass, and at
        each of `points` (token positions) that pass goes through."""
        for layer in self.layers:
            if isinstance(layer, SlidingLayer):
                layer.begin(points)

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
    length: int  # tokens the layer has seen (a sliding-window layer holds only the last of them)
    window: int | None  # the sliding window, None for full attention
    marks: tuple[tuple[torch.Tensor, torch.Tensor, int], ...] = ()  # a SlidingLayer's marks

    def tensors(self) -> list[torch.Tensor]:
        held = [self.keys, self.values, *(t for mark in self.marks for t in mark[:2])]
        return [t for t in held if t is not None]

    def window_at(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What a sliding-window layer needs to go on from the first `tokens` tokens: the last of them it holds (at
        least window − 1, or every one), from what it holds now or from a mark; None when none has them."""
        for keys, values, length in ((self.keys, self.values, self.length), *self.marks):
            if keys is None or tokens > length:
                continue
            first = length - keys.shape[-2]  # the first token held
            if first == 0 or tokens - (self.window - 1) >= first:
                return keys[:, :, : tokens - first], values[:, :, : tokens - first]
        return None


def kv_layers(cache: DynamicCache) -> list[KVLayer] | None:
    """Each layer of `cache`; None when one is of a kind other than a GrowingLayer or a SlidingLayer (linear
    attention, quantised, offloaded, a plain DynamicLayer…), which this module does not cut."""
    out = []
    for layer in cache.layers:
        if not isinstance(layer, (GrowingLayer, SlidingLayer)):
            return None
        held = layer.is_initialized and layer.keys is not None
        keys, values = (layer.keys, layer.values) if held else (None, None)
        if isinstance(layer, SlidingLayer):
            out.append(KVLayer(keys, values, layer.length, layer.sliding_window, layer.marks))
        else:
            out.append(KVLayer(keys, values, layer.length, None))
    return out


def cache_for_prefix(
    config: PretrainedConfig, layers: Sequence[Sequence[KVLayer]], tokens: int, capacity: int
) -> GrowingCache | None:
    """A GrowingCache for `config` holding the first `tokens` tokens of `layers` (each layer's tokens: its segments
    one after the other), with room for `capacity`: its growing layers a copy (they will be written after it), its
    sliding-window layers views of their one segment's (their update never writes into what they hold), which must
    have them (KVLayer.window_at: prefix_cache's `_cuttable`). None when the layers are not this config's."""
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
        elif len(segments) == 1 and isinstance(target, SlidingLayer) and target.sliding_window == window:
            held = segments[0].window_at(tokens)
            if held is None:
                return None
            target.hold(*held, tokens)
        else:
            return None
    return cache


def cut_in_place(cache: GrowingCache, tokens: int) -> None:
    """Make `cache` hold only its first `tokens` tokens, without a copy: its growing layers' next tokens go after
    them, into the same buffers; its sliding-window layers (which must have them: KVLayer.window_at) hold views of
    what they held, so the tensors they held stay as they were for whoever still reads them."""
    for layer, kept in zip(cache.layers, kv_layers(cache), strict=True):
        if isinstance(layer, GrowingLayer):
            layer.crop(tokens - layer.length)
        elif kept.keys is not None:
            held = kept.window_at(tokens)
            if held is None:
                raise ValueError(f"This cache's sliding-window layers cannot be cut at {tokens} tokens.")
            layer.hold(*held, tokens)
