"""GrowingCache: written in place into buffers with room, it holds what transformers' DynamicCache holds (the same
greedy tokens and logits for every family, also when it has to grow past its capacity many times), its views share
the buffers (no copy per pass), and a kept prefix stays intact when requests extend it differently. Its sliding-window
layers give attention what transformers' own give it, and keep more, with marks of what they held in a prompt."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from fmoe_local.config import Sampling
from fmoe_local.generate import generate_ids
from fmoe_local.kv_cache import (
    GROWTH,
    NEXT_ROOM,
    REPLY_ROOM,
    RETAIN,
    GrowingCache,
    GrowingLayer,
    SlidingLayer,
    first_capacity,
    kv_layers,
    next_capacity,
)
from fmoe_local.prefix_cache import PrefixCache
from tests.tiny import FAMILIES


def eager(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32)
    return model.eval()


def run(model, ids: list[int], cache, cached: int = 0, n: int = 6) -> list[int]:
    sampling = Sampling(greedy=True, max_new_tokens=n)
    return list(
        generate_ids(model, torch.tensor([ids]), sampling, set(), threading.Event(), cache=cache, cached=cached)
    )


def test_layer_grows_past_its_capacity_and_keeps_every_token():
    """A pass past the capacity reallocates to 1.5× (or what it needs, if more) and keeps every token written."""
    layer = GrowingLayer(capacity=3)
    chunks = [torch.randn(1, 2, n, 4) for n in (2, 1, 1, 5, 1)]
    capacities = []
    for i, chunk in enumerate(chunks):
        keys, values = layer.update(chunk, -chunk)
        whole = torch.cat(chunks[: i + 1], dim=-2)
        assert torch.equal(keys, whole) and torch.equal(values, -whole)
        assert layer.get_seq_length() == whole.shape[-2] <= layer.capacity
        capacities.append(layer.capacity)
    assert capacities == [3, 3, 4, 9, 13] and GROWTH == 1.5
    grown = layer.keys
    keys, _ = layer.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))  # room left: written in place
    assert keys.data_ptr() == grown.data_ptr() and layer.capacity == 13


def test_first_capacity_leaves_room_for_a_reply_not_the_whole_context():
    assert first_capacity(100, 8) == 108
    assert first_capacity(100, 32_000) < 1000


def test_next_capacity_grows_a_full_cache_geometrically_and_leaves_a_roomy_one():
    assert next_capacity(100, 164) is None  # NEXT_ROOM left
    assert next_capacity(100, 101) == 100 + REPLY_ROOM  # small: at least a reply's room
    assert next_capacity(4000, 4001) == int(4001 * GROWTH)  # large: what the next pass would have grown it to
    assert NEXT_ROOM == 64


@pytest.mark.parametrize("family", FAMILIES)
def test_growing_cache_gives_dynamic_cache_tokens_and_logits(family, tiny_model_dir):
    """Against transformers' own DynamicCache, on the same model: prefill, then decode steps, with a capacity of one
    token so that the buffers grow at almost every pass."""
    model = eager(tiny_model_dir(family))
    ids = torch.tensor([[(5 * i) % 200 + 3 for i in range(20)]])
    ours, theirs = GrowingCache(model.config, capacity=1), DynamicCache(config=model.config)
    assert any(isinstance(layer, GrowingLayer) for layer in ours.layers), family
    inputs = ids
    with torch.inference_mode():
        for _ in range(8):
            a = model(input_ids=inputs, past_key_values=ours, use_cache=True).logits[0, -1]
            b = model(input_ids=inputs, past_key_values=theirs, use_cache=True).logits[0, -1]
            assert torch.equal(a, b), family
            inputs = a.argmax().view(1, 1)
    assert ours.get_seq_length() == theirs.get_seq_length() == 27


def test_decode_writes_in_place(tiny_model_dir):
    """No copy of the context per token: every decode step's keys are a view of the same buffer."""
    model = eager(tiny_model_dir("qwen3_moe"))
    cache = GrowingCache(model.config, capacity=64)
    run(model, list(range(10, 30)), cache)
    layer = cache.layers[0]
    ptr = layer.keys.data_ptr()
    run(model, list(range(10, 30)) + list(range(1, 9)), cache, cached=cache.get_seq_length(), n=4)
    assert layer.keys.data_ptr() == ptr and layer.capacity == 64


