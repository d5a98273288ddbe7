"""The replay's miss handling: the runtime's MissPlanner shares a layer's misses between the link and the CPU, a
host miss loads nothing and costs CPU time, and the layer waits for the later of the two."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fmoe_bench.cli import main
from fmoe_bench.presets import CostModel, cost_model
from fmoe_bench.replay import build_schedule, replay
from fmoe_bench.replay_pool import replay_all
from fmoe_local.traces import DECODE, PREFILL, save_trace
from tests.test_oracle import synthetic_trace
from tests.test_replay import LRU, make_trace

# load = 0.1 s; the CPU takes 0.04 s for one token and 0.02 s per further token: 1-3 tokens go to the CPU under
# auto, 4 or more are copied.
COST = CostModel(100, 1000.0, 0.01, 0.0, cpu_s_1=0.04, cpu_s_per_token=0.02)


def _decode_schedule():
    # L=2, K=1, one request of 4 decode steps, 4 experts: every access a different expert → all misses with 2 slots.
    return build_schedule(make_trace([[[0], [1]], [[2], [3]], [[1], [0]], [[3], [2]]], [1] * 4))


def test_cpu_misses_load_nothing_and_cost_the_cpu_time():
    r = replay(_decode_schedule(), LRU(), 2, COST, "online", miss_handling="cpu")
    assert (r.misses, r.on_host, r.bytes_moved, r.hits) == (8, 8, 0, 0)  # nothing ever lands: no hits either
    assert r.host_s == pytest.approx(8 * 0.04) and r.stall_s == 0
    assert r.tpot_s == pytest.approx((4 * 2 * 0.01 + 8 * 0.04) / 4)
    copied = replay(_decode_schedule(), LRU(), 2, COST, "online", miss_handling="copy")
    assert (copied.on_host, copied.bytes_moved, copied.host_s) == (0, 8 * 100, 0)
    assert copied.tpot_s == pytest.approx((4 * 2 * 0.01 + 8 * 0.1) / 4)


def test_auto_computes_decode_misses_on_the_cpu_and_copies_the_ones_many_prefill_tokens_need():
    # One prefill of 5 rows: expert 0 chosen by all 5 rows (0.12 s on the CPU > 0.1 s copy), expert 1 by one row
    # (0.04 s) at layer 0; then a decode step needing expert 2 (one token: CPU).
    rows = [[[0]]] * 4 + [[[1]]] + [[[2]]]
    trace = make_trace(rows, [1] * 6, phases=[PREFILL] * 5 + [DECODE])
    schedule = build_schedule(trace)
    assert schedule.counts[0] == [(4, 1)]  # rows choosing each needed expert (0 and 1), in `needed` order
    r = replay(schedule, LRU(), 4, COST, "online", miss_handling="auto")
    assert (r.misses, r.on_host, r.bytes_moved) == (3, 2, 100)  # expert 0 copied; 1 (prefill, 1 row) and 2 on CPU
    assert r.host_s == pytest.approx(0.04 + 0.04)


def _four_misses_in_one_layer():
    return build_schedule(make_trace([[[0, 1, 2, 3]]], [1], num_experts=8))  # one decode step, L=1, K=4


def test_auto_shares_a_layers_misses_and_the_layer_waits_for_the_later_of_link_and_cpu():
    # CPU 0.25 s per miss, copy 0.1 s: three copies end at 0.3 s, the fourth miss ends sooner on the CPU (0.25 s).
    # The copies land while the CPU computes: the layer waits max(0.3, 0.25), not their sum.
    r = replay(_four_misses_in_one_layer(), LRU(), 4, replace(COST, cpu_s_1=0.25), "online", miss_handling="auto")
    assert (r.misses, r.on_host, r.bytes_moved) == (4, 1, 300)
    assert r.host_s == pytest.approx(0.25) and r.stall_s == pytest.approx(0.05)  # the link's time the CPU leaves
    assert r.tpot_s == pytest.approx(0.01 + 0.3)
    # CPU 0.04 s: CPU, CPU, copy (0.12 > 0.1), CPU (0.12 < 0.2) — the one copy ends under the CPU's 0.12 s.
    r = replay(_four_misses_in_one_layer(), LRU(), 4, COST, "online", miss_handling="auto")
    assert (r.on_host, r.bytes_moved, r.stall_s) == (3, 100, 0)
    assert r.host_s == pytest.approx(0.12) and r.tpot_s == pytest.approx(0.01 + 0.12)
    # cpu is not shared: the four run one after the other on the CPU.
    r = replay(_four_misses_in_one_layer(), LRU(), 4, COST, "online", miss_handling="cpu")
    assert r.on_host == 4 and r.tpot_s == pytest.approx(0.01 + 0.16)


def test_a_lone_miss_is_copied_when_the_cpu_is_slower_than_the_copy():
    slow = replace(COST, cpu_s_1=0.5)
    r = replay(_decode_schedule(), LRU(), 2, slow, "online", miss_handling="auto")
    assert r.on_host == 0 and r.bytes_moved == 8 * 100


def _registry(name: str, schedule, capacity: int):
    from fmoe_local.config import RuntimeConfig
    from fmoe_local.policies import make_policy

    return make_policy(name, schedule.shape, RuntimeConfig(policy=name, cache_experts=capacity))


def test_replay_all_runs_each_policy_under_each_miss_handling_and_cpu_moe_once():
    schedule = _decode_schedule()
    results = replay_all(schedule, ["lru", "cpu_moe"], _registry, 4, COST, "online", miss_handling=("copy", "auto"))
    assert [(r.policy, r.miss_handling) for r in results] == [("lru", "copy"), ("lru", "auto"), ("cpu_moe", "cpu")]
    assert results[2].on_host == results[2].misses > 0


def test_unknown_miss_handling_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="Unknown miss handling 'gpu'. Choose from: auto, copy, cpu"):
        replay(_decode_schedule(), LRU(), 2, COST, "online", miss_handling="gpu")


def test_presets_carry_a_cpu_time_per_expert_and_cpu_gbs_replaces_it():
    cm = cost_model("deepseek-v2-lite")
    assert 0 < cm.cpu_s_1 < 1 and cm.cpu_s_per_token > 0
    fast = cost_model("deepseek-v2-lite", cpu_gbs=100.0)
    assert fast.cpu_s_1 == pytest.approx(cm.expert_bytes / 100e9)
    with pytest.raises(ValueError, match="The CPU's GB/s must be a positive number"):
        cost_model("deepseek-v2-lite", cpu_gbs=0)


def test_replay_command_rows_carry_the_miss_handling(tmp_path: Path, capsys):
    trace = tmp_path / "syn.npz"
    save_trace(synthetic_trace(0, requests=2, length=4), trace)
    out = tmp_path / "r.json"
    argv = ["replay", str(trace), "--policies", "lru,cpu_moe", "--miss-handling", "copy,auto", "--jobs", "1"]
    assert main([*argv, "--cache-experts", "4", "--mode", "online", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "lru+copy" in printed and "lru+auto" in printed and "cpu_moe+cpu" in printed
    rows = json.loads(out.read_text())["results"]
    assert [(r["policy"], r["miss_handling"]) for r in rows] == [("lru", "copy"), ("lru", "auto"), ("cpu_moe", "cpu")]
    assert main([*argv[:4], "--miss-handling", "copy,gpu"]) == 2
    assert "Unknown miss handling 'gpu'. Give a comma list of: auto, copy, cpu." in capsys.readouterr().err
