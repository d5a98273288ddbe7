"""Slots a cache budget buys, and the refusal of a cache with none (fmoe_local/cache_budget.py)."""

from __future__ import annotations

import pytest

from fmoe_local.cache_budget import check_capacity, slots_for_budget


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
