"""Host stores of packed experts (expert_formats.py): what RAM and the cache slots hold when the format is int8, nf4
or mxfp4.

Scope: `PackedHostStore`, a tiered host store whose experts are stored packed and read through `view` (dequantised
where computed); `CheckpointPackedSource`, which reads one expert from the checkpoint into its packed form —
MXFP4 rows as the checkpoint holds them (never dense), a bitsandbytes nf4 checkpoint's code bytes and block scales
(bnb_checkpoint.py), bf16/fp32 rows quantised as they are read; and
`build_packed_host`, which puts int8/nf4 experts through the quantise-on-load cache (quant_cache.py). It does NOT
decide the format (loading.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial

import torch

from fmoe_local import bnb_checkpoint, dtype_verdicts, expert_formats
from fmoe_local.architectures import ConcatRows, ExpertSource, Mxfp4Row
from fmoe_local.config import RuntimeConfig
from fmoe_local.expert_formats import PackedParam, PackedRows
from fmoe_local.host import CheckpointFiles, TieredHostStore, read_expert
from fmoe_local.quant_cache import CopyNotKept, CpuLayout, Progress, QuantCache

log = logging.getLogger(__name__)

Fetch = Callable[[int, int], dict[str, torch.Tensor]]


class PackedHostStore(TieredHostStore):
    """Experts stored in `fmt` ({stored key: tensor}, expert_formats.stored_shapes); `view(rows)` dequantises."""

    def __init__(
        self,
        fetch: Fetch,
        params: Mapping[str, PackedParam],
        fmt: str,
        num_layers: int,
        num_experts: int,
        dtype: torch.dtype,
        host_ram_gb: float | None = None,
        on_close: Callable[[], None] = lambda: None,
        products: bool = False,
        fetched_in_layout: bool = False,
    ) -> None:
        self.params = dict(params)
        # A CPU device: int8/int4 computed by torch's products on the stored form, int4 held in torch's CPU layout —
        # converted as each expert is read unless `fetch` gives it so already (a copy that keeps it: quant_cache.py).
        self.products = products and expert_formats.has_products(self.params)
        self._convert = self.products and not fetched_in_layout
        self.expert_format = fmt
        self._fetch_fn = fetch
        self._on_close = on_close
        self.quant_cache: QuantCache | None = None  # where int8/nf4 experts were read from (None: not cached)
        self.notice = ""  # a sentence for the user about this load (the copy could not be kept), or ""
        stored = expert_formats.stored_shapes(self.params, dtype)
        super().__init__(
            num_layers,
            num_experts,
            {k: shape for k, (shape, _) in stored.items()},
            dtype,
            host_ram_gb,
            {k: d for k, (_, d) in stored.items()},
        )

    @property
    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: p.shape for name, p in self.params.items()}

    def _fetch(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        rows = self._fetch_fn(layer, expert)
        return expert_formats.to_cpu_layout(self.params, rows) if self._convert else rows

    def land(self, slot: Mapping[str, torch.Tensor]) -> None:
        """A copy of one expert landed in a device slot: on a GPU, int4 codes go into torch's CUDA layout there."""
        expert_formats.to_cuda_layout(self.params, slot, self.param_dtype)

    def view(self, rows: Mapping[str, torch.Tensor]) -> PackedRows:
        return PackedRows(rows, self.params, self.param_dtype, self.products)

    def close(self) -> None:
        super().close()
        self._on_close()


