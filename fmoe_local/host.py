"""Host store: every routed expert's weights on the host, one expert at a time.

Scope: reading a safetensors checkpoint (single file or sharded with an index) tensor by tensor or row by row, and
serving `read(layer, expert)` in the layout of one row of the model's fused experts parameters, in the compute
dtype. Experts that fit in `host_ram_gb` are held in RAM (the first in (layer, expert) order; None at load means what
hardware.host_ram_budget_gb leaves, loading.py); the rest are read from the checkpoint files on each `read`
(positioned reads, never a memory map: safetensors_file.py). `read` may raise and may block: the cache bounds both.
`TieredHostStore` holds the two tiers over any per-expert reader; `CheckpointHostStore` is the dense one,
packed_host.py's the packed formats'. On a GPU, `pin` moves RAM experts into page-locked blocks, as many as
`pinned_ram_gb` allows (pinning everything would starve the rest of a consumer machine): a copy from them goes
straight to the device; the cache stages the others (copier.py).
It does NOT touch the device, the cache or the model.

Shapes per expert, e.g. Mixtral: gate_up_proj [2I, H] (= cat([w1, w3])), down_proj [H, I]; GPT-OSS: gate_up_proj
[H, 2I], gate_up_proj_bias [2I], down_proj [I, H], down_proj_bias [H].
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Protocol, runtime_checkable

import torch

from fmoe_local.architectures import ConcatRows, ExpertSource, FusedRow, Mxfp4Row
from fmoe_local.safetensors_file import SafetensorsFile

log = logging.getLogger(__name__)

GIB = 1024**3
_ALIGN = 64  # bytes: each tensor of a pinned block starts on a cache line, so any dtype's view is aligned
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# MXFP4 (OCP microscaling): 4-bit E2M1 codes, low nibble first, one shared power-of-two scale (bias 127) per 32.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 → dense. blocks [..., G, B] uint8 (2 codes per byte), scales [..., G] uint8 → [..., G * 2B]."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match.")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 2B]
    values = torch.ldexp(lut[codes], scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)


class CheckpointFiles:
    """The safetensors files of a checkpoint: key → file, lazily opened handles, thread-safe reads into memory we own
    (safetensors_file.py says why nothing is memory-mapped)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            self.key_file: dict[str, str] = dict(weight_map)
        elif (self.model_dir / SINGLE_FILE).exists():
            single = SafetensorsFile(self.model_dir / SINGLE_FILE)
            self.key_file = dict.fromkeys(single.keys(), SINGLE_FILE)
        else:
            raise FileNotFoundError(
                f"No safetensors weights in {self.model_dir} (expected {SINGLE_FILE} or {INDEX_FILE}). "
                "Download the model again, in safetensors format."
            )
        missing = {f for f in set(self.key_file.values()) if not (self.model_dir / f).exists()}
        if missing:
            raise FileNotFoundError(
                f"The checkpoint in {self.model_dir} is incomplete: {', '.join(sorted(missing))} missing. "
                "Download the model again."
            )
        self._handles: dict[str, SafetensorsFile] = {}
        if (self.model_dir / SINGLE_FILE).exists() and not index.exists():
            self._handles[SINGLE_FILE] = single
        self._lock = threading.Lock()  # guards the handle table; reads themselves run in parallel

    def keys(self) -> Iterable[str]:
        return self.key_file.keys()

    def __contains__(self, key: str) -> bool:
        return key in self.key_file

    def _handle(self, key: str) -> SafetensorsFile:
        name = self.key_file[key]
        with self._lock:
            handle = self._handles.get(name)
            if handle is None:
                handle = SafetensorsFile(self.model_dir / name)
                self._handles[name] = handle
            return handle

    def get(self, key: str) -> torch.Tensor:
        """The whole tensor `key` (CPU)."""
        return self._handle(key).get(key)

    def get_row(self, key: str, index: int) -> torch.Tensor:
        """Row `index` of tensor `key` along dim 0, without reading the other rows."""
        return self._handle(key).get_row(key, index)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._handle(key).shape(key)

    def dtype_name(self, key: str) -> str:
        return self._handle(key).dtype_name(key)

    def files_keys(self) -> dict[str, list[str]]:
        """Keys grouped by file, in file order: reading file by file keeps page-cache use sequential."""
        grouped: dict[str, list[str]] = {}
        for key, name in self.key_file.items():
            grouped.setdefault(name, []).append(key)
        return dict(sorted(grouped.items()))

    def close(self) -> None:
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()


