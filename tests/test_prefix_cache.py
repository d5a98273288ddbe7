"""Prefix reuse: a request sharing a prompt prefix with an earlier one prefills only the rest, and its greedy reply is
token for token the one transformers' eager experts give the whole prompt (every family and the demo model): a
regenerate, the next turn of a chat, an edit. Then the rules where reuse would not be exact (sliding windows past
their window, length-dependent RoPE, a cache cut short), the byte budget, and the drop on reset_cache.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PhimoeConfig

from fmoe_local.cache_budget import SettingRefused, prefix_budget_bytes
from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.demo import demo_model_dir
from fmoe_local.generate import generate_ids
from fmoe_local.kv_cache import NEXT_ROOM, REPLY_ROOM, GrowingLayer, kv_layers
from fmoe_local.prefix_cache import PrefixCache, common_prefix, rope_length_limit
from fmoe_local.runtime import Runtime
from tests.tiny import FAMILIES

NEW = 8
GREEDY = Sampling(greedy=True, max_new_tokens=NEW)
FIRST = "Tell me about the ocean and the waves."
EDITED = "Tell me about the ocean and the fish."
NEXT = " Now a poem."


def eager(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32)
    return model.eval()


def reference(model, prompt_ids: torch.Tensor) -> list[int]:
    out = model.generate(prompt_ids, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)
    return out[0, prompt_ids.shape[1] :].tolist()


def same_reply(final, expected: list[int], eos: set[int]) -> bool:
    """Ours stops at EOS, the reference is forced on: equal up to our end."""
    got = final.token_ids
    return got == expected[: len(got)] and (len(got) == NEW or got[-1] in eos)


@pytest.mark.parametrize("family", [*FAMILIES, "demo"])
def test_reused_prefix_gives_the_eager_tokens_for_regenerate_next_turn_and_edit(family, tiny_model_dir):
    """Text prompts (the /v1/completions path: the same reuse as a chat's, without a template to render), short
    enough that GPT-OSS's 64-token sliding window never fills (tests below cover a full one)."""
    model_dir = demo_model_dir() if family == "demo" else tiny_model_dir(family)
    ref = eager(model_dir)
    config = RuntimeConfig(device="cpu", cache_experts=4, sampling=GREEDY)
    with Runtime.load(model_dir, config) as runtime:
        e = runtime.engine
        first = e.tokenize_prompt(FIRST)
        turn1 = runtime.generate(FIRST)
        assert turn1.stats.cached_tokens == 0
        assert same_reply(turn1, reference(ref, torch.tensor([first])), e.eos_ids), family

        again = runtime.generate(FIRST)  # regenerate: everything but the last prompt token is reused
        assert again.stats.cached_tokens == len(first) - 1, family
        assert again.token_ids == turn1.token_ids

        chat = FIRST + turn1.text + NEXT
        ids = e.tokenize_prompt(chat)
        held = np.asarray(first + again.token_ids[:-1])  # what the kept cache holds: the reply's last never ran
        turn2 = runtime.generate(chat)  # the next turn: what still matches of the last prompt and reply
        assert turn2.stats.cached_tokens == min(common_prefix(held, np.asarray(ids)), len(ids) - 1) >= len(first) - 1
        assert same_reply(turn2, reference(ref, torch.tensor([ids])), e.eos_ids), family
        assert len(ids) + NEW < 64

        edited = e.tokenize_prompt(EDITED)
        edit = runtime.generate(EDITED)  # an edit: the part before the change is reused
        assert edit.stats.cached_tokens == common_prefix(np.asarray(first), np.asarray(edited)) > 0, family
        assert same_reply(edit, reference(ref, torch.tensor([edited])), e.eos_ids), family


def test_reset_cache_and_a_zero_budget_prefill_whole(tiny_model_dir):
    prompt = [{"role": "user", "content": FIRST}]
    config = RuntimeConfig(device="cpu", cache_experts=4, sampling=GREEDY)
    with Runtime.load(tiny_model_dir("qwen3_moe"), config) as runtime:
        runtime.generate(prompt)
        assert runtime.generate(prompt).stats.cached_tokens > 0
        runtime.reset_cache()
        assert runtime.generate(prompt).stats.cached_tokens == 0
    with Runtime.load(tiny_model_dir("qwen3_moe"), config.with_changes(prefix_cache_gb=0.0)) as runtime:
        runtime.generate(prompt)
        assert runtime.generate(prompt).stats.cached_tokens == 0


def test_semantic_embedding_counts_the_reused_tokens(tiny_model_dir):
    """The matcher's semantic side sees the whole prompt with reuse as without: the first iteration's embedding."""
    prompt = [{"role": "user", "content": FIRST}]
    config = RuntimeConfig(device="cpu", cache_experts=4, sampling=Sampling(greedy=True, max_new_tokens=1))
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        seen = []
        offload = runtime.engine.offload
        publish = offload.publish

        def spy(kind, **kw):
            if kind == "begin_iteration":
                seen.append(kw["value"].clone())
            publish(kind, **kw)

        observer = runtime.engine.observer
        observer._publish = spy
        gathers = []
        gather = observer._embedding_sum
        observer._embedding_sum = lambda ids: gathers.append(ids.numel()) or gather(ids)
        assert runtime.generate(prompt).stats.cached_tokens == 0
        assert runtime.generate(prompt).stats.cached_tokens > 0
        torch.testing.assert_close(seen[1], seen[0], rtol=1e-5, atol=1e-6)
        # The same reused ids again (a regenerate; requests under one system prompt): their sum is not gathered
        # again, and the embedding is the same bits.
        assert runtime.generate(prompt).stats.cached_tokens > 0
        assert len(gathers) == 1 and torch.equal(seen[2], seen[1])


# ---- the rules, on the cache itself ----------------------------------------------------------------------------


def run(model, ids: list[int], cache, cached: int, n: int = 4) -> list[int]:
    return list(
        generate_ids(
            model,
            torch.tensor([ids]),
            Sampling(greedy=True, max_new_tokens=n),
            set(),
            threading.Event(),
            cache=cache,
            cached=cached,
        )
    )


def test_a_sliding_window_cache_is_cut_where_it_kept_the_window(tiny_model_dir):
    """GPT-OSS (window 64 in the tiny config): after a 300-token prompt and an 80-token reply its sliding layers hold
    the last 63 + RETAIN tokens, and their mark what they held at the prompt's end. So a regenerate (299 tokens) is
    cut from the mark; the next turn of a chat that parts from the kept tokens right after the prompt (its template
    drops the reply's analysis channel) then from what the regenerate kept (the runtime test below has it cut from a
    mark); a prompt extending all of it is reused whole, and an edit far back is prefilled whole (before, only the
    whole extension was reused: a GPT-OSS chat never was) — each reply the tokens of a whole prefill."""
    model = eager(tiny_model_dir("gpt_oss"))
    prefixes = PrefixCache(model.config, budget_bytes=1 << 30)
    prompt = [(7 * i) % 300 + 10 for i in range(300)]
    cache, reused = prefixes.take(prompt)
    reply = run(model, prompt, cache, reused, n=80)
    prefixes.put(prompt + reply, cache)
    sliding = [layer for layer in kv_layers(cache) if layer.window is not None]
    assert sliding and all(layer.marks[-1][2] == 300 and layer.window_at(299) is not None for layer in sliding)
    assert all(replace(layer, marks=()).window_at(299) is None for layer in sliding)  # the mark has it, alone
    cases = [
        (prompt, 299),  # a regenerate
        (prompt + [5, 6, 7], 300),  # the next turn, parting right after the prompt
        (prompt[:150] + [9, 9], 0),  # an edit before what the mark holds
        (prompt + reply[:-1] + [42, 43], 379),  # everything kept, and more
    ]
    for ids, expected in cases:
        cache, reused = prefixes.take(ids)
        assert reused == expected, (len(ids), reused)
        out = run(model, ids, cache, reused)
        assert out == run(model, ids, None, 0), len(ids)
        prefixes.put(ids + out, cache)


PROMPT_300 = [(7 * i) % 300 + 10 for i in range(300)]


def _kept_300(model) -> tuple[PrefixCache, list[int]]:
    """A PrefixCache holding GPT-OSS's cache of PROMPT_300 and an 80-token reply: its sliding layers (window 64) hold
    tokens 252–378 and their mark 173–299."""
    prefixes = PrefixCache(model.config, budget_bytes=1 << 30)
    cache, _ = prefixes.take(PROMPT_300)
    reply = run(model, PROMPT_300, cache, 0, n=80)
    prefixes.put(PROMPT_300 + reply, cache)
    return prefixes, reply


@pytest.mark.parametrize(("shared", "reused"), [(236, 236), (235, 0), (310, 300), (314, 300), (315, 315)])
def test_a_sliding_window_cache_is_cut_exactly_at_the_edges_of_what_it_kept(tiny_model_dir, shared, reused):
    """The window before a cut point must be held whole: from the mark (tokens 173–299) points 236 to 300, from the
    layers (252–378) points 315 to 379; between and before, the most a cut can give, or nothing."""
    model = eager(tiny_model_dir("gpt_oss"))
    prefixes, reply = _kept_300(model)
    ids = (PROMPT_300 + reply)[:shared] + [3, 2, 1]
    cache, got = prefixes.take(ids)
    assert got == reused
    assert run(model, ids, cache, got) == run(model, ids, None, 0)


def test_a_cache_handed_on_whole_marks_the_new_prompt(tiny_model_dir):
    """The next turn takes the kept cache whole; its own regenerate is then cut from the mark at that turn's prompt
    end, not from the first turn's."""
    model = eager(tiny_model_dir("gpt_oss"))
    prefixes, reply = _kept_300(model)
    turn = PROMPT_300 + reply[:-1] + [42, 43]
    cache, reused = prefixes.take(turn)
    assert reused == len(turn) - 2  # all it kept
    prefixes.put(turn + run(model, turn, cache, reused, n=80), cache)
    cache, reused = prefixes.take(turn)  # its regenerate
    assert reused == len(turn) - 1
    assert run(model, turn, cache, reused) == run(model, turn, None, 0)


def test_a_sliding_window_cache_over_the_budget_keeps_the_most_it_can_cut(tiny_model_dir):
    """Over the budget a kept cache keeps its first tokens that fit; where the window layers cannot be cut there,
    the most they can be cut at below it (300, from the mark), not nothing."""
    model = eager(tiny_model_dir("gpt_oss"))
    whole, reply = _kept_300(model)
    held = whole.held_bytes
    prefixes = PrefixCache(model.config, budget_bytes=held * 308 // 379)  # fits 307 of the 379 tokens
    cache, _ = prefixes.take(PROMPT_300)
    prefixes.put(PROMPT_300 + run(model, PROMPT_300, cache, 0, n=80), cache)
    assert len(prefixes) == 1
    ids = PROMPT_300 + [3, 2, 1]
    cache, reused = prefixes.take(ids)
    assert reused == 300 and run(model, ids, cache, reused) == run(model, ids, None, 0)


def test_a_request_parting_after_a_message_boundary_is_cut_there(tiny_model_dir):
    """A later request that shares a prompt only up to its last message (another question under one system prompt),
    parting more than RETAIN tokens before the prompt's end, is cut at the boundary token the sliding layers marked
    (before: prefilled whole), and gets a whole prefill's tokens."""
    model = eager(tiny_model_dir("gpt_oss"))
    prefixes = PrefixCache(model.config, budget_bytes=1 << 30, boundaries=frozenset({5}))
    prompt = PROMPT_300[:200] + [5] + PROMPT_300[201:]  # a boundary token at 200: its last message starts at 201
    cache, _ = prefixes.take(prompt)
    prefixes.put(prompt + run(model, prompt, cache, 0, n=20), cache)
    other = prompt[:201] + [3, 2, 1] * 30
    cache, reused = prefixes.take(other)
    assert reused == 201
    assert run(model, other, cache, reused) == run(model, other, None, 0)


def test_a_one_token_reply_s_kept_cache_holds_no_more_than_its_window(tiny_model_dir):
    """A kept cache whose last pass was the prompt's must not keep the whole prompt's keys in its sliding layers."""
    model = eager(tiny_model_dir("gpt_oss"))
    prefixes = PrefixCache(model.config, budget_bytes=1 << 30)
    cache, _ = prefixes.take(PROMPT_300)
    prefixes.put(PROMPT_300 + run(model, PROMPT_300, cache, 0, n=1), cache)
    sliding = [layer for layer in kv_layers(cache) if layer.window is not None]
    tensors = [t for layer in sliding for t in layer.tensors()]
    assert tensors and all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)


def test_a_gpt_oss_chat_s_next_turn_reuses_the_last_prompt(tiny_model_dir, tmp_path):
    """Through the runtime, on GPT-OSS's harmony template: the next turn renders the reply as its final channel, not
    as the model wrote it, so it parts from the kept tokens right after the last prompt; with a prompt past the
    sliding window and a reply past what the window layers keep, that whole prompt is reused (before: nothing), and
    the reply is the one a fresh prefill gives."""
    import shutil

    from tests.tool_templates import HARMONY_TEMPLATE

    model_dir = tmp_path / "gpt_oss"
    shutil.copytree(tiny_model_dir("gpt_oss"), model_dir)
    (model_dir / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    long = " ".join(f"word{i}" for i in range(20))  # about 110 tokens: past the 64-token window
    first = [{"role": "user", "content": long}]
    sampling = Sampling(greedy=True, max_new_tokens=90)  # past the 63 + RETAIN tokens the window layers keep
    config = RuntimeConfig(device="cpu", cache_experts=4, sampling=sampling)
    with Runtime.load(model_dir, config) as runtime:
        prompt = runtime.engine.tokenize_prompt(first)
        reply = runtime.generate(first)
        second = [*first, {"role": "assistant", "content": "It is dry."}, {"role": "user", "content": "Thanks."}]
        turn = runtime.generate(second, replace(sampling, max_new_tokens=NEW))
        assert turn.stats.cached_tokens == len(prompt) and len(reply.token_ids) == 90
        runtime.reset_cache()
        assert runtime.generate(second, replace(sampling, max_new_tokens=NEW)).token_ids == turn.token_ids


def test_gpt_oss_questions_under_one_system_prompt_reuse_it(tiny_model_dir, tmp_path):
    """Through the runtime, on the harmony template: a second question, longer than RETAIN tokens, under the same
    system prompt reuses everything up to its own text (the special tokens of the chat template are the boundaries
    the runtime gives), and its reply is a whole prefill's."""
    from tests.tiny import with_special_tokens
    from tests.tool_templates import HARMONY_TEMPLATE

    markers = ["<|start|>", "<|message|>", "<|end|>", "<|channel|>"]  # special tokens, as in the real checkpoint
    model_dir = with_special_tokens(tiny_model_dir("gpt_oss"), tmp_path / "gpt_oss", markers)
    (model_dir / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    system = {"role": "system", "content": " ".join(f"rule{i}" for i in range(12))}
    questions = [" ".join(f"{w}{i}" for i in range(14)) for w in ("ask", "query")]  # about 80 tokens each
    config = RuntimeConfig(device="cpu", cache_experts=4, sampling=Sampling(greedy=True, max_new_tokens=NEW))
    with Runtime.load(model_dir, config) as runtime:
        first, second = ([system, {"role": "user", "content": q}] for q in questions)
        runtime.generate(first)
        ids, kept = runtime.engine.tokenize_prompt(second), runtime.engine.tokenize_prompt(first)
        shared = common_prefix(np.asarray(kept), np.asarray(ids))
        turn = runtime.generate(second)
        assert turn.stats.cached_tokens == shared and len(kept) - shared > 64  # beyond what the end's mark serves
        runtime.reset_cache()
        assert runtime.generate(second).token_ids == turn.token_ids


def test_sliding_window_cache_within_its_window_is_cut(tiny_model_dir):
    model = eager(tiny_model_dir("gpt_oss"))
    prefixes = PrefixCache(model.config, budget_bytes=1 << 30)
    prompt = list(range(10, 40))
    cache, _ = prefixes.take(prompt)
    prefixes.put(prompt + run(model, prompt, cache, 0), cache)
    edited = prompt[:20] + [99, 98, 97]
    cache, reused = prefixes.take(edited)
    assert reused == 20
    assert run(model, edited, cache, reused) == run(model, edited, None, 0)
    assert len(prefixes) == 1  # the kept cache stays for its own conversation; the edit got views of it


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_a_cut_takes_the_kept_buffers_and_every_conversation_stays_exact(family, tiny_model_dir):
    """A request sharing the first 20 tokens of a kept cache takes its buffers over (no copy of the prefix; the kept
    cache's other tokens are saved first); a later one sharing only 10 must not write where the first kept
    conversation still reads its 20, so it gets a copy; then each of the three conversations' next turn gets the
    tokens of a whole prefill."""
    model = eager(tiny_model_dir(family))
    prefixes = PrefixCache(model.config, budget_bytes=1 << 30)
    replies = {}

    def turn(ids: list[int], reused_expected: int) -> tuple[object, list[int]]:
        cache, reused = prefixes.take(ids, new_tokens=4)
        assert reused == reused_expected, family
        out = run(model, ids, cache, reused)
        assert out == run(model, ids, None, 0), family
        prefixes.put(ids + out, cache)
        replies[tuple(ids)] = out
        return cache, out

    prompt = list(range(10, 40))
    first, reply = turn(prompt, 0)
    buffers = [storage(layer.keys) for layer in kv_layers(first)]
    edited = prompt[:20] + [99, 98, 97]
    cut, _ = turn(edited, 20)
    growing = [i for i, layer in enumerate(kv_layers(cut)) if layer.window is None]
    assert growing and all(storage(kv_layers(cut)[i].keys) == buffers[i] for i in growing)  # written after the 20
    shorter = prompt[:10] + [5, 6]
    copied, _ = turn(shorter, 10)
    assert all(storage(kv_layers(copied)[i].keys) != buffers[i] for i in growing)
    for ids in (prompt, edited, shorter):  # each conversation's next turn: all it kept is reused, exactly
        out = replies[tuple(ids)]
        nxt = ids + out[:-1] + [7, 8]
        turn(nxt, len(ids) + len(out) - 1)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_cache_its_reply_filled_grows_between_requests_not_in_the_next_turn(family, tiny_model_dir):
    """A reply fills the room its cache was made with; `prepare` grows the kept cache after the request, so the next
    turn's first pass writes into the same buffers (no copy of the conversation in its time to first token), and
    its reply is still a whole prefill's."""
    model = eager(tiny_model_dir(family))
    prefixes = PrefixCache(model.config, budget_bytes=1 << 30)
    prompt = list(range(10, 40))
    cache, _ = prefixes.take(prompt, new_tokens=4)
    reply = run(model, prompt, cache, 0)
    prefixes.put(prompt + reply, cache)
    layers = [layer for layer in cache.layers if isinstance(layer, GrowingLayer)]
    assert layers and all(layer.capacity - layer.length < NEXT_ROOM for layer in layers)
    prefixes.prepare()
    assert all(layer.capacity - layer.length >= REPLY_ROOM for layer in layers)
    buffers = [storage(layer.keys) for layer in layers]
    nxt = prompt + reply[:-1] + list(range(50, 90))  # 40 new tokens: more than the room the reply left
    cache, reused = prefixes.take(nxt, new_tokens=4)
    assert reused == len(prompt) + len(reply) - 1
    out = run(model, nxt, cache, reused)
    assert [storage(layer.keys) for layer in cache.layers if isinstance(layer, GrowingLayer)] == buffers
    assert out == run(model, nxt, None, 0)
    prefixes.put(nxt + out, cache)
    capacity = layers[0].capacity
    prefixes.prepare()  # room enough left: nothing copied again
    assert layers[0].capacity == capacity and storage(layers[0].keys) == buffers[0]


def test_prepare_grows_only_within_the_budget_and_free_memory(tiny_model_dir):
    model = eager(tiny_model_dir("olmoe"))
    free: list[int | None] = [None]
    for budget_tokens, free_now, grows in ((10_000, None, True), (40, None, False), (10_000, 0, False)):
        probe = PrefixCache(model.config, budget_bytes=1 << 30)
        prompt = list(range(10, 40))
        cache, _ = probe.take(prompt, new_tokens=4)
        probe.put(prompt + run(model, prompt, cache, 0), cache)
        per_token = probe.held_bytes / 34
        prefixes = PrefixCache(model.config, int(per_token * budget_tokens), free_bytes=lambda: free[0])
        cache, _ = prefixes.take(prompt, new_tokens=4)
        prefixes.put(prompt + run(model, prompt, cache, 0), cache)
        before = prefixes.held_bytes
        free[0] = free_now
        prefixes.prepare()
        assert (prefixes.held_bytes > before) == grows, (budget_tokens, free_now)
        assert prefixes.held_bytes <= prefixes.budget_bytes
        free[0] = None


def test_length_dependent_rope_reuses_only_within_its_original_context():
    config = PhimoeConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
        intermediate_size=16, num_local_experts=4, max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "short_mscale": 1.0, "long_mscale": 1.2,
        },
    )  # fmt: skip
    assert rope_length_limit(config) == 16
    prefixes = PrefixCache(config, budget_bytes=1 << 30)
    model = AutoModelForCausalLM.from_config(config).eval()
    short = list(range(1, 11))
    cache, _ = prefixes.take(short)
    prefixes.put(short + run(model, short, cache, 0), cache)
    assert prefixes.take(short)[1] == 9
    assert prefixes.take(short + list(range(20, 30)))[1] == 0  # 20 tokens: past 16, the frequencies switch
    cache, _ = prefixes.take(list(range(1, 15)))
    grown = list(range(1, 15)) + run(model, list(range(1, 15)), cache, 0, n=6)
    before = len(prefixes)
    prefixes.put(grown, cache)  # grew to 19 tokens, past 16: not kept
    assert len(prefixes) == before


def test_a_cache_cut_short_mid_pass_is_not_kept(tiny_model_dir):
    model = eager(tiny_model_dir("mixtral"))
    prefixes = PrefixCache(model.config, budget_bytes=1 << 30)
    cache = prefixes.new_cache()
    cache.update(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), 0)  # layer 0 wrote, the others did not
    prefixes.put(list(range(10)), cache)
    assert len(prefixes) == 0