def test_budget_counts_the_capacity_not_only_the_filled_part(tiny_model_dir):
    model = eager(tiny_model_dir("qwen2_moe"))
    prefixes = PrefixCache(model.config, budget_bytes=1 << 30)
    ids = list(range(10, 30))
    cache, _ = prefixes.take(ids, new_tokens=200)
    prefixes.put(ids + run(model, ids, cache, n=2), cache)
    layers = [layer for layer in cache.layers if isinstance(layer, GrowingLayer)]
    assert layers and all(layer.capacity == 220 and layer.length == 21 for layer in layers)
    per_token = sum(
        t[0, :, 0].numel() * t.element_size() for layer in kv_layers(cache) for t in (layer.keys, layer.values)
    )
    assert prefixes.held_bytes == 220 * per_token


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_a_kept_prefix_survives_two_requests_extending_it_differently(family, tiny_model_dir):
    """A kept cache, then two requests sharing its first 20 tokens and then differing, one after the other, then the
    kept conversation's own next turn: each gets the tokens of a whole prefill (nobody wrote into what another
    still reads)."""
    model = eager(tiny_model_dir(family))
    prefixes = PrefixCache(model.config, budget_bytes=1 << 30)
    prompt = list(range(10, 40))
    cache, _ = prefixes.take(prompt)
    reply = run(model, prompt, cache)
    prefixes.put(prompt + reply, cache)
    for branch in ([99, 98, 97], [50, 51]):
        ids = prompt[:20] + branch
        cache, reused = prefixes.take(ids, new_tokens=6)
        assert reused == 20, family
        out = run(model, ids, cache, reused)
        assert out == run(model, ids, None), family
        prefixes.put(ids + out, cache)
    nxt = prompt + reply[:-1] + [7, 8]
    cache, reused = prefixes.take(nxt, new_tokens=6)
    assert reused == len(prompt) + len(reply) - 1, family
    assert run(model, nxt, cache, reused) == run(model, nxt, None), family


def test_a_sliding_layer_gives_attention_what_transformers_sliding_layer_gives():
    """The same keys, values and mask sizes at every pass (a prompt longer than the window, then single tokens, then a
    short pass), while it keeps RETAIN tokens more than the window needs and marks what it held after the first."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    window, ours, theirs = 16, SlidingLayer(16), DynamicSlidingWindowLayer(sliding_window=16)
    torch.manual_seed(0)
    for step, n in enumerate([40, *[1] * 30, 5, 1]):
        assert ours.get_mask_sizes(n) == theirs.get_mask_sizes(n), step
        k, v = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
        got, want = ours.update(k, v), theirs.update(k.clone(), v.clone())
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), step
        assert ours.get_seq_length() == theirs.get_seq_length()
        assert ours.keys.shape[-2] == min(ours.length, window - 1 + RETAIN)
    assert (
        ours.marks[-1][2] == 40 and ours.marks[-1][0].shape[-2] == 40
    )  # after the first pass: all 40 (fewer than 15 + 64)


def test_a_sliding_layer_marks_the_tokens_just_before_each_point_of_its_first_pass():
    """Keys that are their own positions: each mark (k, v, p) holds positions [p − n, p), from a fresh pass and from
    one after `hold` (a cut cache, whose first held token is not 0); points outside the pass are not marked."""
    window, held = 8, 8 - 1 + RETAIN

    def positions(start: int, stop: int) -> torch.Tensor:
        return torch.arange(start, stop, dtype=torch.float32).view(1, 1, -1, 1)

    layer = SlidingLayer(window)
    layer.begin((5, 50, 99, 150))
    layer.update(positions(0, 100), positions(0, 100))
    assert [m[2] for m in layer.marks] == [5, 50, 99, 100]  # 150: past the pass
    for keys, values, p in layer.marks:
        n = keys.shape[-2]
        assert n == min(p, held) and torch.equal(keys.view(-1), positions(p - n, p).view(-1)), p
        assert torch.equal(values, keys)
    cut = SlidingLayer(window)
    keys, values, p = layer.marks[2]  # positions [28, 99)
    cut.hold(keys[:, :, :50], values[:, :, :50], 78)  # positions [28, 78): its first held token is 28
    cut.begin((60, 80, 110))
    cut.update(positions(78, 130), positions(78, 130))
    assert [m[2] for m in cut.marks] == [80, 110, 130]  # 60: before the pass
    for keys, _, p in cut.marks:
        n = keys.shape[-2]
        assert torch.equal(keys.view(-1), positions(p - n, p).view(-1)), p
