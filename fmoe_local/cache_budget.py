"""How many expert slots a cache budget buys, and the refusal of a cache with none; how many expert maps RAM holds.

Scope: the arithmetic between a size in GB and a slot count, for whoever sizes an expert cache (engine.py, `bench
live`) and for the cache itself (cache.py checks its own capacity); the same for the map store's capacity against
the RAM free (engine.py at load and on reconfigure, the Settings tab before a model is loaded); the prefix cache's
budget (prefix_cache.py). It does NOT allocate anything.
"""

from __future__ import annotations

import torch

from fmoe_local import hardware
from fmoe_local.config import PREFIX_AUTO_MAX_GB
from fmoe_local.hardware import GIB, KV_RESERVE_BYTES
from fmoe_local.units import BINARY, number, size, size_auto, unit_for


class SettingRefused(ValueError):
    """A setting (e.g. the saved cache size) this model cannot use; the message says which and what to do. Its own
    type so that the app resets the saved setting for this failure only, never for a model that cannot load.
    `setting`: the RuntimeConfig field refused, the one to reset (the others the user saved are kept)."""

    def __init__(self, message: str, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


def slots_for_budget(cache_gb: float, expert_bytes: int) -> int:
    return int(cache_gb * GIB // expert_bytes)


def device_room_bytes(device: torch.device) -> int | None:
    """Bytes an expert cache may take on `device` now: free GPU memory less the reserve the fit verdicts keep for
    the KV cache and activations (hardware.KV_RESERVE_BYTES); None where the cache's size is not the device's to
    limit (the CPU: host_ram_budget_gb leaves room for it)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, int(free) - KV_RESERVE_BYTES)


def fitted_slots(capacity: int, expert_bytes: int, room_bytes: int | None) -> tuple[int, str]:
    """(slots, sentence): `capacity` when it fits `room_bytes`, else the slots that do and the sentence saying so
    (shown with the load, as the header shows the size in force); a room without one slot is refused."""
    if room_bytes is None or capacity * expert_bytes <= room_bytes:
        return capacity, ""
    fitted = room_bytes // expert_bytes
    if fitted < 1:
        unit = unit_for(max(room_bytes, expert_bytes), BINARY)
        raise ValueError(
            f"The GPU has {size(room_bytes, unit)} left for the expert cache after the model's resident part, less "
            f"than one expert ({size(expert_bytes, unit)}). Close other programs that use the GPU, or choose a "
            "smaller model or a smaller expert format."
        )
    # Each figure in its own unit: the two can differ by orders of magnitude ("4 GB; 96 KB", not "0.0000916 GB").
    asked, got = size_auto(capacity * expert_bytes, BINARY), size_auto(fitted * expert_bytes, BINARY)
    return fitted, (
        f" The expert cache was set to {asked}; {got} fit next to the model on this GPU, so it holds {fitted} experts "
        "(Settings shows what fits)."
    )


def check_capacity(capacity: int, expert_bytes: int) -> None:
    """Refuse a cache with no slot, in a sentence that gives the size of one expert."""
    if capacity < 1:
        raise SettingRefused(
            f"The expert cache must hold at least one expert ({_size(expert_bytes)} for this model). Give it more "
            "room.",
            "cache_gb",
        )


def _size(n_bytes: float) -> str:
    return size_auto(n_bytes, BINARY) if n_bytes >= 1024 else f"{number(n_bytes)} bytes"


def map_bytes(num_layers: int, num_experts: int, embed_dim: int, sketch_dim: int) -> int:
    """RAM one expert map takes in the map store's arrays (maps.py, trajectory_index.py, semantic_index.py, map_links.py):
    [L, J] float32 probabilities, [L+1] prefix norms (float64 and float32), an [h] float32 embedding with its norm
    (float32) and flag (bool), a [k] float32 sketch column when h > k > 0, a request id, an insertion stamp and a
    successor link (int64 each). tests/test_cache_budget.py holds it to the arrays a store really allocates."""
    k = sketch_dim if 0 < sketch_dim < embed_dim else 0
    return num_layers * num_experts * 4 + (num_layers + 1) * 12 + embed_dim * 4 + 5 + k * 4 + 3 * 8


# A map of the smallest model there can be (one MoE layer of two experts, no embedding): before a model is loaded,
# a capacity is refused only when not even such maps would fit; the load checks the model's own size.
SMALLEST_MAP_BYTES = map_bytes(1, 2, 0, 0)


def map_room_bytes() -> int | None:
    """RAM the map store's arrays may take: half of what is available now, so that the replies, the rest of the app
    and other programs keep the other half; None where the platform does not say (nothing is refused)."""
    total, available = hardware.ram_bytes()
    return None if total <= 0 else available // 2


def check_store_capacity(
    capacity: int, bytes_per_map: int, room_bytes: int | None, whose: str = "for this model"
) -> None:
    """Refuse (SettingRefused, "store_capacity") a map store whose arrays would not fit `room_bytes`: allocating
    them would fail with the allocator's MemoryError, or swap the computer to a halt. `whose`: whose maps they are,
    for the sentence."""
    if room_bytes is None or capacity * bytes_per_map <= room_bytes:
        return
    fits = room_bytes // bytes_per_map
    raise SettingRefused(
        f"{capacity:,} expert maps do not fit in memory: one takes {_size(bytes_per_map)} {whose}, and at most "
        f"{fits:,} maps fit in the {_size(room_bytes)} of RAM they may use here (half of what is free now). Keep "
        f"{max(1, fits):,} or fewer maps.",
        "store_capacity",
    )


def kv_room_bytes(device: torch.device) -> int | None:
    """Bytes free where the KV cache lives: the GPU's free memory less the reserve the running request's KV cache
    and activations keep (hardware.KV_RESERVE_BYTES), or the RAM available on the CPU; None where the platform does
    not say."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(0, int(free) - KV_RESERVE_BYTES)
    total, available = hardware.ram_bytes()
    return None if total <= 0 else available


def kv_free_bytes(device: torch.device) -> int | None:
    """GPU memory a KV cache can grow into now: free memory plus what torch's allocator holds unused; None off a
    GPU, where the prefix cache's budget alone bounds it."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def prefix_budget_bytes(setting_gb: float | None, room_bytes: int | None) -> int:
    """What the kept prefixes' KV caches may take (RuntimeConfig.prefix_cache_gb): the setting, or automatically a
    quarter of `room_bytes` (kv_room_bytes after load) up to PREFIX_AUTO_MAX_GB (1 GB where the room is unknown).
    A setting over the room is refused (SettingRefused, "prefix_cache_gb"): kept prefixes would take the memory the
    running request's own KV cache needs."""
    if setting_gb is None:
        return int(GIB if room_bytes is None else min(room_bytes // 4, PREFIX_AUTO_MAX_GB * GIB))
    asked = int(setting_gb * GIB)
    if room_bytes is not None and asked > room_bytes:
        raise SettingRefused(
            f"The prefix cache was set to {setting_gb:g} GB, but only {room_bytes / GIB:.2f} GB are free where the KV "
            "cache lives after loading this model. Set it to less, or leave it on auto.",
            "prefix_cache_gb",
        )
    return asked
