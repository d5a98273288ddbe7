"""`bench prefix`: the table of TTFT with and without prefix reuse, on a tiny model with small settings."""

from __future__ import annotations

import json

from fmoe_bench.cli import main
from fmoe_bench.prefix import CONTEXT, with_context


def test_the_table_times_a_chat_and_a_shared_system_prompt(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = ["prefix", "--model", str(tiny_model_dir("qwen3_moe")), "--families", "none", "--turns", "2"]
    args += ["--repeats", "1", "--reply-tokens", "3", "--system-tokens", "60", "--requests", "3", "--json", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "chat turn 2" in table and "system 60, requests 2-3" in table
    rows = {r["case"]: r for r in json.loads(out.read_text())}
    assert rows["chat turn 1"]["reused"] == 0
    assert rows["chat turn 2"]["reused"] > 0
    later = rows["system 60, requests 2-3"]
    assert later["reused"] >= 60  # the whole system prompt came from the first request's cache
    assert later["fresh_tokens"] < later["prompt_tokens"] - 50  # the fresh prompt holds only what was prefilled
    assert all(r["ttft_reuse_ms"] > 0 and r["ttft_whole_ms"] > 0 and r["ttft_fresh_ms"] > 0 for r in rows.values())


def test_an_unknown_family_is_refused_in_a_sentence(tiny_model_dir, capsys):
    assert main(["prefix", "--model", str(tiny_model_dir("qwen3_moe")), "--families", "llama"]) == 2
    assert "Unknown family llama. Choose from mixtral" in capsys.readouterr().err


def test_the_copy_reads_a_longer_context(tiny_model_dir, tmp_path):
    copy = with_context(tiny_model_dir("mixtral"), tmp_path / "copy")
    assert json.loads((copy / "config.json").read_text())["max_position_embeddings"] == CONTEXT
    assert json.loads((tiny_model_dir("mixtral") / "config.json").read_text())["max_position_embeddings"] == 512
