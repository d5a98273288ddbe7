"""`bench prefix`: the table of TTFT with and without prefix reuse, on a tiny model with small settings."""

from __future__ import annotations

import json

from fmoe_bench.cli import main
from fmoe_bench.prefix import CONTEXT, with_context
from fmoe_local.runtime import Runtime


def test_the_table_times_a_chat_and_a_shared_system_prompt(tiny_model_dir, tmp_path, capsys, monkeypatch):
    asked = []  # which runtime each request went to, in order: "reuse" or "whole"
    generate = Runtime.generate

    def spy(self, prompt, sampling=None):  # noqa: ANN001, ANN202
        asked.append("reuse" if self._prefixes.enabled else "whole")
        return generate(self, prompt, sampling)

    monkeypatch.setattr(Runtime, "generate", spy)
    out = tmp_path / "rows.json"
    args = ["prefix", "--model", str(tiny_model_dir("qwen3_moe")), "--families", "none", "--turns", "2"]
    args += ["--repeats", "3", "--reply-tokens", "3", "--system-tokens", "60", "--requests", "4", "--json", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "chat turn 2" in table and "system 60, requests 2-4" in table and "of min" in table
    rows = {r["case"]: r for r in json.loads(out.read_text())}
    assert rows["chat turn 1"]["reused"] == 0
    assert rows["chat turn 2"]["reused"] > 0 and rows["chat turn 2"]["pairs"] == 3
    later = rows["system 60, requests 2-4"]
    assert later["reused"] >= 60 and later["pairs"] == 3  # the whole system prompt came from the first request
    assert later["fresh_tokens"] < later["prompt_tokens"] - 50  # the fresh prompt holds only what was prefilled
    for r in rows.values():
        assert 0 < r["reuse_min_ms"] <= r["ttft_reuse_ms"] and 0 < r["fresh_min_ms"] <= r["ttft_fresh_ms"]
        assert r["ttft_whole_ms"] > 0
        assert r["ratio"] == r["ttft_reuse_ms"] / r["ttft_fresh_ms"]
        assert r["ratio_of_mins"] == r["reuse_min_ms"] / r["fresh_min_ms"]
    # Interleaved: the system prompt's requests 2-4 (after the first, which prefills it) each followed at once by
    # its fresh prompt; then the whole prompt's runs.
    system = asked[-(1 + 2 * 3 + 3) :]
    assert system == ["reuse"] + ["reuse", "whole"] * 3 + ["whole"] * 3
    # The chat (turns 1 and 2 measured, 3 pairs each): the warm-ups; the conversation, each turn paired; then turn 1
    # twice more (nothing to reuse), turn 2 twice more after turn 1 asked again, each turn's whole prompt 3 times.
    r, w = "reuse", "whole"
    assert asked[: -len(system)] == [r, w] + [r, w, r, w] + [r, w] * 2 + [w] * 3 + [r, r, w] * 2 + [w] * 3


def test_an_unknown_family_is_refused_in_a_sentence(tiny_model_dir, capsys):
    assert main(["prefix", "--model", str(tiny_model_dir("qwen3_moe")), "--families", "llama"]) == 2
    assert "Unknown family llama. Choose from mixtral" in capsys.readouterr().err


def test_the_copy_reads_a_longer_context(tiny_model_dir, tmp_path):
    copy = with_context(tiny_model_dir("mixtral"), tmp_path / "copy")
    assert json.loads((copy / "config.json").read_text())["max_position_embeddings"] == CONTEXT
    assert json.loads((tiny_model_dir("mixtral") / "config.json").read_text())["max_position_embeddings"] == 512
