"""The shipped demo model and the demo package: loading, size, MoE family, English output; corpus and analysis helpers."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fmoe_bench.demo.analysis import Recording, record_request, topic_report, write_trace
from fmoe_bench.demo.data import CHAT_TEMPLATE, is_heldout, iter_sharegpt_raw, render_chat
from fmoe_bench.demo.train import TrainBudget, build_tokenizer, lr_at, train_lm
from fmoe_local.demo import demo_model_dir
from tests.shared_data import SHARED_DATA

PROMPTS_DIR = SHARED_DATA / "prompts"
SUPPORTED_FAMILIES = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "deepseek_v2", "deepseek_v3", "gpt_oss"}


@pytest.fixture(scope="module")
def demo():
    model_dir = demo_model_dir()
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, tokenizer


def test_shipped_checkpoint_is_small_safetensors():
    weights = demo_model_dir() / "model.safetensors"
    assert weights.stat().st_size <= 25 * 1024 * 1024
    for name in ("config.json", "generation_config.json", "tokenizer.json", "TRAINING.md"):
        assert (demo_model_dir() / name).is_file(), name


def test_demo_is_a_supported_moe(demo):
    model, tokenizer = demo
    cfg = model.config
    assert cfg.model_type in SUPPORTED_FAMILIES
    assert cfg.num_experts > 1 and cfg.num_experts_per_tok < cfg.num_experts
    raw = json.loads((demo_model_dir() / "config.json").read_text())
    assert raw["dtype"] in ("float16", "bfloat16")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    gen = json.loads((demo_model_dir() / "generation_config.json").read_text())
    assert tokenizer.eos_token_id in gen["eos_token_id"]


def _reference_words() -> set[str]:
    """Words from text the model never saw: Dolly/CodeAlpaca prompts and the Alpaca seed tasks with their outputs."""
    text = (PROMPTS_DIR / "dolly300-codealpaca200.jsonl").read_text(encoding="utf-8")
    text += (PROMPTS_DIR / "alpaca-seed-tasks-175.jsonl").read_text(encoding="utf-8")
    return {w.lower() for w in re.findall(r"[A-Za-z]+", text)}


@pytest.mark.skipif(not PROMPTS_DIR.is_dir(), reason="needs data/prompts for the reference word list")
def test_greedy_answer_is_mostly_english_words(demo):
    model, tokenizer = demo
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the ocean."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", answer)]
    assert len(words) >= 8, answer
    vocab = _reference_words()
    known = sum(w in vocab for w in words)
    assert known / len(words) >= 0.6, answer
    assert len(set(words)) >= 4, f"degenerate repetition: {answer!r}"


def test_chat_template_renders_like_the_training_text(demo):
    _, tokenizer = demo
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == render_chat(messages)
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == render_chat(messages[:1]) + "<|im_start|>assistant\n"


def test_routing_is_not_collapsed(demo):
    """The load-balancing loss worked: over varied text every layer spreads its top-k picks over most experts."""
    model, tokenizer = demo
    text = render_chat(
        [
            {"role": "user", "content": "Write a short poem about autumn leaves and the wind."},
            {"role": "assistant", "content": "Golden leaves drift down, the wind sings softly through bare trees."},
            {"role": "user", "content": "Now write a Python function that returns the sum of a list of numbers."},
            {"role": "assistant", "content": "def total(numbers):\n    return sum(numbers)"},
        ]
    )
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    k, num_experts = model.config.num_experts_per_tok, model.config.num_experts
    for logits in out.router_logits:  # each [T, J]
        counts = torch.bincount(logits.topk(k, dim=-1).indices.flatten(), minlength=num_experts)
        assert (counts > 0).sum() >= num_experts // 2, counts.tolist()
        assert counts.max() / counts.sum() < 0.5, counts.tolist()


def test_sharegpt_reader_stops_at_the_cut(tmp_path):
    whole = [{"id": "a", "conversations": [{"from": "human", "value": "x, [y] {z}"}]}, {"id": "b", "conversations": []}]
    text = json.dumps(whole, indent=2)
    cut = text[: text.rindex('"b"') + 8]  # second object never closes
    path = tmp_path / "cut.json"
    path.write_text(cut)
    assert [o["id"] for o in iter_sharegpt_raw(path, chunk_chars=7)] == ["a"]
    path.write_text(text)
    assert [o["id"] for o in iter_sharegpt_raw(path, chunk_chars=5)] == ["a", "b"]


def test_heldout_split_is_deterministic_and_sized():
    ids = [f"conv{i}" for i in range(4000)]
    first = [is_heldout(i, 0.1) for i in ids]
    assert first == [is_heldout(i, 0.1) for i in ids]
    assert 0.07 < sum(first) / len(ids) < 0.13


def test_build_tokenizer_roundtrips_and_has_chat_template():
    texts = [
        render_chat([("user", f"question number {i} about oceans"), ("assistant", "answer café")]) for i in range(50)
    ]
    tok = build_tokenizer(texts, vocab_size=300)
    assert tok.chat_template == CHAT_TEMPLATE
    ids = tok(texts[0], add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == texts[0]
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids


def test_lr_schedule_warms_up_then_decays():
    assert lr_at(0.0, 1.0, 0.1) == 0.0
    assert lr_at(0.1, 1.0, 0.1) == pytest.approx(1.0)
    assert lr_at(1.0, 1.0, 0.1) == pytest.approx(0.1)
    assert lr_at(0.5, 1.0, 0.1) < lr_at(0.3, 1.0, 0.1)


def test_train_lm_lowers_the_loss_and_reports_every_step():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config)
    stream = np.tile(np.arange(8, dtype=np.uint16), 64)  # a cycle: learnable in a few steps
    rows: list[tuple[int, dict]] = []
    budget = TrainBudget(steps=30, batch=4, seq_len=16, lr=1e-2, warmup=0.1)
    last, tokens = train_lm(model, stream, budget, 4, 2, lambda step, row: rows.append((step, row)))
    assert (last, tokens) == (30, 30 * 4 * 16)
    assert [s for s, _ in rows] == list(range(1, 31))
    assert rows[-1][1]["loss"] < 0.5 * rows[0][1]["loss"]
    assert all(r["aux_loss"] > 0 for _, r in rows)
    with pytest.raises(ValueError, match="shorter than one window"):
        train_lm(model, stream[:10], budget, 4, 2)


def test_topic_report_separates_distinct_routing():
    rng = np.random.default_rng(0)
    rec = Recording()
    for s in range(12):
        topic = "code" if s % 2 else "prose"
        favoured = 0 if topic == "code" else 5
        for _ in range(5):
            logits = rng.normal(size=(3, 8))
            logits[:, favoured] += 3.0
            p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
            rec.probs.append(p)
            rec.seq_ids.append(s)
        rec.seq_labels.append(topic)
    report = topic_report(rec)
    assert report["nearest_centroid_accuracy"] == 1.0
    between = report["between_topic_cosine_distance"]["code vs prose"]
    assert between > max(report["within_topic_mean_cosine_distance_to_centroid"].values())


def test_recorded_trace_follows_the_trace_format(demo, tmp_path):
    model, tokenizer = demo
    rec = Recording()
    record_request(model, tokenizer, "Hello", new_tokens=3, max_prompt_tokens=64, rec=rec, label="prose")
    record_request(model, tokenizer, "def f(x): return x", new_tokens=2, max_prompt_tokens=64, rec=rec, label="code")
    path = tmp_path / "t.npz"
    write_trace(path, rec, "demo", top_k=model.config.num_experts_per_tok)
    d = np.load(path)
    L, J = model.config.num_hidden_layers, model.config.num_experts
    T = len(d["seq_ids"])
    assert d["probs"].shape == (T, L, J) and d["topk_ids"].shape == (T, L, 2)
    assert np.allclose(d["probs"].sum(-1), 1.0, atol=1e-4)
    assert list(np.unique(d["seq_ids"])) == [0, 1]
    prefill = d["phase"] == 0
    # a prefill is one iteration; each decode row is its own iteration, after it
    assert len(np.unique(d["iter_ids"][prefill & (d["seq_ids"] == 0)])) == 1
    decode_iters = d["iter_ids"][~prefill]
    assert len(np.unique(decode_iters)) == len(decode_iters)
    assert np.all(np.diff(d["iter_ids"]) >= 0)
    assert (d["topk_probs"][..., 0] >= d["topk_probs"][..., 1]).all()
