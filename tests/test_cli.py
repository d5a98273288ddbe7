"""`fmoe-local run`: the JSON contract (last stdout line), trace recording, and plain-language errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

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


def refused(capsys, *args: str) -> str:
    """`fmoe-local run ARGS` in this process (a subprocess costs seconds of imports each; the entry point itself is
    run as one in the JSON test above): exit code 2, and what it said on stderr, with no traceback escaping."""
    from fmoe_local.cli import main

    try:
        code = main(["run", *args])
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    assert code == 2
    return capsys.readouterr().err


def test_run_without_a_model_folder_says_what_to_do(tmp_path, capsys):
    err = refused(capsys, "--model", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert "config.json" in err and "Traceback" not in err


def test_run_dense_model_names_the_supported_families(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny import train_tokenizer

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=400)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    train_tokenizer(tmp_path)
    err = refused(capsys, "--model", str(tmp_path), "--prompt", "hi")
    assert "mixtral" in err.lower() and "Traceback" not in err


def test_run_with_an_unknown_miss_handling_names_the_choices(tiny_model_dir, capsys):
    err = refused(capsys, "--model", str(tiny_model_dir("mixtral")), "--prompt", "hi", "--miss-handling", "gpu")
    assert "Traceback" not in err
    assert "Unknown miss handling 'gpu'" in err and "auto" in err and "cpu" in err


def test_run_with_an_unknown_expert_format_names_the_choices(tiny_model_dir, capsys):
    err = refused(capsys, "--model", str(tiny_model_dir("mixtral")), "--prompt", "hi", "--expert-format", "q3")
    assert "Traceback" not in err
    assert "Unknown expert format 'q3'" in err and "nf4" in err and "int8" in err


def test_run_with_an_unknown_dense_format_names_the_choices(tiny_model_dir, capsys):
    err = refused(capsys, "--model", str(tiny_model_dir("mixtral")), "--prompt", "hi", "--dense-format", "q3")
    assert "Traceback" not in err
    assert "Unknown dense format 'q3'" in err and "int4" in err and "bf16" in err


def test_run_passes_the_dense_format_on() -> None:
    from fmoe_local.cli import build_parser, config_from_args

    args = build_parser().parse_args(["run", "--prompt", "hi", "--dense-format", "int4"])
    assert config_from_args(args).dense_format == "int4"
    assert config_from_args(build_parser().parse_args(["run", "--prompt", "hi"])).dense_format == "auto"


def test_run_takes_auto_as_the_prefetch_distance() -> None:
    from fmoe_local.cli import build_parser, config_from_args

    auto = config_from_args(build_parser().parse_args(["run", "--prompt", "hi", "--prefetch-distance", "auto"]))
    assert auto.prefetch_distance_auto and auto.prefetch_distance == RuntimeConfig.prefetch_distance
    fixed = config_from_args(build_parser().parse_args(["run", "--prompt", "hi", "--prefetch-distance", "5"]))
    assert not fixed.prefetch_distance_auto and fixed.prefetch_distance == 5


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--temperature", "nan"], "--temperature: give a finite number of at least 0 (got 'nan')"),
        (["--temperature", "inf"], "--temperature: give a finite number of at least 0 (got 'inf')"),
        (["--temperature", "-0.5"], "--temperature: give a number of at least 0 (got -0.5)"),
        (["--top-p", "nan"], "--top-p: give a finite number from 0 to 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens: give a whole number of at least 1 (got 0)"),
        (["--cache-gb", "nan"], "--cache-gb: give a finite number above 0"),
        (["--cache-gb", "inf"], "--cache-gb: give a finite number above 0"),
        (["--cache-experts", "-1"], "--cache-experts: give a whole number of at least 1"),
        (["--store-capacity", "0"], "--store-capacity: give a whole number of at least 1"),
        (["--seed", str(2**80)], "--seed: give a whole number from 0 to 18446744073709551615"),
        (["--prefetch-distance", "0"], "--prefetch-distance: give d as a whole number of layers, 1 or more"),
        (["--prompt", ""], "--prompt: give some text; it was empty"),
        (["--prompt", " \n\t"], "--prompt: give some text; it was empty"),
    ],
)
def test_an_impossible_run_flag_is_one_line_and_exit_code_2(flags, said, capsys):
    """Before: --temperature nan and --seed 2**80 ended in a torch traceback mid-request, --prompt "" generated,
    --cache-gb inf was an OverflowError traceback, --cache-gb nan "cannot convert float NaN to integer"."""
    from fmoe_local.cli import main

    with pytest.raises(SystemExit) as refused:
        main(["run", "--prompt", "hi", *flags])
    err = capsys.readouterr().err
    assert refused.value.code == 2
    assert said in err and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("fmoe-local run: ") and "See `fmoe-local run --help`." in err


def test_run_refuses_a_prefetch_distance_beyond_the_model_s_layers(tiny_model_dir, capsys):
    """Before: run --prefetch-distance 99 on a 4-layer model ran silently with an expert hit rate of 0 %."""
    from fmoe_local.cli import fit_distance, main

    model = str(tiny_model_dir("mixtral"))  # 4 MoE layers
    assert main(["run", "--model", model, "--prompt", "hi", "--prefetch-distance", "99", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "This model has 4 MoE layers: the prefetch distance can be 1 to 3. Give --prefetch-distance 3" in err
    assert err.count("\n") == 1
    # Not asked for, the default (or auto's start) is cut to a shallow model's last layer, as the app does.
    assert fit_distance(RuntimeConfig(), None, 2).prefetch_distance == 1
    assert fit_distance(RuntimeConfig(), "auto", 3).prefetch_distance == 2
    assert fit_distance(RuntimeConfig(), 3, 4).prefetch_distance == 3


def _copy_model(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_run_on_a_damaged_checkpoint_says_the_app_s_sentence(tiny_model_dir, tmp_path, capsys):
    """Before: a truncated safetensors file or a config.json cut short was a traceback (DamagedFile, OSError,
    StrictDataclassFieldValidationError); the app's Models tab gave sentences for both."""
    from fmoe_local.cli import main
    from ui.load_job import shape_of

    source = tiny_model_dir("mixtral")
    cut = _copy_model(source, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    broken = _copy_model(source, tmp_path / "broken")
    (broken / "config.json").write_text('{"model_type": "mixtral", "num_hid')
    wrong = _copy_model(source, tmp_path / "wrong")
    (wrong / "config.json").write_text('{"model_type": "mixtral", "num_hidden_layers": "four"}')
    for model, said in (
        (cut, "Could not load cut: The model file model.safetensors is damaged (it ends before tensor"),
        (broken, "Could not load broken: The config.json of broken cannot be read (it is not valid JSON"),
        (wrong, "Could not load wrong: The config.json of wrong cannot be read (Validation error for field"),
    ):
        argv = ["run", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"]
        assert main(argv) == 2, model
        err = capsys.readouterr().err
        assert said in err and "Download the model again" in err and "Traceback" not in err
        assert err.count("\n") == 1
    for model in (broken, wrong):  # the app's Models tab reads config.json through the same function
        with pytest.raises(ValueError, match=f"The config.json of {model.name} cannot be read"):
            shape_of(model)