def read_expert(files: CheckpointFiles, sources: Mapping[str, ExpertSource], dtype: torch.dtype | None) -> dict:
    """Assemble one expert's rows {param: tensor} from the checkpoint, in `dtype`. None, for a packer (which
    converts a cache-sized block at a time, expert_formats.pack): plain rows in their stored float dtype, decoded
    ones (MXFP4, bitsandbytes 4-bit) in float32, and rows the checkpoint splits (gate and up) as the list of their
    parts: a whole Mixtral expert read as float32, or concatenated, cost more CPU time than packing it."""
    decoded = torch.float32 if dtype is None else dtype
    out = {}
    for name, src in sources.items():
        if isinstance(src, ConcatRows):
            parts = [_dense(files, k, decoded) for k in src.keys]
            if dtype is None and len(parts) > 1:
                out[name] = [p.contiguous() for p in parts]
                continue
            row = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        elif isinstance(src, FusedRow):
            row = files.get_row(src.key, src.expert)
        elif isinstance(src, Mxfp4Row):
            dense = dequantize_mxfp4(
                files.get_row(src.blocks_key, src.expert), files.get_row(src.scales_key, src.expert), decoded
            )
            dense = dense.reshape(dense.shape[0], -1)  # [out, in]
            row = dense.t() if src.transpose else dense
        else:  # pragma: no cover - ExpertSource is closed
            raise TypeError(f"unknown expert source {src!r}")
        out[name] = (row if dtype is None else row.to(dtype)).contiguous()
    return out