class CheckpointPackedSource:
    """One expert of the checkpoint in its packed form: MXFP4 parameters as their checkpoint rows, every other
    packed parameter quantised from its dense rows (read as stored: the packer converts a block at a time), dense
    ones in the compute dtype."""

    def __init__(
        self,
        files: CheckpointFiles,
        sources: list[list[Mapping[str, ExpertSource]]],
        params: Mapping[str, PackedParam],
        dtype: torch.dtype,
    ) -> None:
        self.files, self.sources, self.params, self.dtype = files, sources, params, dtype

    def __call__(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, param in self.params.items():
            src = self.sources[layer][expert][name]
            if param.fmt == "mxfp4":
                if not isinstance(src, Mxfp4Row):
                    raise ValueError(f"'{name}' is not MXFP4 in this checkpoint; choose another expert format.")
                out[f"{name}.blocks"] = self.files.get_row(src.blocks_key, src.expert).contiguous()
                out[f"{name}.scales"] = self.files.get_row(src.scales_key, src.expert).contiguous()
                continue
            if param.fmt == "nf4" and _bnb_packed({name: src}, self.files):
                # bitsandbytes nf4 is our nf4: its code bytes and block scales are used as they are.
                q, absmax, shape = bnb_checkpoint.read_concat_nf4(self.files, src.keys)
                if shape != param.shape:
                    raise ValueError(f"'{src.keys[0]}' is {shape} in the checkpoint; the model expects {param.shape}.")
                out[f"{name}.q"], out[f"{name}.absmax"] = q, absmax
                continue
            wanted = self.dtype if param.fmt == "dense" else None  # a packer converts block by block
            dense = read_expert(self.files, {name: src}, wanted)[name]
            for part, t in expert_formats.pack(param, dense, self.dtype).items():
                out[expert_formats.part_key(name, part)] = t
        return out


def resolve_format(chosen: str, sources: list[list[Mapping[str, ExpertSource]]], files: CheckpointFiles) -> str:
    """The stored format: `auto` is the checkpoint's own (mxfp4 for MXFP4 experts, nf4 for a bitsandbytes 4-bit
    checkpoint, else bf16)."""
    if chosen != "auto":
        return chosen
    first = sources[0][0] if sources and sources[0] else {}
    if any(isinstance(src, Mxfp4Row) for src in first.values()):
        return "mxfp4"
    return "nf4" if _bnb_packed(first, files) else "bf16"


def _bnb_packed(sources: Mapping[str, ExpertSource], files: CheckpointFiles) -> bool:
    return any(
        isinstance(src, ConcatRows) and all(bnb_checkpoint.is_quantised(files, k) for k in src.keys)
        for src in sources.values()
    )


def build_packed_host(
    files: CheckpointFiles,
    sources: list[list[Mapping[str, ExpertSource]]],
    param_shapes: Mapping[str, tuple[int, ...]],
    dtype: torch.dtype,
    fmt: str,
    transposed: bool,
    config: RuntimeConfig,
    progress: Progress | None = None,
    products: bool = False,
) -> PackedHostStore:
    """The packed host store of a checkpoint in `fmt`. MXFP4 is read packed from the checkpoint; int8 and nf4 come
    from the quantise-on-load cache (built on the first load, quant_cache.py) or, when it cannot be kept (no room
    on the disk, a folder that refuses it), are quantised in memory for this load only, and the store's `notice`
    tells the user why and what to do. `products`: the experts are computed on a CPU device (PackedHostStore), whose
    copy keeps int4 in torch's CPU layout."""
    params = expert_formats.layout(fmt, param_shapes, transposed)
    fetch: Fetch = CheckpointPackedSource(files, sources, params, dtype)
    on_close = files.close
    cache = None
    notice = ""
    layout = None
    if products and fmt == "int4" and expert_formats.has_products(params):
        layout = CpuLayout(dtype_verdicts.torch_cpu_key(), partial(expert_formats.to_cpu_layout, params))
    if fmt in ("int8", "int4", "nf4") and not (fmt == "nf4" and _bnb_packed(sources[0][0], files)):
        cache = QuantCache(config.quant_cache_dir, files.model_dir, fmt, dtype, len(sources), layout)
        stored = expert_formats.stored_shapes(params, dtype)
        expert_bytes = sum(torch.Size(shape).numel() * d.itemsize for shape, d in stored.values())
        try:
            cache.build(fetch, len(sources[0]), expert_bytes, progress)
        except CopyNotKept as exc:
            log.warning("%s Quantising in memory for this load.", exc)
            notice = (
                f" {exc.why}. This load quantised the experts in memory instead, and so will every load (minutes "
                f"each) until you {exc.advice}"
            )
            if cache.reported and progress is not None:
                progress(0, 0)  # no copy counted any more: the bar goes back to the plain "loading…" line
            cache = None
    if cache is not None:
        keys = list(expert_formats.stored_shapes(params, dtype))
        fetch = partial(_read_cached, cache, keys)
        on_close = partial(_close_both, cache, files)
    in_layout = cache is not None and layout is not None
    host = PackedHostStore(
        fetch, params, fmt, len(sources), len(sources[0]), dtype, config.host_ram_gb, on_close, products, in_layout
    )
    host.quant_cache, host.notice = cache, notice
    return host


def _read_cached(cache: QuantCache, keys: list[str], layer: int, expert: int) -> dict[str, torch.Tensor]:
    return cache.read(layer, expert, keys)


def _close_both(cache: QuantCache, files: CheckpointFiles) -> None:
    cache.close()
    files.close()