def test_budget_keeps_the_most_recent_and_cuts_one_over_it(tiny_model_dir):
    model = eager(tiny_model_dir("qwen2_moe"))
    probe = PrefixCache(model.config, budget_bytes=1 << 30)
    a = list(range(10, 50))
    cache, _ = probe.take(a)
    probe.put(a + run(model, a, cache, 0, n=1), cache)
    per_token = probe.held_bytes / 40
    prefixes = PrefixCache(model.config, budget_bytes=int(per_token * 50))
    for start in (100, 200):  # two 40-token caches do not fit 50 tokens' worth: the older one goes
        ids = list(range(start, start + 40))
        cache, _ = prefixes.take(ids)
        prefixes.put(ids + run(model, ids, cache, 0, n=1), cache)
    assert len(prefixes) == 1 and prefixes.held_bytes <= prefixes.budget_bytes
    assert prefixes.take(list(range(100, 140)))[1] == 0
    long = list(range(10, 80))  # 70 tokens, over the whole budget: its first 50 are kept
    cache, _ = prefixes.take(long)
    prefixes.put(long + run(model, long, cache, 0, n=1), cache)
    assert prefixes.held_bytes <= prefixes.budget_bytes
    cache, reused = prefixes.take(long)
    assert 40 <= reused < 70
    assert run(model, long, cache, reused) == run(model, long, None, 0)


