"""The attention function fmoe-local registers: transformers' SDPA with the key/value heads kept grouped under a mask
on the CPU — the same bits as transformers' own function, without its copy of the past per query head — values
narrower than the keys padded onto SDPA's flash kernel, and transformers' function itself everywhere else."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.integrations import sdpa_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fmoe_local import attention, hf_internals
from fmoe_local.attention import (
    EAGER_NAME,
    NAME,
    eager_mask_for_pieces,
    sdpa_grouped,
    sdpa_mask_additive,
    use_our_attention,
)
from fmoe_local.config import Sampling
from fmoe_local.generate import generate_ids
from fmoe_local.hf_internals import attention_implementation


class _Attention(torch.nn.Module):
    num_key_value_groups = 2


def _inputs(q: int, k: int, d: int = 16) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, q, d), torch.randn(1, 2, k, d), torch.randn(1, 2, k, d)
    mask = (torch.arange(k)[None, :] <= torch.arange(k - q, k)[:, None])[None, None]  # new tokens after a past
    return query, key, value, mask


@pytest.mark.parametrize(("q", "k"), [(5, 40), (1, 40), (7, 7)])
def test_same_bits_as_transformers_sdpa(q, k):
    query, key, value, mask = _inputs(q, k)
    for m in (mask, None):
        ours, _ = sdpa_grouped(_Attention(), query, key, value, m, scaling=0.25)
        theirs, _ = sdpa_attention_forward(_Attention(), query, key, value, m, scaling=0.25)
        assert torch.equal(ours, theirs)


def test_a_masked_pass_does_not_repeat_the_past(monkeypatch):
    query, key, value, mask = _inputs(5, 40)

    def refuse(*args, **kwargs):
        raise AssertionError("the past was copied per query head")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", refuse)
    sdpa_grouped(_Attention(), query, key, value, mask)
    with pytest.raises(AssertionError, match="copied per query head"):
        sdpa_attention_forward(_Attention(), query, key, value, mask)


def test_a_model_on_sdpa_switches_and_keeps_its_tokens(tiny_model_dir, monkeypatch):
    """A pass over a past (the mask case) runs without repeat_kv and gives the tokens of a whole prefill."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3_moe"), dtype=torch.float32).eval()
    assert attention_implementation(model) == "sdpa"
    prompt = torch.tensor([list(range(10, 40))])
    greedy = Sampling(greedy=True, max_new_tokens=4)

    def run(cache, cached):
        return list(generate_ids(model, prompt, greedy, set(), threading.Event(), cache=cache, cached=cached))

    whole = run(None, 0)
    assert use_our_attention(model) and attention_implementation(model) == NAME
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: pytest.fail("the past was copied per query head"))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=prompt[:, :20], past_key_values=cache, use_cache=True)
    assert run(cache, 20) == whole


def test_a_model_on_another_implementation_is_left_alone(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("qwen3_moe"), dtype=torch.float32, attn_implementation="flex_attention"
    )
    assert not use_our_attention(model)
    assert attention_implementation(model) == "flex_attention"


def test_an_eager_model_runs_its_own_function_in_pieces_with_the_same_bits(tiny_model_dir, monkeypatch):
    """GPT-OSS's eager attention (its sinks), run on a few query rows at a time: the logits of a whole prefill, of a
    pass over a kept past and of a decode step are transformers' bits, and only the long passes are cut."""
    path = tiny_model_dir("gpt_oss")
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert attention_implementation(theirs) == "eager"
    assert use_our_attention(ours) and attention_implementation(ours) == EAGER_NAME
    heads = ours.config.num_attention_heads
    monkeypatch.setattr(attention, "PIECE_BYTES", heads * 24 * 301 * 4)  # 24 query rows a piece over 300 keys
    calls = []
    eager = hf_internals.eager_attention

    def counted(module):
        found = eager(module)
        return lambda *a, **k: calls.append(a[1].shape[2]) or found(*a, **k)

    monkeypatch.setattr(hf_internals, "eager_attention", counted)

    def passes(model):
        cache = DynamicCache(config=model.config)
        for start, stop in ((0, 200), (200, 300), (300, 301)):  # a prefill, a pass over a kept past, a decode step
            calls.clear()
            logits = model(input_ids=torch.tensor([list(range(start, stop))]), past_key_values=cache).logits
            yield logits, list(calls)

    with torch.inference_mode():
        for (a, _), (b, ours_calls) in zip(passes(theirs), passes(ours), strict=True):
            assert torch.equal(a, b)
            rows = a.shape[1]
            if rows > 50:  # cut into pieces (of 24 rows or more: the fewer keys, the more rows a piece holds)
                assert len(ours_calls) > ours.config.num_hidden_layers and max(ours_calls) < rows
            else:
                assert ours_calls == [rows] * ours.config.num_hidden_layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_additive_mask_gives_the_boolean_masks_bits(dtype):
    query, key, value, mask = (t.to(dtype) if t.is_floating_point() else t for t in _inputs(5, 40))
    additive = sdpa_mask_additive(batch_size=1, q_length=5, kv_length=40, q_offset=35, dtype=dtype)
    assert additive.dtype == dtype and torch.equal(additive == 0, mask)
    ours, _ = sdpa_grouped(_Attention(), query, key, value, additive, scaling=0.25)
    theirs, _ = sdpa_attention_forward(_Attention(), query, key, value, mask, scaling=0.25)
    assert torch.equal(ours, theirs)
    assert sdpa_mask_additive(batch_size=1, q_length=5, kv_length=5, dtype=dtype) is None  # SDPA's causal path


