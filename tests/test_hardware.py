"""Fit verdicts and slider bounds for made-up machines, plus a live probe of this one."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from fmoe_local import hardware
from fmoe_local.catalog import GB, find
from fmoe_local.hardware import GIB, Machine, cache_gb_limit, fit, probe

# Three profiles the wizard must judge: a gaming laptop, a CPU-only office box, a workstation.
LAPTOP = Machine("cuda", "RTX 4060 Laptop", 8 * GB, int(7.5 * GB), 32 * GB, 26 * GB, 500 * GB)
OFFICE = Machine("cpu", "", 0, 0, 16 * GB, 11 * GB, 200 * GB)
WORKSTATION = Machine("cuda", "RTX 4090", 24 * GB, 23 * GB, 128 * GB, 120 * GB, 2000 * GB)

OLMOE = find("allenai/OLMoE-1B-7B-0924-Instruct")
QWEN3 = find("Qwen/Qwen3-30B-A3B-Instruct-2507")
MIXTRAL = find("mistralai/Mixtral-8x7B-Instruct-v0.1")


def test_laptop_runs_small_models_and_slows_down_on_big_ones():
    small = fit(OLMOE, LAPTOP)
    assert small.level == "good"
    # Cache is whatever VRAM is left after the resident part and the KV reserve, never more than all experts.
    assert small.max_cache_gb == pytest.approx((7.5 * GB - OLMOE.resident_bytes - hardware.KV_RESERVE_BYTES) / GIB)
    big = fit(QWEN3, LAPTOP)  # 58 GB of experts do not fit in 23 GB of usable RAM
    assert big.level == "slow"
    assert "exceed free RAM" in big.reasons[0]


def test_cpu_only_machine_is_slow_or_does_not_fit():
    small = fit(OLMOE, OFFICE)
    assert small.level == "slow"
    assert "CPU" in small.reasons[0]
    tiny_ram = Machine("cpu", "", 0, 0, 4 * GB, int(3.5 * GB), 200 * GB)
    verdict = fit(MIXTRAL, tiny_ram)
    assert verdict.level == "no"
    assert verdict.max_cache_gb == 0.0
    assert "RAM" in verdict.reasons[0]


def test_workstation_fits_mixtral_with_experts_in_ram():
    verdict = fit(MIXTRAL, WORKSTATION)
    assert verdict.level == "good"
    assert 15 < verdict.max_cache_gb < 18  # GiB, as RuntimeConfig.cache_gb counts


def test_disk_space_is_checked_before_anything_else_unless_downloaded():
    full_disk = Machine("cuda", "RTX 4090", 24 * GB, 23 * GB, 128 * GB, 120 * GB, 10 * GB)
    verdict = fit(OLMOE, full_disk)
    assert verdict.level == "no"
    assert "disk space" in verdict.reasons[0]
    assert fit(OLMOE, full_disk, downloaded=True).level == "good"


def test_too_little_vram_for_resident_part():
    small_gpu = Machine("cuda", "GT 1030", 2 * GB, int(1.5 * GB), 64 * GB, 60 * GB, 500 * GB)
    verdict = fit(MIXTRAL, small_gpu)
    assert verdict.level == "no"
    assert "GPU memory" in verdict.reasons[0]


def test_cache_limit_gives_back_the_current_cache():
    assert cache_gb_limit(LAPTOP, 0, current_cache_gb=2.0) == pytest.approx((7.5 - 1.0) * GB / GIB + 2.0)
    assert cache_gb_limit(OFFICE, 0) == pytest.approx((11 - 3.0) * GB / GIB)
    assert cache_gb_limit(Machine("cpu", "", 0, 0, GB, GB, GB), 0) == 0.0


def test_probe_reads_this_machine(tmp_path):
    m = probe(tmp_path / "not-yet-created")
    assert m.ram_total >= m.ram_available > 0
    assert m.disk_free > 0
    assert m.device in ("cpu", "cuda", "mps")
    assert "RAM" in m.summary()


def test_a_packed_format_fits_where_bf16_spills_and_is_recommended():
    from fmoe_local.hardware import fit_by_format, recommend_format

    mixtral = find("mistralai/Mixtral-8x7B-Instruct-v0.1")
    desktop = Machine("cuda", "RTX 4070", 12 * GB, 11 * GB, 64 * GB, 60 * GB, 500 * GB)
    verdicts = fit_by_format(mixtral, desktop)
    assert list(verdicts) == ["bf16", "int8", "int4", "nf4"]
    assert verdicts["bf16"].level == "slow" and verdicts["int8"].level == "good"  # 90 GB vs 45 GB of experts
    assert recommend_format(verdicts) == "int8"
    small = Machine("cuda", "RTX 4070", 12 * GB, 11 * GB, 32 * GB, 30 * GB, 500 * GB)
    four_bit = fit_by_format(mixtral, small)  # 25.4 GB of 4-bit experts fit in 27 GB free, 45 GB of int8 do not
    assert [four_bit[f].level for f in ("int8", "int4", "nf4")] == ["slow", "good", "good"]
    assert recommend_format(four_bit) == "int4"  # as small as nf4, and computed by torch's product on a CPU
    # int4 and nf4 are 4.5 bits per weight with their group scales; GPT-OSS's own MXFP4 is what auto keeps.
    assert mixtral.expert_bytes_for("nf4") == round(mixtral.expert_bytes * 4.5 / 16)
    assert mixtral.expert_bytes_for("int4") == round(mixtral.expert_bytes * 4.5 / 16)
    gpt_oss = find("openai/gpt-oss-20b")
    assert gpt_oss.expert_bytes_for("auto") == gpt_oss.expert_bytes_for("mxfp4") < gpt_oss.expert_bytes / 3
    assert list(fit_by_format(gpt_oss, desktop))[0] == "mxfp4"


def test_each_format_says_what_it_takes_on_disk_in_ram_and_on_the_gpu():
    from fmoe_local.hardware import copy_bytes, format_fits

    desktop = Machine("cuda", "RTX 4070", 12 * GB, 11 * GB, 64 * GB, 60 * GB, 500 * GB)
    fits = {f.fmt: f for f in format_fits(MIXTRAL, desktop)}
    assert [f.fmt for f in fits.values()] == ["bf16", "int8", "int4", "nf4"]
    assert [f.recommended for f in fits.values()] == [False, True, False, False]  # the most faithful that fits well
    # The download is the same; int8/nf4 add the copy made on the first load, as big as their experts.
    assert fits["bf16"].disk_bytes == MIXTRAL.download_bytes and copy_bytes(MIXTRAL, "bf16") == 0
    assert fits["nf4"].disk_bytes == MIXTRAL.download_bytes + MIXTRAL.experts_bytes_for("nf4")
    assert fits["int8"].ram_bytes == MIXTRAL.experts_bytes_for("int8") == MIXTRAL.experts_bytes // 2
    assert fits["nf4"].gpu_bytes == MIXTRAL.resident_bytes + int(fits["nf4"].verdict.max_cache_gb * GIB)
    # Without a CUDA GPU the runtime computes in float32: the resident part takes twice its bf16 size, and so do
    # bf16 experts; packed experts stay packed.
    cpu = {f.fmt: f for f in format_fits(OLMOE, OFFICE)}
    assert (
        cpu["nf4"].gpu_bytes == 0 and cpu["nf4"].ram_bytes == OLMOE.experts_bytes_for("nf4") + 2 * OLMOE.resident_bytes
    )
    assert cpu["bf16"].ram_bytes == 2 * (OLMOE.experts_bytes + OLMOE.resident_bytes)
    # With int8/int4 experts the resident part's linear weights are packed the same way (dense format auto), its
    # input embedding table (OLMoE's 50,304 × 2,048, bf16) not. int4 keeps its scale and zero per 64 weights in the
    # compute dtype: float32 makes it 5 bits per weight, in RAM and in the copy on disk.
    table = 50304 * 2048 * 2
    linear = OLMOE.resident_bytes - table

    def packed(bits: float, widen: int) -> int:
        return widen * table + round(linear * bits / 16)

    assert cpu["int4"].ram_bytes == round(OLMOE.experts_bytes * 5 / 16) + packed(5, 2)
    # The copy on disk holds the packed linear weights too (dense.safetensors), the embedding table not.
    assert cpu["int4"].disk_bytes == OLMOE.download_bytes + round(OLMOE.experts_bytes * 5 / 16) + round(linear * 5 / 16)
    assert cpu["int8"].disk_bytes == OLMOE.download_bytes + OLMOE.experts_bytes_for("int8") + round(linear * 8 / 16)
    assert cpu["nf4"].disk_bytes == OLMOE.download_bytes + OLMOE.experts_bytes_for("nf4")  # its dense stays bf16
    assert [f.fmt for f in cpu.values() if f.recommended] == ["int4"]  # the smallest with nf4, the faster on a CPU
    # On a CPU measured to decode bf16 about as fast as float32, a bf16 model stays bf16: its own size in RAM.
    keeps = {f.fmt: f for f in format_fits(OLMOE, replace(OFFICE, cpu_keeps_bf16=True))}
    assert keeps["bf16"].ram_bytes == OLMOE.experts_bytes + OLMOE.resident_bytes
    assert keeps["nf4"].ram_bytes == OLMOE.experts_bytes_for("nf4") + OLMOE.resident_bytes
    assert keeps["int4"].ram_bytes == OLMOE.experts_bytes_for("int4") + packed(4.5, 1)  # bf16 scales: 4.5 bits
    # On a CPU whose int4 product is measured faster with bf16 activations (and dense bf16 slower), an int4 model stays
    # bf16 (the table at its own size, 4.5 bits per packed weight); the other formats still widen.
    products = {f.fmt: f for f in format_fits(OLMOE, replace(OFFICE, cpu_bf16_products=("int4",)))}
    assert products["int4"].ram_bytes == OLMOE.experts_bytes_for("int4") + packed(4.5, 1)
    assert products["int4"].disk_bytes == OLMOE.download_bytes + OLMOE.experts_bytes_for("int4") + packed(4.5, 0)
    assert products["int8"].ram_bytes == cpu["int8"].ram_bytes == OLMOE.experts_bytes_for("int8") + packed(8, 2)
    assert products["bf16"].ram_bytes == cpu["bf16"].ram_bytes
    # Where OpenVINO multiplies the dense int8 weights (the measured verdicts, per size class), they take their size
    # twice in RAM (its repacked copy beside ours), not on disk; int4's dense weights and the experts are as before.
    ov = {f.fmt: f for f in format_fits(OLMOE, replace(OFFICE, cpu_openvino_dense=("small", "large")))}
    assert ov["int8"].ram_bytes == cpu["int8"].ram_bytes + round(linear * 8 / 16)
    assert ov["int8"].disk_bytes == cpu["int8"].disk_bytes
    assert ov["int4"].ram_bytes == cpu["int4"].ram_bytes and ov["bf16"].ram_bytes == cpu["bf16"].ram_bytes
    # The output head (the input table's shape, 103 MB in int8: large) and the other linear weights (small) each
    # follow their own size's verdict.
    head = table // 2
    heads = {f.fmt: f for f in format_fits(OLMOE, replace(OFFICE, cpu_openvino_dense=("large",)))}
    assert heads["int8"].ram_bytes == cpu["int8"].ram_bytes + head
    rest = {f.fmt: f for f in format_fits(OLMOE, replace(OFFICE, cpu_openvino_dense=("small",)))}
    assert rest["int8"].ram_bytes == cpu["int8"].ram_bytes + round(linear * 8 / 16) - head
    gpt_oss = format_fits(find("openai/gpt-oss-20b"), desktop)
    assert (gpt_oss[0].fmt, gpt_oss[0].choice) == ("mxfp4", "auto")
    assert gpt_oss[0].disk_bytes == find("openai/gpt-oss-20b").download_bytes  # its own form: no copy


def test_a_copy_that_does_not_fit_on_disk_means_quantising_at_every_load():
    # Room for Qwen3's download (61 GB) but not for its 8-bit copy (29 GB) as well.
    tight = Machine("cuda", "RTX 4090", 24 * GB, 23 * GB, 128 * GB, 120 * GB, 70 * GB)
    assert fit(QWEN3, tight, fmt="bf16").level == "good"
    int8 = fit(QWEN3, tight, fmt="int8")
    assert int8.level == "slow" and "quantises them again" in int8.reasons[0]
    assert fit(QWEN3, tight, downloaded=True, fmt="int8").level == "good"  # the download's space is in use already


def test_a_format_that_does_not_fit_names_one_that_does():
    from fmoe_local.hardware import format_fits, instead

    small_ram = Machine("cpu", "", 0, 0, 16 * GB, 11 * GB, 500 * GB)
    fits = format_fits(MIXTRAL, small_ram)
    # In float32 on the CPU, Mixtral's resident part (6.4 GB) and four bf16 experts of cache (2.8 GB) exceed the
    # 8 GB left after the headroom; 8-bit and 4-bit experts spill to disk, but run.
    assert [f.verdict.level for f in fits] == ["no", "slow", "slow", "slow"]
    assert instead(fits, "bf16").startswith(
        "bf16 does not fit here: Not enough memory: the model needs at least 9.2 GB"
    )
    assert instead(fits, "bf16").endswith("Choose 4-bit int4 instead (runs, slowly).")  # the recommended one
    assert instead(fits, "int8") == ""
    tiny_gpu = Machine("cuda", "RTX 3050", 6 * GB, int(5.5 * GB), 64 * GB, 60 * GB, 500 * GB)
    fits = format_fits(MIXTRAL, tiny_gpu)  # a minimal bf16 cache (4 experts × 352 MB) does not fit next to 3.2 GB
    assert [f.verdict.level for f in fits] == ["no", "good", "good", "good"]
    sentence = instead(fits, "bf16")
    assert (
        sentence.startswith("bf16 does not fit here: Not enough GPU memory")
        and "Choose 8-bit instead (fits)." in sentence
    )
    assert instead(fits, "auto") == sentence  # auto keeps a bf16 download in bf16
    assert instead(fits, "nf4") == ""
    hopeless = Machine("cuda", "GT 1030", 2 * GB, int(1.5 * GB), 64 * GB, 60 * GB, 500 * GB)
    assert "neither does any other format" in instead(format_fits(MIXTRAL, hopeless), "nf4")
    assert not any(f.recommended for f in format_fits(MIXTRAL, hopeless))  # nothing to recommend where nothing fits


def test_an_apple_silicon_mac_is_told_models_run_on_its_cpu():
    # The runtime computes on CUDA or the CPU (engine.resolve_device): promising the Apple GPU would be untrue.
    mac = Machine("mps", "", 0, 0, 32 * GB, 20 * GB, 500 * GB)
    assert "models run on the CPU (the Apple GPU is not used yet)" in mac.summary()
    verdict = fit(find("allenai/OLMoE-1B-7B-0924-Instruct"), mac)
    assert verdict.reasons[0].startswith("Runs, slowly: on the CPU (the Apple GPU is not used yet)")


def test_an_nvidia_gpu_torch_cannot_use_is_named_with_what_to_do(tmp_path, monkeypatch):
    import torch

    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    cpu_build = probe(tmp_path)
    assert cpu_build.device == "cpu" and "this PyTorch is the CPU-only build" in cpu_build.unused_gpu
    assert (
        "start fmoe-local with its launcher" in cpu_build.summary() and "No CUDA GPU found" not in cpu_build.summary()
    )
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "update the NVIDIA driver" in probe(tmp_path).unused_gpu  # a CUDA build the driver cannot run
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    no_gpu = probe(tmp_path)  # no NVIDIA driver tool: nothing to say but that there is no GPU
    assert no_gpu.unused_gpu == "" and "No CUDA GPU found" in no_gpu.summary()


def test_volume_of_names_the_mount_point_a_user_frees_space_on(tmp_path):
    volume = hardware.volume_of(tmp_path / "not" / "made" / "yet")
    assert os.path.ismount(volume) and str(tmp_path).startswith(volume)
