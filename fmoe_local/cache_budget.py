"""How many expert slots a cache budget buys, and the refusal of a cache with none.

Scope: the arithmetic between a size in GB and a slot count, for whoever sizes an expert cache (engine.py, `bench
live`) and for the cache itself (cache.py checks its own capacity). It does NOT allocate anything.
"""

from __future__ import annotations

import torch

from fmoe_local.hardware import GIB, KV_RESERVE_BYTES


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
    asked, got = capacity * expert_bytes / GIB, fitted * expert_bytes / GIB
    if fitted < 1:
        raise ValueError(
            f"The GPU has {room_bytes / GIB:.2f} GB left for the expert cache after the model's resident part, less "
            f"than one expert ({expert_bytes / GIB:.2f} GB). Close other programs that use the GPU, or choose a "
            "smaller model or a smaller expert format."
        )
    return fitted, (
        f" The expert cache was set to {asked:.1f} GB; {got:.1f} GB fit next to the model on this GPU, so it holds "
        f"{fitted} experts (Settings shows what fits)."
    )


def check_capacity(capacity: int, expert_bytes: int) -> None:
    """Refuse a cache with no slot, in a sentence that gives the size of one expert."""
    if capacity < 1:
        unit, scale = next(
            (u, f) for u, f in (("GB", GIB), ("MB", 1024**2), ("KB", 1024), ("bytes", 1)) if expert_bytes >= f
        )
        size = f"{expert_bytes / scale:.3g} {unit}"
        raise SettingRefused(
            f"The expert cache must hold at least one expert ({size} for this model). Give it more room.", "cache_gb"
        )
