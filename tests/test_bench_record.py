import json
from pathlib import Path

import pytest

from fmoe_bench import cli
from fmoe_local.traces import load_trace


def test_record_writes_the_models_routing_per_prompt(tiny_model_dir, tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Tell me about the sea.", "Write a poem about rain.", "What is a cat?"]))
    out = tmp_path / "tiny.npz"
    out.write_bytes(b"an older recording")  # replaced, never appended to
    argv = ["record", str(out), "--model", str(tiny_model_dir("mixtral")), "--prompts", str(prompts)]
    assert cli.main([*argv, "--requests", "3", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    trace = load_trace(out)
    assert len(trace.requests()) == 3 and (trace.num_layers, trace.num_experts, trace.top_k) == (4, 8, 2)
    assert trace.embeddings is not None and trace.embeddings.shape[0] == trace.num_rows
    out, err = capsys.readouterr()
    assert f"3 requests, {trace.num_rows} rows" in out
    assert err.rstrip().endswith("3 of 3 prompts recorded")  # progress on stderr while it records


def test_record_refuses_a_file_that_is_not_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["record", str(tmp_path / "trace.json")]) == 2
    assert "Name the trace file with .npz" in capsys.readouterr().err
