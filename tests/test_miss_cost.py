"""miss_cost.py: the cost model's arithmetic, the per-miss decision of each mode, the sentences the Stats tab shows,
and the probe on a real (tiny) model."""

from __future__ import annotations

import math

import pytest
import torch

from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.engine import Engine
from fmoe_local.miss_cost import MissCosts, MissPlanner, probe
from fmoe_local.runtime import Runtime


def costs(**changes) -> MissCosts:
    base = dict(
        device="cuda", fmt="bf16", expert_bytes=25_000_000, h2d_gbps=25.0, cpu_kernel="bf16 native",
        cpu_s_1=0.5e-3, cpu_s_n=2.05e-3, probe_tokens=16,
    )  # fmt: skip
    return MissCosts(**(base | changes))


def test_copy_time_is_bytes_over_bandwidth_and_cpu_time_is_the_line_through_the_probe():
    c = costs()
    assert c.copy_s == pytest.approx(1e-3)  # 25 MB at 25 GB/s
    assert c.cpu_s(1) == c.cpu_s(0) == pytest.approx(0.5e-3)
    assert c.cpu_s(16) == pytest.approx(2.05e-3)
    assert c.cpu_s(6) == pytest.approx(0.5e-3 + 5 * 1.55e-3 / 15)


def test_copy_and_cpu_modes_decide_every_miss_their_way_and_no_gpu_means_the_cpu():
    c = costs()
    assert MissPlanner("copy", c).plan([1, 100, 1]) == [False] * 3
    assert MissPlanner("cpu", c).plan([1, 100, 1]) == [True] * 3
    assert MissPlanner("copy", c, forced="cpu").plan([100]) == [True]  # cpu_moe overrides the setting
    # Without a GPU a copy only duplicates the expert in RAM: auto always computes on the CPU.
    no_gpu = costs(device="cpu", h2d_gbps=0.0)
    assert math.isinf(no_gpu.copy_s) and MissPlanner("auto", no_gpu).plan([10_000, 1]) == [True, True]
    assert MissPlanner("auto", c).plan([]) == []


def _figures(cpu_ms: float) -> MissCosts:
    # The example: a DeepSeek-V2-Lite expert copies in 0.69 ms at 25 GB/s.
    return costs(expert_bytes=17_250_000, cpu_s_1=cpu_ms * 1e-3, cpu_s_n=cpu_ms * 1e-3 * 4)


def test_auto_shares_a_layers_misses_so_that_link_and_cpu_finish_earliest():
    # CPU 2.51 ms, slower than a 0.69 ms copy: six misses all copied end at 4.14 ms; the fourth goes to the CPU
    # instead (2.51 < 2.76), and the layer ends at max(2.51, 5 × 0.69 = 3.45).
    assert MissPlanner("auto", _figures(2.51)).plan([1] * 6) == [False, False, False, True, False, False]
    assert MissPlanner("auto", _figures(2.51)).plan([1] * 3) == [False] * 3  # 3 copies end at 2.07 < 2.51
    # CPU 0.38 ms, faster than the copy: still 4 on the CPU (1.52 ms) and 2 copied (1.38 ms) beat all 6 on the CPU
    # (2.28 ms); the second miss is copied because 0.38 + 0.38 > 0.69.
    fast = MissPlanner("auto", _figures(0.38))
    assert fast.plan([1] * 6) == [True, False, True, True, False, True]
    assert fast.plan([1]) == [True]
    # A CPU this slow never finishes a miss before the link would have copied it.
    assert not any(MissPlanner("auto", _figures(60.0)).plan([1] * 64))


def test_auto_gives_the_link_the_experts_many_prefill_tokens_need():
    # costs(): copy 1 ms, CPU 0.5 ms + 0.1033 ms per further token. Decreasing CPU time: the 100-token expert
    # (10.7 ms) and the 20-token one (2.5 ms) go to the link first (ending 1, then 2 ms), the 1-token ones to the CPU
    # (0.5, 1.0, 1.5 ms: each ends before the link's next copy would, at 3 ms).
    assert MissPlanner("auto", costs()).plan([1, 100, 1, 20, 1]) == [True, False, True, False, True]
    # Equal CPU times keep their order, and a tie goes to the link: CPU 1 ms = copy 1 ms.
    assert MissPlanner("auto", costs(cpu_s_1=1e-3, cpu_s_n=1e-3)).plan([1, 1]) == [False, True]


def test_the_stats_sentence_says_what_auto_does_and_why():
    slow = _figures(2.51).explain("auto")
    assert "2.51 ms" in slow and "0.69 ms" in slow and "lone one-token miss is copied" in slow
    assert "from 4 misses on" in slow and "about 22% go to the CPU" in slow  # 14 of 64 misses: 0.69 / (0.69 + 2.51)
    fast = _figures(0.38).explain("auto")
    assert "lone one-token miss is computed on the CPU" in fast and "about 64% go to the CPU" in fast
    never = _figures(60.0).explain("auto")
    assert "Every miss is copied" in never and "60.00 ms" in never and "64 misses" in never
    no_gpu = costs(device="cpu", h2d_gbps=0.0)
    assert "No GPU" in no_gpu.explain("auto") and "only meaningful choice" in no_gpu.explain("auto")
    assert "copy" in no_gpu.explain("copy")


def test_a_policy_that_forces_its_miss_handling_says_so_instead_of_naming_the_setting():
    forced = MissPlanner("copy", _figures(2.51), forced="cpu")  # cpu_moe with miss handling set to copy
    said = forced.explain()
    # was: "(miss handling: cpu)" while Settings showed copy
    assert said.startswith(
        "Every miss is computed on the CPU (the policy's own choice; the miss handling setting, copy,"
    )
    assert (
        MissPlanner("cpu", _figures(2.51), forced="cpu")
        .explain()
        .startswith("Every miss is computed on the CPU (miss handling: cpu)")
    )


