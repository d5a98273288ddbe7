"""`fmoe-local bench live` through the CLI on a tiny model: rows, cold caches, the baseline, the lossless check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from app import main
from fmoe_bench import live

PROMPTS = ["Write a short poem about the sea.", "Explain how a router picks two experts for every token."]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_live_cli_runs_every_policy_and_the_baseline_on_the_same_tokens(tiny_model_dir, tmp_path):
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "source": "test"} for p in PROMPTS])
    out = tmp_path / "live.json"
    args = ["bench", "live", "--model", str(tiny_model_dir("mixtral")), "--policies", "fmoe,lru", "--prompts"]
    args += [str(prompts), "--requests", "2", "--max-new-tokens", "4", "--device", "cpu", "--cache-experts", "6"]
    args += ["--miss-handling", "copy,cpu"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["label"]: r for r in result["rows"]}
    assert list(rows) == ["fmoe+copy", "fmoe+cpu", "lru+copy", "lru+cpu", live.RESIDENT]
    assert result["config"]["cache_experts"] == 6 and result["config"]["device_name"].startswith("CPU")
    for name in ("fmoe+copy", "lru+copy", "fmoe+cpu", "lru+cpu"):
        r = rows[name]
        assert r["cache_experts"] == 6 and r["requests"] == 2
        assert r["hits"] + r["misses"] > 0 and r["misses"] > 0
        assert r["ttft_s"] > 0 and r["tpot_s"] > 0
        assert r["tpot_vs_resident"] == pytest.approx(r["tpot_s"] / rows[live.RESIDENT]["tpot_s"])
        # copy loads every miss; cpu computes every miss on the host and loads nothing for it
        assert r["on_host"] == (r["misses"] if name.endswith("cpu") else 0)
    assert rows["lru+copy"]["bytes_moved"] > 0 and rows["lru+cpu"]["bytes_moved"] == 0  # lru never prefetches
    # lru never prefetches: on a cold cache every expert it touches must have been loaded by a miss at least once.
    # (fmoe ran first, so a cache left warm by it would fail this.)
    assert rows["lru+copy"]["misses"] >= np.count_nonzero(rows["lru+copy"]["expert_accesses"])
    resident = rows[live.RESIDENT]
    assert resident["cache_experts"] == 4 * 8 and resident["hit_rate"] == 1.0 and resident["bytes_moved"] == 0
    tokens = [r["token_ids"] for r in rows.values()]
    assert all(t == tokens[0] for t in tokens) and all(0 < len(seq) <= 4 for seq in tokens[0])
    assert result["lossless"] is True


def test_lossless_check_names_the_policy_and_request_that_differ():
    a = live.PolicyRow("lru", 4, requests=2, token_ids=[[1, 2], [3, 4]])
    b = live.PolicyRow("fmoe", 4, requests=2, token_ids=[[1, 2], [3, 5]])
    ok, line = live.lossless_check([a, b])
    assert not ok and "NOT LOSSLESS" in line and "fmoe+copy (requests 1)" in line
    assert live.lossless_check([a, live.PolicyRow("lfu", 4, token_ids=[[1, 2], [3, 4]])])[0]


def test_missing_prompts_file_is_one_sentence(tiny_model_dir, tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    rc = main(["bench", "live", "--model", str(tiny_model_dir("mixtral")), "--prompts", str(missing)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and str(missing) in err and "--prompts" in err
    assert len(err.splitlines()) == 1 and err.endswith(".") and err.count(". ") == 0


def test_live_needs_exactly_one_of_model_and_synthetic(capsys):
    assert main(["bench", "live"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--model" in err and "--synthetic" in err


def test_on_a_gpu_runs_with_cpu_computed_misses_are_counted_not_failed():
    # Measured on an H100: the CPU's bf16 kernels round differently from the GPU's, so a greedy near tie can go the
    # other way; only runs computed wholly on the GPU must match all-resident token for token.
    resident = live.PolicyRow(live.RESIDENT, 8, requests=2, token_ids=[[1, 2], [3, 4]])
    hybrid = live.PolicyRow("fmoe", 4, "auto", requests=2, on_host=5, token_ids=[[1, 2], [3, 5]])
    copied = live.PolicyRow("lru", 4, "copy", requests=2, token_ids=[[1, 2], [3, 4]])
    ok, line = live.lossless_check([hybrid, copied, resident], "cuda")
    assert ok and "1 of 2 replies identical" in line and "NOT LOSSLESS" not in line
    ok, line = live.lossless_check([hybrid, copied, resident], "cpu")  # on the CPU the same kernels run: exact
    assert not ok and "fmoe+auto (requests 1)" in line
    broken = live.PolicyRow("lru", 4, "copy", requests=2, token_ids=[[1, 2], [9, 4]])
    ok, line = live.lossless_check([hybrid, broken, resident], "cuda")
    assert not ok and "lru+copy (requests 1)" in line and "1 of 2 replies identical" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_device_cuda_without_cuda_is_one_sentence_before_any_work(capsys):
    # Before: a synthetic model was built, then "AssertionError: Torch not compiled with CUDA enabled" (issue 30).
    assert main(["bench", "live", "--synthetic", "mixtral-8x7b", "--layers", "1", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No CUDA GPU is available here" in err and "cpu" in err
