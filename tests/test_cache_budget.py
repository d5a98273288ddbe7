"""Slots a cache budget buys, a cache cut to what the GPU holds (said, not silent), and the refusal of a cache with
none; the RAM one expert map takes and the refusal of more maps than RAM holds (fmoe_local/cache_budget.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fmoe_local.cache_budget import (
    SettingRefused,
    check_capacity,
    check_store_capacity,
    device_room_bytes,
    fitted_slots,
    map_bytes,
    slots_for_budget,
)
from fmoe_local.maps import MapStore
from fmoe_local.policies.base import ModelShape


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
        " The expert cache was set to 4 GB; 2.5 GB fit next to the model on this GPU, so it holds 10 experts "
        "(Settings shows what fits)."
    )
    with pytest.raises(ValueError, match="less than one expert .* Close other programs that use the GPU"):
        fitted_slots(16, gib, gib // 2)
    assert device_room_bytes(torch.device("cpu")) is None


@pytest.mark.parametrize(
    ("layers", "experts", "embed", "sketch"), [(4, 8, 3, 256), (6, 8, 300, 256), (26, 64, 2048, 0)]
)
def test_the_size_of_one_map_is_what_the_store_allocates_for_it(layers, experts, embed, sketch):
    def arrays(store):
        held = [store._request_ids, store._stamps, store._links._next]
        for index in (store._traj, store._semantic):
            held += [v for k, v in vars(index).items() if isinstance(v, np.ndarray) and k != "_proj"]
        return sum(a.nbytes for a in held)

    shape = ModelShape(num_layers=layers, num_experts=experts, top_k=2, embed_dim=embed)
    one, ten = (MapStore(shape, c, 1, sketch_dim=sketch) for c in (1, 11))
    assert arrays(ten) - arrays(one) == 10 * map_bytes(layers, experts, embed, sketch)


def test_a_map_store_too_big_for_the_ram_is_refused_with_how_many_fit():
    check_store_capacity(4000, 16 * 1024, 4 * 1024**3)  # 64 MB of maps in 4 GB
    with pytest.raises(SettingRefused) as refused:
        check_store_capacity(10**7, 16 * 1024, 4 * 1024**3)
    assert refused.value.setting == "store_capacity"
    assert str(refused.value) == (
        "10,000,000 expert maps do not fit in memory: one takes 16 KB for this model, and at most 262,144 maps fit "
        "in the 4 GB of RAM they may use here (half of what is free now). Keep 262,144 or fewer maps."
    )
    check_store_capacity(10**12, 16 * 1024, None)  # the platform does not say: nothing to hold it to