def test_device_memory_short_drops_kept_caches_first(tiny_model_dir):
    model = eager(tiny_model_dir("olmoe"))
    free = [1 << 40]
    prefixes = PrefixCache(model.config, budget_bytes=1 << 30, free_bytes=lambda: free[0])
    for start in (10, 60):
        ids = list(range(start, start + 30))
        cache, _ = prefixes.take(ids)
        prefixes.put(ids + run(model, ids, cache, 0, n=1), cache)
    assert len(prefixes) == 2
    free[0] = 0  # the GPU is full: the next request's KV cache would not fit
    prefixes.take(list(range(200, 230)), new_tokens=10)
    assert len(prefixes) == 0


def test_budget_setting():
    gib = 1 << 30
    assert prefix_budget_bytes(None, 8 * gib) == 2 * gib
    assert prefix_budget_bytes(None, 64 * gib) == 4 * gib
    assert prefix_budget_bytes(0.5, 8 * gib) == gib // 2
    with pytest.raises(SettingRefused, match="only 1.00 GB are free") as refused:
        prefix_budget_bytes(2.0, gib)
    assert refused.value.setting == "prefix_cache_gb"
    with pytest.raises(ValueError, match="Set the prefix cache to 0 GB"):
        RuntimeConfig(prefix_cache_gb=-1.0).validate()
    with pytest.raises(ValueError, match="Set the prefix cache to 0 GB"):
        RuntimeConfig(prefix_cache_gb=float("nan")).validate()


def test_common_prefix_and_kv_layers(tiny_model_dir):
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix(np.array([], dtype=np.int64), np.array([1])) == 0
    model = eager(tiny_model_dir("gpt_oss"))
    layers = kv_layers(PrefixCache(model.config, 1).new_cache())
    assert [layer.window for layer in layers] == [64, None]
