"""Measured speeds: the host→GPU probe answers only with CUDA; the DRAM and last-level-cache figures are positive."""

from __future__ import annotations

from fmoe_local import bandwidth


def test_host_to_device_probe_needs_cuda():
    import torch

    gbps = bandwidth.host_to_device_gbps(size_mb=8, repeats=1)
    assert (gbps > 0) == torch.cuda.is_available()


def test_dram_and_cache_figures_are_measured():
    assert bandwidth.llc_bytes() > 0
    assert bandwidth.dram_read_gbps(size_mb=64, repeats=1) > 0


def test_half_precision_decode_is_measured_against_float32():
    import torch

    ratio = bandwidth.half_decode_ratio(torch.bfloat16, repeats=1)
    assert 0 < ratio < float("inf")
    assert bandwidth.half_decode_ratio(torch.bool, repeats=1) == float("inf")  # a dtype the product cannot take


def test_the_packed_products_are_measured_with_bf16_against_float32_activations():
    for fmt in ("int8", "int4"):
        ratio = bandwidth.products_decode_ratio(fmt, repeats=1)
        assert 0 < ratio < float("inf"), fmt
    assert bandwidth.products_decode_ratio("nf4", repeats=1) == float("inf")  # no product to measure
