"""Expert formats: how a routed expert's weights are stored in host RAM and in the cache slots, and how a stored
expert becomes dense weights where it is computed.

Scope: the formats (`bf16` = unquantised, in the compute dtype; `int8`; `nf4`; `mxfp4`, GPT-OSS's own), packing a
dense [out, in] weight into a format's parts and back, the size of one packed expert, and `PackedRows`, the mapping
the compute paths read weights through (it dequantises one parameter when the expert reads it). It does NOT read
checkpoints (packed_host.py, quant_cache.py), choose where an expert is computed, or touch the cache.

Parts of a packed parameter `name` are stored under `name.<part>`; biases and other 1-D parameters stay in the
compute dtype under their own name. Shapes per parameter of n = out·in weights (dense shape [a, b] as the model
holds one expert's row, e.g. gate_up_proj [2I, H]):
- int8: `q` int8 [a, b], `scale` float32 [a]: w = q · scale (symmetric, per row of the stored layout).
- nf4: `q` uint8 [ceil(n/2)], `absmax` float32 [ceil(n/64)]: the flattened weights in blocks of 64, each block
  scaled by its largest magnitude onto the 16 NormalFloat4 levels; two codes per byte, the first in the high nibble
  (bitsandbytes' layout and its NF4 table, so a bitsandbytes nf4 checkpoint's bytes are used as they are).
- mxfp4: `blocks` uint8 [o, G, 16], `scales` uint8 [o, G] (the checkpoint's own rows, OCP MX: E2M1 codes, low
  nibble first, a power-of-two scale per 32); GPT-OSS holds the dense row transposed ([in, out]), so `o` is the
  dense row's last dimension.

Exactness: dequantising computes in float32 and casts once to the compute dtype, so the same packed bytes always
give the same dense weights; the runtime then runs eager's own ops on them. "Lossless" for a quantised format means
the offloaded model equals transformers eager on these dequantised weights, not the bf16 model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from fmoe_local.config import EXPERT_FORMATS
from fmoe_local.host import dequantize_mxfp4

Tensor = torch.Tensor

FORMATS = EXPERT_FORMATS  # what a user chooses; mxfp4 is what auto picks for an MXFP4 checkpoint
PACKED = ("int8", "nf4", "mxfp4")
NF4_BLOCK = 64
# bitsandbytes' NormalFloat4 levels (bitsandbytes/functional.py, get_4bit_type("nf4")), ascending.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
# Bits per weight of each format, scales included (int8's per-row scale is negligible for real rows): sizes of
# models that are not loaded (catalog, fit estimates, replay presets) are derived from these.
BITS = {"bf16": 16.0, "int8": 8.0, "nf4": 4.0 + 32 / NF4_BLOCK, "mxfp4": 4.0 + 8 / 32}
LABELS = {
    "auto": "Auto: the checkpoint's own form (bf16 stays bf16, MXFP4 stays MXFP4, a 4-bit download stays 4-bit)",
    "bf16": "bf16: full size, the model's exact answers",
    "int8": "8-bit: ~2× smaller, nearly the same answers",
    "nf4": "4-bit: ~4× smaller, slightly different answers",
    "mxfp4": "MXFP4 (GPT-OSS's own 4-bit): ~4× smaller, the released model's answers",
}

# Short names for places with no room for a label (a table column, a status line).
NAMES = {"auto": "Auto", "bf16": "bf16", "int8": "8-bit", "nf4": "4-bit", "mxfp4": "MXFP4"}


def bytes_per_expert(dense_bf16_bytes: int, fmt: str) -> int:
    """Size of one expert in `fmt` from its bf16 size (an estimate for models that are not loaded)."""
    if fmt == "auto":
        fmt = "bf16"
    if fmt not in BITS:
        raise ValueError(f"No size for expert format '{fmt}'. Known formats: {', '.join(BITS)}.")
    return int(round(dense_bf16_bytes * BITS[fmt] / 16))


# ---- packing ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedParam:
    """How one parameter of an expert is stored: `fmt` (or "dense"), its dense shape, and (mxfp4) whether the
    dense row is the transpose of the stored one."""

    fmt: str
    shape: tuple[int, ...]
    transpose: bool = False

    def parts(self, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{part suffix ("" for a dense parameter): (shape, dtype)} of one expert's stored parameter."""
        n = math.prod(self.shape)
        if self.fmt == "dense":
            return {"": (self.shape, dtype)}
        if self.fmt == "int8":
            return {"q": (self.shape, torch.int8), "scale": (self.shape[:1], torch.float32)}
        if self.fmt == "nf4":
            return {"q": (((n + 1) // 2,), torch.uint8), "absmax": ((-(-n // NF4_BLOCK),), torch.float32)}
        if self.fmt == "mxfp4":
            out = self.shape[-1] if self.transpose else self.shape[0]
            groups = (n // out) // 32
            return {"blocks": ((out, groups, 16), torch.uint8), "scales": ((out, groups), torch.uint8)}
        raise ValueError(f"Unknown expert format '{self.fmt}'.")


def part_key(name: str, part: str) -> str:
    return f"{name}.{part}" if part else name


def layout(fmt: str, param_shapes: Mapping[str, tuple[int, ...]], transposed: bool = False) -> dict[str, PackedParam]:
    """How each expert parameter is stored in `fmt`: 2-D weights packed, biases dense."""
    if fmt != "bf16" and fmt not in PACKED:
        raise ValueError(f"Unknown expert format '{fmt}'. Known: bf16, {', '.join(PACKED)}.")
    out = {}
    for name, shape in param_shapes.items():
        packed = fmt != "bf16" and len(shape) == 2
        out[name] = PackedParam(fmt if packed else "dense", tuple(shape), transposed and packed)
    return out


def stored_shapes(
    params: Mapping[str, PackedParam], dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{stored key: (shape, dtype)} of one expert: what the host store holds and a cache slot allocates."""
    return {part_key(n, s): v for n, p in params.items() for s, v in p.parts(dtype).items()}


def pack_int8(w: Tensor) -> dict[str, Tensor]:
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"q": q.contiguous(), "scale": scale.contiguous()}


def pack_nf4(w: Tensor) -> dict[str, Tensor]:
    flat = w.float().reshape(-1)
    n = flat.numel()
    blocks = -(-n // NF4_BLOCK)
    padded = torch.zeros(blocks * NF4_BLOCK, dtype=torch.float32)
    padded[:n] = flat
    padded = padded.view(blocks, NF4_BLOCK)
    absmax = padded.abs().amax(1)
    normed = padded / absmax.clamp(min=1e-12)[:, None]
    code = torch.tensor(NF4_CODE, dtype=torch.float32)
    # Nearest level: the midpoints between ascending levels split the line into 16 bins.
    q = torch.bucketize(normed.reshape(-1)[:n], (code[1:] + code[:-1]) / 2).to(torch.uint8)
    if n % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return {"q": ((q[0::2] << 4) | q[1::2]).contiguous(), "absmax": absmax.contiguous()}


def pack(param: PackedParam, dense: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """One parameter's stored parts ({stored key: tensor}) from its dense row (any float dtype)."""
    if param.fmt == "dense":
        return {"": dense.to(dtype).contiguous()}
    if param.fmt == "int8":
        return pack_int8(dense)
    if param.fmt == "nf4":
        return pack_nf4(dense)
    raise ValueError(f"Experts are not packed into '{param.fmt}' here; it is read packed from the checkpoint.")


def pack_expert(params: Mapping[str, PackedParam], dense: Mapping[str, Tensor], dtype: torch.dtype) -> dict:
    """{stored key: tensor} of one expert from its dense rows."""
    return {part_key(n, s): t for n, p in params.items() for s, t in pack(p, dense[n], dtype).items()}


# ---- dequantising ----------------------------------------------------------------------------------------------------
_codes: dict[torch.device, Tensor] = {}


def _nf4_code(device: torch.device) -> Tensor:
    code = _codes.get(device)
    if code is None:
        code = _codes[device] = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
    return code


def unpack(param: PackedParam, parts: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
    """The dense row of one parameter (float32 arithmetic, one cast to `dtype`), on the parts' device."""
    if param.fmt == "int8":
        q, scale = parts["q"], parts["scale"]
        return (q.float() * scale[:, None]).to(dtype)
    if param.fmt == "nf4":
        q, absmax = parts["q"], parts["absmax"]
        n = math.prod(param.shape)
        codes = torch.stack([q >> 4, q & 0x0F], dim=-1).reshape(-1)[:n].long()  # [n]
        values = _nf4_code(q.device)[codes]
        blocks = -(-n // NF4_BLOCK)
        if n % NF4_BLOCK:
            values = torch.cat([values, values.new_zeros(blocks * NF4_BLOCK - n)])
        values = (values.view(blocks, NF4_BLOCK) * absmax[:, None]).reshape(-1)[:n]
        return values.view(param.shape).to(dtype)
    if param.fmt == "mxfp4":
        dense = dequantize_mxfp4(parts["blocks"], parts["scales"], torch.float32)  # [o, G·32]
        dense = dense.reshape(dense.shape[0], -1)
        return (dense.t() if param.transpose else dense).to(dtype)
    raise ValueError(f"Unknown packed format '{param.fmt}'.")


class PackedRows(Mapping[str, Tensor]):
    """One stored expert read as dense parameters: a packed parameter is dequantised when the expert reads it (once
    per read: the dense copy lives only while the product needs it)."""

    __slots__ = ("_stored", "_params", "_dtype")

    def __init__(self, stored: Mapping[str, Tensor], params: Mapping[str, PackedParam], dtype: torch.dtype) -> None:
        self._stored, self._params, self._dtype = stored, params, dtype

    def __getitem__(self, name: str) -> Tensor:
        param = self._params[name]
        if param.fmt == "dense":
            return self._stored[name]
        parts = {s: self._stored[part_key(name, s)] for s in param.parts(self._dtype)}
        return unpack(param, parts, self._dtype)

    def __contains__(self, name: object) -> bool:
        return name in self._params

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)
