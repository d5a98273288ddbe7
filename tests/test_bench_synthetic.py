"""Synthetic mode of the live benchmark: real shapes, and routing forced from a folded trace onto the experts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fmoe_bench import live
from fmoe_bench.synthetic import SYNTHETIC, ForcedRouting, build_synthetic, fold_trace
from fmoe_local.traces import Trace, load_trace, save_trace

PROMPTS = ["Write a short poem about the sea.", "Explain how a router picks two experts for every token."]
TINY_MIXTRAL = dict(
    model_type="mixtral", hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384, max_position_embeddings=512,
)  # fmt: skip
# Qwen3-MoE names its expert count num_experts (SYNTHETIC["qwen3-30b-a3b"] has 128 experts, top-8; this one 8, top-2)
TINY_QWEN3 = dict(
    model_type="qwen3_moe", hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=384, max_position_embeddings=512,
)  # fmt: skip
TRACE_LAYERS, TRACE_EXPERTS, TRACE_K = 3, 16, 4


def test_synthetic_mixtral_shapes_agree_with_the_replay_preset():
    from fmoe_bench.presets import PRESETS

    shapes, preset = SYNTHETIC["mixtral-8x7b"], PRESETS["mixtral-8x7b"]
    assert (shapes["hidden_size"], shapes["intermediate_size"]) == (preset.hidden, preset.expert_intermediate)
    assert (shapes["num_local_experts"], shapes["num_experts_per_tok"]) == (preset.num_experts, preset.top_k)


def test_synthetic_qwen3_shapes_agree_with_the_replay_preset_and_name_their_experts():
    from fmoe_bench.presets import PRESETS
    from fmoe_bench.synthetic import experts_and_top_k

    shapes, preset = SYNTHETIC["qwen3-30b-a3b"], PRESETS["qwen3-30b-a3b"]
    assert (shapes["hidden_size"], shapes["moe_intermediate_size"]) == (preset.hidden, preset.expert_intermediate)
    assert experts_and_top_k(shapes) == (preset.num_experts, preset.top_k) == (128, 8)
    assert experts_and_top_k(SYNTHETIC["mixtral-8x7b"]) == (8, 2)


def _trace(path: Path) -> Path:
    """Two requests (a 6-row prefill, then 9 decode rows each) routed at random over 3 layers x 16 experts, top-4."""
    rng = np.random.default_rng(3)
    rows = 30
    ids = np.stack([[rng.permutation(TRACE_EXPERTS)[:TRACE_K] for _ in range(TRACE_LAYERS)] for _ in range(rows)])
    probs = rng.dirichlet(np.ones(TRACE_K), size=(rows, TRACE_LAYERS)).astype(np.float32)
    one = np.array([0] * 6 + list(range(1, 10)))
    iters = np.concatenate([one, one + 10])
    trace = Trace(
        "synthetic-test", TRACE_LAYERS, TRACE_EXPERTS, TRACE_K, np.repeat([0, 1], 15).astype(np.int32),
        iters.astype(np.int32), (iters % 10 > 0).astype(np.int8), ids.astype(np.int16), probs,
    )  # fmt: skip
    save_trace(trace, path)
    return path


def _expected_top2(trace: Trace, row: int, layer: int) -> list[int]:
    """Written independently of fold_trace: trace layer layer % L, expert e counts for e % 8, two largest."""
    folded, source = np.zeros(8), layer % trace.num_layers
    for e, p in zip(trace.topk_ids[row, source], trace.topk_probs[row, source], strict=True):
        folded[e % 8] += p
    return sorted(np.argsort(-folded)[:2].tolist())


def test_forced_routing_gives_the_experts_the_folded_trace_top_k(tmp_path):
    from fmoe_local.architectures import architecture_for
    from fmoe_local.config import RuntimeConfig, Sampling
    from fmoe_local.runtime import Runtime

    trace = load_trace(_trace(tmp_path / "t.npz"))
    model_dir = build_synthetic(tmp_path / "m", TINY_MIXTRAL, 4, PROMPTS, dtype="float32")
    recorded = tmp_path / "rec.npz"
    config = RuntimeConfig(device="cpu", cache_experts=4, policy="lru", record_trace=str(recorded))
    seen: list[tuple[int, np.ndarray]] = []  # (layer, top-k ids [T, K]) in call order
    with Runtime.load(model_dir, config) as runtime:
        model = runtime.engine.model
        refs = architecture_for(model.config).moe_layers(model)
        routing = ForcedRouting(fold_trace(trace, 4, 8, 2), [r.router for r in refs], "cpu").attach()
        for ref in refs:
            ref.experts.register_forward_pre_hook(
                lambda m, args, layer=ref.moe_index: seen.append((layer, args[1].numpy().copy()))
            )
        finals = []
        for i, prompt in enumerate(PROMPTS):
            routing.begin_request(i)
            finals.append(
                runtime.generate([{"role": "user", "content": prompt}], Sampling(greedy=True, max_new_tokens=5))
            )
    assert [f.stats.tokens for f in finals] == [5, 5]
    expected_rows: list[list[int]] = []
    for start, f in zip((0, 15), finals, strict=True):
        passes = [f.stats.prompt_tokens] + [1] * (f.stats.tokens - 1)
        offset = 0
        for n in passes:
            expected_rows.append(list(range(start + offset, start + offset + n)))
            offset += n
    assert len(seen) == 4 * len(expected_rows)
    for k, (layer, ids) in enumerate(seen):
        rows = [r % trace.num_rows for r in expected_rows[k // 4]]
        assert layer == k % 4
        assert [sorted(x) for x in ids.tolist()] == [_expected_top2(trace, r, layer) for r in rows]
    # The runtime's own observer (and so every policy) saw the forced distribution, not the random router's.
    rec = load_trace(recorded)
    folded = fold_trace(trace, 4, 8, 2)
    every_row = [r % trace.num_rows for rows in expected_rows for r in rows]
    np.testing.assert_allclose(
        rec.probs, folded.probs[every_row] / folded.probs[every_row].sum(-1, keepdims=True), atol=1e-5
    )


@pytest.mark.parametrize("shapes", [TINY_MIXTRAL, TINY_QWEN3], ids=["mixtral", "qwen3_moe"])
def test_synthetic_benchmark_at_tiny_scale_accesses_what_the_trace_routes(tmp_path, shapes):
    trace_path = _trace(tmp_path / "t.npz")
    trace = load_trace(trace_path)
    settings = live.LiveSettings(policies=("lru",), cache_experts=5, max_new_tokens=4, device="cpu")
    result = live.run_synthetic(shapes, 4, trace_path, PROMPTS, settings, log=lambda s: None)
    assert "e mod 8" in result["config"]["mapping"] and result["lossless"] is True
    lru, resident = result["rows"]
    assert lru["policy"] == "lru" and resident["policy"] == live.RESIDENT and lru["misses"] > 0
    expected = np.zeros((4, 8), int)
    for start, prompt_tokens, tokens in zip((0, 15), lru["prompt_tokens"], lru["token_ids"], strict=True):
        offset = 0
        for n in [prompt_tokens] + [1] * (len(tokens) - 1):
            rows = [(start + offset + t) % trace.num_rows for t in range(n)]
            for layer in range(4):
                for e in {e for r in rows for e in _expected_top2(trace, r, layer)}:
                    expected[layer, e] += 1
            offset += n
    assert lru["expert_accesses"] == expected.tolist() == resident["expert_accesses"]
