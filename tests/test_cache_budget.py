"""Slots a cache budget buys, a cache cut to what the GPU holds (said, not silent), and the refusal of a cache with
none (fmoe_local/cache_budget.py)."""

from __future__ import annotations

import pytest
import torch

from fmoe_local.cache_budget import check_capacity, device_room_bytes, fitted_slots, slots_for_budget


def test_a_budget_buys_whole_experts_only():
    assert slots_for_budget(1.0, 352 * 1024**2) == 2  # 1 GiB holds two 352 MiB experts, not 2.9
    assert slots_for_budget(0.25, 352 * 1024**2) == 0


@pytest.mark.parametrize(
    ("expert_bytes", "size"),
    [(3 * 1024**3, "3 GB"), (352 * 1024**2, "352 MB"), (24 * 1024, "24 KB"), (500, "500 bytes")],
)
def test_a_cache_without_a_slot_is_refused_with_the_size_of_one_expert(expert_bytes, size):
    with pytest.raises(ValueError, match=f"at least one expert \\({size} for this model\\)"):
        check_capacity(0, expert_bytes)
    check_capacity(1, expert_bytes)  # one slot is a cache


def test_a_cache_the_gpu_cannot_hold_gets_what_fits_and_says_so():
    gib = 1024**3
    assert fitted_slots(10, gib // 4, None) == (10, "")  # the CPU: not the device's to limit
    assert fitted_slots(10, gib // 4, 3 * gib) == (10, "")  # 2.5 GB fit in 3
    slots, said = fitted_slots(16, gib // 4, int(2.6 * gib))  # a 4 GB cache next to the model on an 8 GB card
    assert slots == 10
    assert said == (
        " The expert cache was set to 4.0 GB; 2.5 GB fit next to the model on this GPU, so it holds 10 experts "
        "(Settings shows what fits)."
    )
    with pytest.raises(ValueError, match="less than one expert .* Close other programs that use the GPU"):
        fitted_slots(16, gib, gib // 2)
    assert device_room_bytes(torch.device("cpu")) is None
