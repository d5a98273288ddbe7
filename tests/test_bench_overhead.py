"""`fmoe-local bench overhead`: the sub-command runs the measurement and prints its table; bad folders are sentences."""

from __future__ import annotations

import subprocess
import sys

from app import main


def test_overhead_subcommand_prints_one_row_with_every_expert_resident(tiny_model_dir, capsys):
    model = tiny_model_dir("mixtral")
    assert main(["bench", "overhead", "--model", str(model), "--tokens", "3", "--repeats", "1"]) == 0
    header, row = capsys.readouterr().out.strip().splitlines()[-2:]
    assert header.split()[:2] == ["model", "policy"]
    name, policy, tokens, plain_s, ours_s, ratio, hit_rate = row.split()
    assert (name, policy) == (model.name, "fmoe") and 1 <= int(tokens) <= 3
    assert float(plain_s) > 0 and float(ours_s) > 0 and float(ratio) > 0
    # The timed runs follow a warm-up with the same prompt: every expert they use is already resident.
    assert hit_rate == "100.0%"


def test_overhead_missing_model_is_one_sentence(tmp_path, capsys):
    assert main(["bench", "overhead", "--model", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--model" in err and err.endswith(".")


def test_overhead_module_stays_runnable_on_its_own():
    done = subprocess.run(
        [sys.executable, "-m", "fmoe_bench.overhead", "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and "--repeats" in done.stdout and "--model" in done.stdout