def _block_layout(rows: Mapping[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """Byte offset of each of an expert's tensors inside its stretch of a pinned block, and the stretch's size."""
    offsets, at = {}, 0
    for name, t in rows.items():
        offsets[name] = at
        at += -(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN
    return offsets, at


def _dense(files: CheckpointFiles, key: str, dtype: torch.dtype) -> torch.Tensor:
    from fmoe_local import bnb_checkpoint  # a bitsandbytes 4-bit checkpoint read unquantised (format bf16)

    return bnb_checkpoint.dequantize(files, key, dtype) if bnb_checkpoint.is_quantised(files, key) else files.get(key)


@runtime_checkable
class HostStore(Protocol):
    """What the runtime needs from the host side: experts by (MoE layer, expert), one fused-parameter row each.

    The members with a body are capabilities only some stores have, with the answer of a store that lacks them: a
    store subclasses HostStore to inherit these defaults, so callers call every member directly.
    """

    num_layers: int
    num_experts: int
    param_shapes: dict[str, tuple[int, ...]]
    param_dtype: torch.dtype
    expert_bytes: int
    # A stored tensor's dtype where it is not `param_dtype` (packed formats: codes and scales); none by default.
    param_dtypes: Mapping[str, torch.dtype] = MappingProxyType({})
    expert_format: str = "bf16"  # how the experts are stored (expert_formats.py)
    notice: str = ""  # a sentence for the user about how this store was built, or ""

    def read(self, layer: int, expert: int) -> dict[str, torch.Tensor]: ...

    def close(self) -> None: ...

    @property
    def dense_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """One expert's parameters as the model computes with them (a dense store: as stored)."""
        return self.param_shapes

    def view(self, rows: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The expert's parameters as the compute paths read them (a dense store: the stored rows)."""
        return rows

    def in_ram(self, layer: int, expert: int) -> bool:
        """Whether a read of this expert is served from RAM; a store that does not say may read the disk, so its
        reads are bounded by a deadline (cpu_experts.HostExperts)."""
        return False

    def pin(
        self,
        budget_bytes: int,
        register: Callable[[torch.Tensor], None],
        unregister: Callable[[torch.Tensor], None],
    ) -> int:
        """Page-lock RAM experts within `budget_bytes`; returns the bytes pinned (a store without a RAM tier: 0)."""
        return 0

    def land(self, slot: Mapping[str, torch.Tensor]) -> None:
        """A copy of one expert landed in a device slot: rewrite it in place into the device's layout, on the copy
        stream (copier.Copier.copy); a store whose stored layout is the device's does nothing."""


class TieredHostStore(HostStore):
    """The RAM tier and the disk tier of a host store, over `_fetch(layer, expert)` (one expert as stored).

    Which experts are RAM-resident is decided once: the first ones in (layer, expert) order until `host_ram_gb` is
    spent; the rest are fetched on each read. `param_dtypes` gives a stored tensor's dtype when it is not the compute
    dtype (packed formats, expert_formats.py); `view(rows)` is what the compute paths read the stored tensors through
    (dense: the rows themselves).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        param_shapes: Mapping[str, tuple[int, ...]],
        dtype: torch.dtype,
        host_ram_gb: float | None = None,
        param_dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.param_shapes = {k: tuple(v) for k, v in param_shapes.items()}
        self.param_dtype = dtype
        self.param_dtypes = {k: (param_dtypes or {}).get(k, dtype) for k in self.param_shapes}
        self.expert_bytes = sum(
            int(torch.Size(s).numel()) * torch.empty((), dtype=self.param_dtypes[k]).element_size()
            for k, s in self.param_shapes.items()
        )
        total = self.num_layers * self.num_experts
        budget = total if host_ram_gb is None else min(total, int(host_ram_gb * GIB // max(self.expert_bytes, 1)))
        self._ram: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._ram_bytes: int | None = None  # counted on first ask (ram_bytes)
        self._pinned: list[torch.Tensor] = []  # page-locked blocks the RAM experts live in (`pin`)
        self._unregister: Callable[[torch.Tensor], None] | None = None
        for i in range(budget):
            key = divmod(i, self.num_experts)
            self._ram[key] = self._read_checked(*key)

    def _fetch(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @property
    def ram_experts(self) -> int:
        """How many experts are held in RAM (the rest are read from disk on each read)."""
        return len(self._ram)

    def ram_bytes(self) -> int:
        """Bytes of expert weights held in RAM (which experts is decided at load, so counted once)."""
        if self._ram_bytes is None:
            self._ram_bytes = sum(t.numel() * t.element_size() for rows in self._ram.values() for t in rows.values())
        return self._ram_bytes

    def in_ram(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._ram

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the page-locked blocks RAM experts live in (0 until `pin`)."""
        return sum(b.numel() for b in self._pinned)

    def pin(
        self,
        budget_bytes: int,
        register: Callable[[torch.Tensor], None],
        unregister: Callable[[torch.Tensor], None],
    ) -> int:
        """Move RAM experts into page-locked blocks, in (layer, expert) order, while `budget_bytes` lasts; returns
        the bytes pinned. One block per MoE layer, registered in place by `register` (copier.CudaStreams: a few
        large regions for the driver, not thousands of small ones, and no rounding up as a pinned allocator does).
        Each block is filled before the expert's unpinned tensors are dropped, so RAM use grows by one layer at
        most. A block that cannot be registered stays as plain memory (copies from it are staged) and pinning
        stops there. Call once, before the store is shared with other threads."""
        if self._pinned:
            raise RuntimeError("This host store is already pinned.")
        self._unregister = unregister
        pinned = 0
        for layer in range(self.num_layers):
            keys = [(layer, e) for e in range(self.num_experts) if (layer, e) in self._ram]
            if not keys:
                continue
            offsets, stride = _block_layout(self._ram[keys[0]])
            keys = keys[: max(0, budget_bytes - pinned) // stride]
            if not keys:
                break
            block = torch.empty(stride * len(keys), dtype=torch.uint8)
            moved = {}
            for i, key in enumerate(keys):
                moved[key] = {}
                for name, t in self._ram[key].items():
                    start = i * stride + offsets[name]
                    view = block[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                    view.copy_(t)
                    moved[key][name] = view
            try:
                register(block)
            except Exception:  # noqa: BLE001 - pinning is a speed-up: keep the plain memory, stage its copies
                log.warning(
                    "could not page-lock %d MB of expert weights; copies from them are staged",
                    block.numel() >> 20,
                    exc_info=True,
                )
                self._ram.update(moved)
                break
            self._ram.update(moved)
            self._pinned.append(block)
            pinned += block.numel()
        return pinned

    def _read_checked(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        rows = self._fetch(layer, expert)
        for name, shape in self.param_shapes.items():
            got = tuple(rows[name].shape)
            if got != shape:
                raise ValueError(
                    f"Expert {expert} of MoE layer {layer}: '{name}' has shape {got} in the checkpoint, the model "
                    f"expects {shape}. The checkpoint does not match its config.json: download the model again."
                )
        return rows

    def read(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """{param_name: CPU tensor} for (MoE layer, expert). Safe to call from any thread; do not modify the result."""
        rows = self._ram.get((layer, expert))
        if rows is not None:
            return rows
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise IndexError(f"No expert ({layer}, {expert}): {self.num_layers} MoE layers × {self.num_experts}.")
        return self._read_checked(layer, expert)

    def close(self) -> None:
        self._ram.clear()
        while self._pinned:
            block = self._pinned.pop()
            try:
                self._unregister(block)
            except Exception:  # noqa: BLE001 - closing: the memory is released with the process anyway
                log.warning("could not unregister a page-locked block", exc_info=True)


class CheckpointHostStore(TieredHostStore):
    """HostStore over a safetensors checkpoint, experts dense in the compute dtype: a RAM tier for what fits in
    `host_ram_gb`, a disk tier for the rest.

    `sources[l][e]` says how to read expert e of MoE layer l (see architectures.expert_sources).
    """

    def __init__(
        self,
        files: CheckpointFiles,
        sources: list[list[Mapping[str, ExpertSource]]],
        param_shapes: Mapping[str, tuple[int, ...]],
        dtype: torch.dtype,
        host_ram_gb: float | None = None,
    ) -> None:
        self._files = files
        self._sources = sources
        super().__init__(len(sources), len(sources[0]) if sources else 0, param_shapes, dtype, host_ram_gb)

    def _fetch(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        return read_expert(self._files, self._sources[layer][expert], self.param_dtype)

    def close(self) -> None:
        super().close()
        self._files.close()