def test_a_pass_over_a_past_converts_no_mask_per_layer(tiny_model_dir):
    """SDPA turns a boolean mask into a float one in every layer (aten::where); the model's own mask is already
    float, so a pass over a past runs none."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3_moe"), dtype=torch.float32).eval()
    assert use_our_attention(model)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([list(range(10, 30))]), past_key_values=cache, use_cache=True)
        with torch.profiler.profile() as prof:
            model(input_ids=torch.tensor([list(range(30, 35))]), past_key_values=cache, use_cache=True)
    assert not [e for e in prof.key_averages() if e.key == "aten::where"]


class _Latent(torch.nn.Module):
    """DeepSeek's multi-head latent attention: as many key/value heads as query heads, values narrower than keys."""

    num_key_value_groups = 1


@pytest.mark.parametrize(("q", "k"), [(5, 40), (7, 7), (1, 40)])
def test_values_narrower_than_the_keys_run_on_the_flash_kernel(q, k):
    """Without the pad SDPA has no CPU kernel but its math path for them (every score held at once); with it, the
    flash kernel runs, and the columns kept are transformers' answer to float32's rounding."""
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, q, 16), torch.randn(1, 4, k, 16), torch.randn(1, 4, k, 8)
    mask = (torch.arange(k)[None, :] <= torch.arange(k - q, k)[:, None])[None, None]
    for m in (mask, None):
        theirs, _ = sdpa_attention_forward(_Latent(), query, key, value, m, scaling=0.25)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            ours, _ = sdpa_grouped(_Latent(), query, key, value, m, scaling=0.25)
            with pytest.raises(RuntimeError, match="No available kernel"):
                sdpa_attention_forward(_Latent(), query, key, value, m, scaling=0.25)
        assert ours.shape == theirs.shape == (1, q, 4, 8) and ours.is_contiguous()
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_a_deepseek_model_keeps_its_tokens_on_the_flash_kernel(tiny_model_dir):
    """A whole prefill and a pass over a kept past, each on the flash kernel (the math path refused), give the
    tokens transformers' own SDPA gives."""
    path = tiny_model_dir("deepseek_v2")
    prompt = torch.tensor([list(range(10, 40))])
    greedy = Sampling(greedy=True, max_new_tokens=6)

    def run(model, split):
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=prompt[:, :split], past_key_values=cache, use_cache=True)
        return list(generate_ids(model, prompt, greedy, set(), threading.Event(), cache=cache, cached=split))

    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert use_our_attention(ours)
    expected = list(generate_ids(theirs, prompt, greedy, set(), threading.Event()))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        assert list(generate_ids(ours, prompt, greedy, set(), threading.Event())) == expected
        assert run(ours, 20) == expected


def test_eager_pieces_repeat_the_past_once_and_keep_every_mask_s_bits(tiny_model_dir, monkeypatch):
    """A cut pass repeats the keys and values to the query heads once, not in every piece, and gives transformers'
    bits for a left-padded batch of two, a 4-D mask broadcast over the queries, and attention weights asked for."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    path = tiny_model_dir("gpt_oss")
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert use_our_attention(ours)
    monkeypatch.setattr(attention, "PIECE_BYTES", 2 * ours.config.num_attention_heads * 24 * 201 * 4)
    torch.manual_seed(0)
    ids = torch.randint(10, 300, (2, 200))
    padded = torch.ones(2, 200, dtype=torch.long)
    padded[1, :37] = 0
    repeats = []
    repeat_kv = modeling_gpt_oss.repeat_kv
    with torch.inference_mode():
        for kwargs in (
            {"input_ids": ids, "attention_mask": padded},
            {"input_ids": ids[:1], "attention_mask": torch.zeros(1, 1, 1, 200)},
            {"input_ids": ids[:1], "output_attentions": True},
        ):
            monkeypatch.setattr(modeling_gpt_oss, "repeat_kv", repeat_kv)
            a = theirs(**kwargs)
            monkeypatch.setattr(modeling_gpt_oss, "repeat_kv", lambda x, n: repeats.append(n) or repeat_kv(x, n))
            b = ours(**kwargs)
            assert torch.equal(a.logits, b.logits)
            if kwargs.get("output_attentions"):
                assert all(torch.equal(x, y) for x, y in zip(a.attentions, b.attentions, strict=True))
            else:
                assert repeats and set(repeats) == {1}  # the pieces ran on keys repeated beforehand
            repeats.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_eager_mask_is_held_as_bytes_and_made_transformers_floats_per_piece(dtype, monkeypatch):
    """The mask of a pass that will be cut is boolean, a byte a pair, and what each piece adds to its scores is
    transformers' eager mask to the bit; a pass that runs whole (a decode step) gets transformers' float mask as it
    is, made once for every layer."""
    from transformers import GptOssConfig
    from transformers.masking_utils import eager_mask, sliding_window_causal_mask_function

    config = GptOssConfig(num_attention_heads=4)
    monkeypatch.setattr(attention, "PIECE_BYTES", 4 * 2 * 41 * dtype.itemsize)  # 2 query rows a piece over 40 keys
    for mask_function in (None, sliding_window_causal_mask_function(8)):
        extra = {} if mask_function is None else {"mask_function": mask_function}
        for q_length, cut in ((5, True), (2, False), (1, False)):
            shape = {"batch_size": 1, "q_length": q_length, "kv_length": 40, "q_offset": 40 - q_length}
            held = eager_mask_for_pieces(**shape, dtype=dtype, config=config, **extra)
            theirs = eager_mask(**shape, dtype=dtype, **extra)
            assert held.dtype == (torch.bool if cut else dtype) and held.shape == theirs.shape
            ours = attention._additive(held, dtype)
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
