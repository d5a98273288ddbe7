"""`fmoe-local run`: the JSON contract (last stdout line), trace recording, and plain-language errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.runtime import Runtime
from fmoe_local.traces import load_trace


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fmoe_local.cli", "run", *args], capture_output=True, text=True, timeout=300
    )


def test_run_json_last_line_matches_the_runtime(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen3_moe")
    trace = tmp_path / "run.npz"
    proc = run_cli(
        "--model", str(model_dir), "--prompt", "Tell me about the ocean.", "--greedy", "--max-new-tokens", "6",
        "--cache-experts", "3", "--device", "cpu", "--json", "--record-trace", str(trace),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"text", "token_ids", "stats"}
    stats = result["stats"]
    for key in ("ttft_s", "tpot_s", "tokens", "hit_rate", "hits", "misses", "prefetched", "prefetch_wasted",
                "bytes_moved", "stall_s", "per_layer_hit_rate"):  # fmt: skip
        assert key in stats, key
    assert stats["hits"] + stats["misses"] > 0

    config = RuntimeConfig(device="cpu", cache_experts=3, sampling=Sampling(greedy=True, max_new_tokens=6))
    with Runtime.load(model_dir, config) as runtime:
        final = runtime.generate([{"role": "user", "content": "Tell me about the ocean."}])
        shape = runtime.engine.shape
    assert result["token_ids"] == final.token_ids
    assert result["text"] == final.text

    recorded = load_trace(trace)
    assert (recorded.num_layers, recorded.num_experts, recorded.top_k) == (
        shape.num_layers,
        shape.num_experts,
        shape.top_k,
    )
    # One row per token the model read: the prompt, then every generated token but the last.
    assert recorded.num_rows == stats["prompt_tokens"] + stats["tokens"] - 1
    assert recorded.probs is not None and np.allclose(recorded.probs.sum(-1), 1.0, atol=1e-4)
    assert recorded.embeddings is not None and recorded.embeddings.shape[1] == shape.embed_dim


def test_run_without_a_model_folder_says_what_to_do(tmp_path):
    proc = run_cli("--model", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert proc.returncode == 2
    assert "config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_run_dense_model_names_the_supported_families(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny import train_tokenizer

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=400)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    train_tokenizer(tmp_path)
    proc = run_cli("--model", str(tmp_path), "--prompt", "hi")
    assert proc.returncode == 2
    assert "mixtral" in proc.stderr.lower() and "Traceback" not in proc.stderr


def test_run_with_an_unknown_miss_handling_names_the_choices(tiny_model_dir):
    proc = run_cli("--model", str(tiny_model_dir("mixtral")), "--prompt", "hi", "--miss-handling", "gpu")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "Unknown miss handling 'gpu'" in proc.stderr and "auto" in proc.stderr and "cpu" in proc.stderr


def test_run_with_an_unknown_expert_format_names_the_choices(tiny_model_dir):
    proc = run_cli("--model", str(tiny_model_dir("mixtral")), "--prompt", "hi", "--expert-format", "q3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "Unknown expert format 'q3'" in proc.stderr and "nf4" in proc.stderr and "int8" in proc.stderr


def test_run_takes_auto_as_the_prefetch_distance() -> None:
    from fmoe_local.cli import build_parser, config_from_args

    auto = config_from_args(build_parser().parse_args(["run", "--prompt", "hi", "--prefetch-distance", "auto"]))
    assert auto.prefetch_distance_auto and auto.prefetch_distance == RuntimeConfig.prefetch_distance
    fixed = config_from_args(build_parser().parse_args(["run", "--prompt", "hi", "--prefetch-distance", "5"]))
    assert not fixed.prefetch_distance_auto and fixed.prefetch_distance == 5
