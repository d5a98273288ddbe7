"""`bench quality --families`: a tiny model trained briefly, then scored per expert format through the runtime.

The unquantised row must be transformers eager's loss on the saved weights, and each quantised row eager's loss on
the same weights dequantised (`unpack(pack(row))`): the rows then differ only as quantisation implies.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fmoe_bench import cli as bench_cli
from fmoe_bench.demo.train import TrainBudget
from fmoe_bench.quality import held_windows
from fmoe_bench.quality_families import format_table, measure_families, split_texts, training_line
from tests.test_runtime_quantized import dequantise_experts

WORDS = "sea wave tide ocean fish boat sail wind storm shore sand rock cliff light moon star night day".split()
TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12 + i % 9)) + f" number {i}." for i in range(80)]
SEQ_LEN, WINDOWS = 16, 3


@torch.no_grad()
def eager_loss(model_dir, fmt: str) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32).eval()
    if fmt != "bf16":
        dequantise_experts(model, fmt)
    rows = held_windows(AutoTokenizer.from_pretrained(model_dir), split_texts(TEXTS)[1], SEQ_LEN, WINDOWS)
    total = 0.0
    for row in rows:
        x = torch.tensor([row])
        logits = model(input_ids=x[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
    return total / (SEQ_LEN * len(rows))


def test_a_trained_tiny_family_scores_like_eager_on_the_weights_each_format_stores(tmp_path):
    budget = TrainBudget(steps=4, batch=2, seq_len=32, lr=1e-2)
    seen = []
    trained, rows = measure_families(
        ["mixtral"], ["bf16", "int8", "nf4"], TEXTS, budget, SEQ_LEN, WINDOWS, "cpu", tmp_path, on_trained=seen.append
    )
    assert seen == trained and [(t.family, t.steps, t.tokens) for t in trained] == [("mixtral", 4, 4 * 2 * 32)]
    assert json.loads((tmp_path / "mixtral" / "config.json").read_text())["model_type"] == "mixtral"
    assert [(r["model"], r["format"], r["tokens"]) for r in rows] == [
        ("mixtral", f, SEQ_LEN * WINDOWS) for f in ("bf16", "int8", "nf4")
    ]
    for r in rows:  # the runtime's forward pass is eager's on the weights the format stores
        assert r["loss"] == pytest.approx(eager_loss(trained[0].model_dir, r["format"]), abs=1e-6), r["format"]
        assert r["rel_ppl"] == pytest.approx(math.exp(r["loss"] - rows[0]["loss"]) - 1, abs=1e-9)
    assert abs(rows[2]["loss"] - rows[0]["loss"]) > 1e-4  # nf4 really changed the weights, beyond the tolerance
    # Zeroing every routed expert moves the loss far more than quantising them, and is reported once per model.
    assert abs(rows[0]["loss_without_experts"] - rows[0]["loss"]) > 10 * abs(rows[2]["loss"] - rows[0]["loss"])
    assert len({r["loss_without_experts"] for r in rows}) == 1
    assert rows[2]["expert_bytes"] < rows[1]["expert_bytes"] < rows[0]["expert_bytes"]
    table = format_table(rows).splitlines()
    assert table[2].startswith("| mixtral | unquantised (float32) |")
    assert table[2].endswith(f"| — | {rows[0]['loss_without_experts']:.4f} |")
    assert table[4].startswith("| mixtral | nf4 |") and table[4].endswith(" % | — |")
    assert training_line(trained[0]).startswith("- mixtral: 4 steps, 256 tokens, train loss ")


def test_the_text_splits_by_content_and_bad_flags_are_refused_with_a_sentence(tmp_path):
    train, held = split_texts(TEXTS)
    assert train and held and not set(train) & set(held) and split_texts(list(reversed(TEXTS)))[1] == held[::-1]
    text = tmp_path / "held.json"
    text.write_text(json.dumps(TEXTS))
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(ValueError, match="Unknown family llama. Choose from: mixtral"):
        bench_cli.run(parser.parse_args(["bench", "quality", "--families", "llama", "--text", str(text)]))
    with pytest.raises(ValueError, match="leave out --model"):
        bench_cli.run(parser.parse_args(["bench", "quality", "--families", "all", "--model", str(tmp_path)]))
    with pytest.raises(SystemExit):  # refused while parsing (cli_args.py), before anything trains
        parser.parse_args(["bench", "quality", "--families", "all", "--train-steps", "0", "--text", str(text)])