def test_costs_round_trip_through_a_dict_and_ignore_unknown_keys():
    c = costs(kernels={"bf16 native": 0.5e-3})
    assert MissCosts.from_dict(c.to_dict() | {"from_a_newer_version": 1}) == c


def test_probe_on_a_cpu_device_measures_only_the_native_kernel(tiny_model_dir):
    engine = Engine.build(tiny_model_dir("mixtral"), RuntimeConfig(device="cpu", cache_experts=2))
    try:
        c = engine.miss_costs
        assert c.device == "cpu" and c.fmt == "fp32" and c.cpu_kernel == "fp32 native" and c.h2d_gbps == 0.0
        assert list(c.kernels) == ["fp32 native"] and c.cpu_s_1 > 0 and c.cpu_s_n >= c.cpu_s_1
        assert c.probe_experts == engine.shape.num_layers * engine.shape.num_experts  # a tiny model: all of them
        assert c.expert_bytes == engine.host.expert_bytes
    finally:
        engine.close()


@pytest.mark.parametrize("fmt, dtype", [("int8", "float32"), ("int8", "bfloat16"), ("int4", "float32")])
def test_probe_on_a_cpu_device_measures_int8_blocks_only_in_float32(tiny_model_dir, tmp_path, fmt, dtype):
    from fmoe_local.cpu_experts import INT8_BLOCKS_ON_CPU

    config = RuntimeConfig(device="cpu", dtype=dtype, cache_experts=2, expert_format=fmt, quant_cache_dir=str(tmp_path))
    engine = Engine.build(tiny_model_dir("mixtral"), config)
    try:
        c = engine.miss_costs
        native = "fp32 native" if dtype == "float32" else "bf16 native"
        both = fmt == "int8" and dtype == "float32"
        assert list(c.kernels) == ([native, INT8_BLOCKS_ON_CPU.name] if both else [native])
        assert c.cpu_kernel == min(c.kernels, key=c.kernels.get)  # the faster one measured here
    finally:
        engine.close()


def test_saved_costs_naming_int8_blocks_on_a_cpu_device_give_that_kernel():
    from fmoe_local.cpu_experts import INT8_BLOCKS_ON_CPU, NATIVE
    from fmoe_local.miss_cost import kernel_named

    cpu = torch.device("cpu")
    assert kernel_named(costs(device="cpu", fmt="fp32", cpu_kernel=INT8_BLOCKS_ON_CPU.name), cpu) is INT8_BLOCKS_ON_CPU
    assert kernel_named(costs(device="cpu", fmt="fp32", cpu_kernel="fp32 native"), cpu) is NATIVE
    assert kernel_named(costs(device="cpu", fmt="bf16", cpu_kernel="bf16→fp32 blocks"), cpu) is NATIVE  # GPU-only


def test_probe_for_a_gpu_times_every_candidate_and_keeps_the_fastest(tiny_model_dir):
    engine = Engine.build(
        tiny_model_dir("mixtral", dtype=torch.bfloat16), RuntimeConfig(device="cpu", dtype="bfloat16")
    )
    try:
        module = engine.moe_layers[0].experts
        c, kernel = probe(engine.host, module, torch.device("cuda"), h2d_gbps=25.0)
        assert c.fmt == "bf16" and set(c.kernels) == {"bf16 native", "bf16→fp32 whole", "bf16→fp32 blocks"}
        assert c.cpu_kernel == kernel.name == min(c.kernels, key=c.kernels.get)
        assert c.h2d_gbps == 25.0 and c.has_gpu
    finally:
        engine.close()


def test_saved_costs_are_reused_and_stale_ones_measured_again(tiny_model_dir):
    model = tiny_model_dir("olmoe")
    config = RuntimeConfig(device="cpu", cache_experts=2, sampling=Sampling(greedy=True, max_new_tokens=2))
    with Runtime.load(model, config) as runtime:
        measured = runtime.miss_costs
    saved = MissCosts.from_dict(measured.to_dict() | {"cpu_s_1": 123.0})
    with Runtime.load(model, config, miss_costs=saved) as runtime:
        assert runtime.miss_costs == saved  # no new probe
        assert "123000.00 ms" in runtime.miss_explanation
    stale = MissCosts.from_dict(saved.to_dict() | {"expert_bytes": 1})  # another model's figures
    with Runtime.load(model, config, miss_costs=stale) as runtime:
        assert runtime.miss_costs.expert_bytes == measured.expert_bytes and runtime.miss_costs.cpu_s_1 < 123.0


def test_unknown_miss_handling_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="Unknown miss handling 'gpu'.*auto.*copy.*cpu"):
        RuntimeConfig(miss_handling="gpu").validate()


def test_reconfigure_switches_miss_handling_without_a_reload(tiny_model_dir):
    config = RuntimeConfig(device="cpu", cache_experts=2, sampling=Sampling(greedy=True, max_new_tokens=3))
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        assert runtime.info.miss_handling == "auto"
        assert runtime.generate([{"role": "user", "content": "Hi"}]).stats.on_host > 0
        runtime.reconfigure(miss_handling="copy")
        assert runtime.info.miss_handling == "copy"
        assert runtime.generate([{"role": "user", "content": "Hi"}]).stats.on_host == 0
        with pytest.raises(ValueError, match="Unknown miss handling"):
            runtime.reconfigure(miss_handling="later")
        assert runtime.info.miss_handling == "copy"
