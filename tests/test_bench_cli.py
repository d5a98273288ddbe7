import json
from pathlib import Path

import pytest

from fmoe_bench import cli
from fmoe_local.traces import save_trace

from .test_oracle import synthetic_trace


def test_replay_command_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "syn.npz"
    save_trace(synthetic_trace(0, requests=4, length=8), trace)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["replay", str(trace), "--cache-experts", "8", "--prefetch-distance", "1", "--jobs", "1"]
    argv += ["--policies", "fmoe,lru,on_demand,oracle,speculative", "--mode", "online", "--layer-time-ms", "1"]
    argv += ["--json", str(out), "--plot", str(png), "--sweep", "prefetch-distance"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "needs hidden states (live only)" in printed and "fallback: request_map_mean" in printed
    data = json.loads(out.read_text())
    assert data["config"]["cache_experts"] == {"syn.npz": 8} and data["config"]["layer_time_s"] == 0.001
    rows = {r["policy"]: r for r in data["results"]}
    assert set(rows) == {"fmoe", "lru", "on_demand", "oracle", "speculative"}
    for key in ("trace", "policy", "hit_rate", "stall_s", "tpot_s", "speedup_vs_on_demand"):
        assert key in rows["lru"]
    assert rows["oracle"]["hit_rate"] >= rows["lru"]["hit_rate"]
    assert rows["on_demand"]["speedup_vs_on_demand"] == pytest.approx(1.0)
    assert rows["speculative"]["note"] and rows["speculative"]["hits"] == 0
    assert {r["cache_fraction"] for r in data["curve"]} == {0.1, 0.2, 0.3, 0.4, 0.5, 0.6}
    assert {r["prefetch_distance"] for r in data["sweep"] if r["policy"] == "fmoe"} == {1, 2, 3, 4, 5, 6}
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_replay_says_on_stderr_as_each_policy_run_finishes(tmp_path: Path, capsys, jobs: str) -> None:
    trace = tmp_path / "syn.npz"
    save_trace(synthetic_trace(0, requests=3, length=6), trace)
    argv = ["replay", str(trace), "--cache-experts", "8", "--prefetch-distance", "1", "--jobs", jobs]
    argv += ["--policies", "fmoe,lru,cpu_moe", "--miss-handling", "copy,cpu", "--layer-time-ms", "1"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0].endswith("syn.npz: replaying fmoe, lru, cpu_moe")
    runs = sorted(line.split("syn.npz: ")[1].split(" replayed")[0] for line in lines[1:])
    assert runs == ["cpu_moe/cpu", "fmoe/copy", "fmoe/cpu", "lru/copy", "lru/cpu"]  # cpu_moe once: it forces cpu
    assert all(line.startswith("[") and " s] " in line for line in lines) and lines[-1].endswith("(5/5)")
    assert "replayed" not in out  # the table on stdout stays as it was


def test_unknown_policy_is_a_sentence(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "syn.npz"
    save_trace(synthetic_trace(0, requests=2, length=2), trace)
    assert cli.main(["replay", str(trace), "--policies", "belady2"]) == 2
    assert "Unknown policy belady2" in capsys.readouterr().err


def test_bench_matcher_prints_every_search_of_a_pass(capsys) -> None:
    from app import main

    assert main(["bench", "matcher", "--maps", "64", "--layers", "3", "--experts", "8", "--embed-dim", "16"]) == 0
    out = capsys.readouterr().out
    for line in ("trajectory search", "semantic search", "storing the map", "all of it, per layer"):
        assert line in out


def test_replay_folds_traces(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "syn.npz"
    save_trace(synthetic_trace(0, requests=3, length=6), trace)
    out = tmp_path / "r.json"
    argv = ["replay", str(trace), "--cache-experts", "4", "--jobs", "1", "--policies", "fmoe,lru", "--mode", "online"]
    argv += ["--fold", "4x2", "--json", str(out)]
    assert cli.main(argv) == 0
    assert "folded to 4 experts, top-2" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["config"]["fold"] == "4x2" and {r["policy"] for r in data["results"]} == {"fmoe", "lru"}


def test_replay_of_a_part_with_the_first_requests(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "syn.npz"
    save_trace(synthetic_trace(0, requests=5, length=4), trace)
    out = tmp_path / "r.json"
    argv = ["replay", str(trace), "--cache-experts", "4", "--jobs", "1", "--policies", "fmoe,lru", "--mode", "online"]
    argv += ["--requests", "second-half", "--first-requests", "1,2,50,200", "--json", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "requests 2–4 of 5 (second-half)" in printed and "3 requests" in printed
    header = next(line for line in printed.splitlines() if line.startswith("policy+misses") and "first 1" in line)
    assert header.split()[1:] == ["first", "1", "first", "2", "all", "3"]  # 50 and 200 are past the end: once
    data = json.loads(out.read_text())
    assert data["config"]["requests"] == "second-half" and data["config"]["first_requests"] == [1, 2, 50, 200]
    for row in data["results"]:
        firsts = row["first_requests"]
        assert [f["requests"] for f in firsts] == [1, 2, 3, 3]
        assert firsts[-1]["hit_rate"] == pytest.approx(row["hit_rate"])  # all of them: the whole replay's rate
        assert firsts[0]["hit_rate"] == row["request_hits"][0] / row["request_accesses"][0]
    assert cli.main([*argv[:-2], "--requests", "9:"]) == 2
    assert "selects no request" in capsys.readouterr().err


def test_replay_after_learning_another_trace_measures_all_of_this_one(tmp_path: Path, capsys) -> None:
    learned, measured = tmp_path / "a.npz", tmp_path / "b.npz"
    save_trace(synthetic_trace(1, requests=4, length=4), learned)
    save_trace(synthetic_trace(2, requests=3, length=4), measured)
    out = tmp_path / "r.json"
    argv = [
        "replay",
        str(measured),
        "--cache-experts",
        "4",
        "--jobs",
        "1",
        "--policies",
        "fmoe,lru",
        "--mode",
        "online",
    ]
    argv += ["--learn-first", str(learned), "--json", str(out)]
    assert cli.main(argv) == 0
    assert "after all of synthetic" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["config"]["learn_first"] == str(learned)
    assert {r["requests_measured"] for r in data["results"]} == {3}
    assert {r["iterations_measured"] for r in data["results"]} == {3 * 4}
    assert cli.main([*argv, "--mode", "offline"]) == 2
    assert "use it with --mode online" in capsys.readouterr().err


def test_bad_fold_is_a_sentence(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "syn.npz"
    save_trace(synthetic_trace(0, requests=2, length=2), trace)
    assert cli.main(["replay", str(trace), "--fold", "eight"]) == 2
    assert "EXPERTSxTOPK" in capsys.readouterr().err


def test_replay_chooses_the_distance_from_the_costs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "syn.npz"
    save_trace(synthetic_trace(0, requests=3, length=6), trace)
    out = tmp_path / "r.json"
    argv = ["replay", str(trace), "--cache-experts", "4", "--jobs", "1", "--policies", "fmoe", "--mode", "online"]
    argv += ["--prefetch-distance", "auto", "--expert-mb", "0.5", "--bandwidth-gbs", "1", "--layer-time-ms", "1"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    # A copy of 0.5 MB at 1 GB/s takes half a layer time: one layer, plus one.
    assert "prefetch distance 2" in capsys.readouterr().out
    assert json.loads(out.read_text())["config"]["prefetch_distance_used"] == {"syn.npz": 2}
    with pytest.raises(SystemExit):
        cli.main(["replay", str(trace), "--prefetch-distance", "far"])
    assert "'auto'" in capsys.readouterr().err


def test_bench_quality_scores_each_expert_format_on_held_text(tiny_model_dir, tmp_path, capsys):
    import argparse

    from fmoe_bench import cli as bench_cli

    text = tmp_path / "held.json"
    text.write_text(json.dumps(["The quick brown fox jumps over the lazy dog. " * 20] * 4))
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "quality", "--model", str(tiny_model_dir("olmoe")), "--text", str(text), "--formats", "bf16,nf4"]
        + ["--seq-len", "16", "--windows", "3", "--device", "cpu"]
    )
    assert bench_cli.run(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "|---" not in line]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["unquantised (float32)", "nf4"]
    losses = [float(r.split("|")[4]) for r in rows[1:]]
    assert all(0 < x < 10 for x in losses) and losses[0] != losses[1]  # 48 tokens scored; nf4 changes the weights
    with pytest.raises(ValueError, match="Unknown expert format q3"):
        bench_cli.run(parser.parse_args(["bench", "quality", "--formats", "q3"]))
