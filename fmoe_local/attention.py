"""The attention implementations fmoe-local gives a model on transformers' SDPA or eager attention: transformers'
own, except that on the CPU SDPA's key/value heads stay grouped (SDPA's `enable_gqa`) also when the pass has a mask
and narrower values are padded, and that eager attention runs on pieces of query rows (each below).

Why: transformers' `sdpa_attention_forward` copies every layer's keys and values out to the query heads (`repeat_kv`)
whenever SDPA gets a mask, because CUDA's fast kernels do not take grouped heads under a mask. A pass that extends a
kept KV cache (prefix_cache.py) always has one — its new tokens see the whole past and each other causally — so each
such pass copied the whole past twice over and ran the attention on the repeated heads: on the demo model most of
what a reused 4,000-token prefix added to the first token's time (docs/bench.md, "Prefix reuse"). torch's CPU
kernel takes a mask and grouped heads together, and gives the same bits as on the repeated heads
(tests/test_attention.py); a fresh prompt's pass (no mask) already runs grouped.

The mask function is transformers' sdpa_mask, made additive (0 where a key is seen, −inf where not, in the pass's
dtype) once per pass on the CPU: given transformers' boolean mask, SDPA makes that same float mask itself for every
layer (two `where`s over [1, 1, N, past + N] a layer), and it computes the same bits from either (tests/
test_attention.py).

Values narrower than the keys (DeepSeek's multi-head latent attention: 192-wide keys, 128-wide values) are padded with
zeros to the keys' width on the CPU, and the output cut back, as transformers itself does for flash attention. Why:
torch's CPU flash kernel needs one width, so without the pad SDPA falls back to its math path, which holds every
head's whole [queries, keys] score matrix: for DeepSeek-V2-Lite's 16 heads, 268 MB a layer at a 2,048-token prompt
and 4.3 GB at 8,192, and about 3× the time of the flash kernel (docs/bench.md, "A long prompt's attention").
The zero columns add nothing to the columns kept.

A model on eager attention (GPT-OSS: SDPA has no sinks) gets its own modeling file's eager function, run on as many
query rows at a time as keep one piece's scores within PIECE_BYTES. Why: eager attention holds the scores of every
head, query and key at once, and copies them three times over (the mask added, the sinks joined, the softmax): for
GPT-OSS-20B's 64 heads, 8.6 GB a copy at an 8,192-token prompt in bf16 and 51 GB at 20,000 — more than a consumer
GPU has, at the prompt length a coding agent sends. Each query row's softmax is its own, so on the CPU the pieces give
the whole call's bits (tests/test_attention.py; a GPU's library may tile a product of fewer rows otherwise, which
has not run here). A pass no longer than one piece (every decode step) is one call, as before. On every device.
The mask of a pass that will be cut stays boolean (eager_mask_for_pieces: transformers' eager mask before it is made
float), and each piece's rows are made additive as eager_mask makes them: still one value per query-key pair and
layer type, once a pass, but a byte each instead of a float (0.4 GB at 20,000 tokens instead of 1.6 GB in float32,
0.8 GB in bf16). A pass that runs whole (every decode step) gets transformers' float mask, made once for all layers.

Scope: registering each function and its mask function under one name with transformers' AttentionInterface and
AttentionMaskInterface (its documented way to customise attention), and choosing it for a model loaded with "sdpa" or
"eager". Under SDPA every other case — a GPU, one query token (transformers packs the groups into the query instead),
no mask, a position bias, a paged cache, a model without grouped heads — is transformers' function unchanged, but for
the pad. A model on any other implementation is left as it is.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from fmoe_local import hf_internals

NAME = "fmoe_local_sdpa"
EAGER_NAME = "fmoe_local_eager"
# One piece of an eager pass: its scores (heads × query rows × keys) at most this many bytes, so that its three copies
# fit beside a model on a consumer GPU; at 256 MB each product is still large enough to run at full speed.
PIECE_BYTES = 256 * 2**20


def sdpa_grouped(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, q, d]
    key: torch.Tensor,  # [B, H_kv, k, d]
    value: torch.Tensor,  # [B, H_kv, k, d_v]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa_attention_forward, with grouped heads under a mask and values as wide as the keys on the CPU
    (the module docstring)."""
    width = value.shape[-1]
    if query.device.type == "cpu" and width < key.shape[-1]:
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - width))
        out, weights = sdpa_grouped(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
        return out[..., :width].contiguous(), weights
    if attention_mask is not None and attention_mask.is_floating_point() and attention_mask.dtype != query.dtype:
        attention_mask = attention_mask.to(query.dtype)  # 0 and −inf are exact in every float dtype
    q_length = query.shape[2]
    grouped = (
        query.device.type == "cpu"
        and attention_mask is not None
        and q_length > 1
        and getattr(module, "num_key_value_groups", 1) > 1
        and key.shape[-1] == value.shape[-1] <= 256
        and kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )
    if not grouped:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # As transformers' function runs it with a mask (is_causal is then False), less the repeat.
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def sdpa_mask_additive(*args: object, **kwargs: object) -> torch.Tensor | None:
    """transformers' sdpa_mask; on the CPU, a boolean mask made additive in the pass's dtype (the module
    docstring). None (no mask: SDPA's own causal path) and every other device are left as transformers makes them."""
    mask = sdpa_mask(*args, **kwargs)
    dtype = kwargs.get("dtype")
    if mask is None or mask.dtype != torch.bool or mask.device.type != "cpu" or not isinstance(dtype, torch.dtype):
        return mask
    if not dtype.is_floating_point:
        return mask
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


class _Repeated(torch.nn.Module):
    """An attention layer whose keys and values come already repeated to its query heads: the eager function sees
    one group and copies nothing; every other attribute (GPT-OSS's sinks, …) is the layer's own."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.training = layer.training
        self.num_key_value_groups = 1

    def __getattr__(self, name: str) -> object:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)


def eager_in_pieces(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, q, d]
    key: torch.Tensor,  # [B, H_kv, k, d]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # [B, 1, q or 1, k] or None
    scaling: float,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`module`'s own eager attention, on as many query rows at a time as keep a piece's scores within PIECE_BYTES
    (the module docstring). A pass asked for its attention weights runs whole: they are the whole score matrix."""
    eager = hf_internals.eager_attention(module)
    if eager is None:
        raise RuntimeError(f"{type(module).__name__}'s modeling file has no eager attention function to run.")
    rows = _piece_rows(query.shape[0], query.shape[1], key.shape[2], query.dtype)
    length = query.shape[2]
    if length <= rows or kwargs.get("output_attentions"):
        mask = _additive(attention_mask, query.dtype)
        return eager(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    # The eager function repeats the keys and values to the query heads at every call: once here instead.
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        module = _Repeated(module)
    pieces = []
    for start in range(0, length, rows):
        mask = attention_mask
        if mask is not None and mask.shape[-2] != 1:  # a mask broadcast over the queries serves every piece whole
            mask = mask[:, :, start : start + rows]
        mask = _additive(mask, query.dtype)
        piece, _ = eager(
            module, query[:, :, start : start + rows], key, value, mask, scaling=scaling, dropout=dropout, **kwargs
        )
        pieces.append(piece)
    return torch.cat(pieces, dim=1), None


def _piece_rows(batch: int, heads: int, keys: int, dtype: torch.dtype) -> int:
    """Query rows in one piece of an eager pass: its scores over `keys` keys and the sinks' column within
    PIECE_BYTES."""
    return max(1, PIECE_BYTES // (batch * heads * (keys + 1) * dtype.itemsize))


def eager_mask_for_pieces(**kwargs: object) -> torch.Tensor | None:
    """transformers' eager mask for a pass that runs whole; for one eager_in_pieces will cut, the same mask left
    boolean (True where a key is seen; None where transformers skips it, a bidirectional mask), made additive a
    piece at a time (the module docstring). transformers passes every argument by name, the model's config too."""
    heads = getattr(kwargs.get("config"), "num_attention_heads", None)
    dtype = kwargs.get("dtype", torch.float32)
    whole = heads is None or kwargs["q_length"] <= _piece_rows(kwargs["batch_size"], heads, kwargs["kv_length"], dtype)
    if whole:
        return eager_mask(**kwargs)
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("dtype", None)
    return sdpa_mask(allow_is_causal_skip=False, **kwargs)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as transformers' eager_mask makes it: 0 where a key is seen, the dtype's lowest value where not."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)


def use_our_attention(model: PreTrainedModel) -> bool:
    """Switch `model` to sdpa_grouped if it runs transformers' SDPA, or to eager_in_pieces if it runs eager attention
    and its modeling file has the eager function; whether it switched."""
    implementation = hf_internals.attention_implementation(model)
    if implementation == "sdpa":
        AttentionInterface.register(NAME, sdpa_grouped)
        AttentionMaskInterface.register(NAME, sdpa_mask_additive)
        model.set_attn_implementation(NAME)
        return hf_internals.attention_implementation(model) == NAME
    if implementation == "eager" and hf_internals.eager_attention(model) is not None:
        AttentionInterface.register(EAGER_NAME, eager_in_pieces)
        AttentionMaskInterface.register(EAGER_NAME, eager_mask_for_pieces)
        model.set_attn_implementation(EAGER_NAME)
        return hf_internals.attention_implementation(model) == EAGER_NAME
    return False
