"""Expert formats: how a routed expert's weights are stored in host RAM and in the cache slots, and how a stored
expert becomes dense weights where it is computed.

Scope: the formats (`bf16` = unquantised, in the compute dtype; `int8`; `int4`; `nf4`; `mxfp4`, GPT-OSS's own),
packing a dense [out, in] weight into a format's parts and back, the size of one packed expert, and `PackedRows`,
the mapping the compute paths read weights through (it dequantises one parameter when the expert reads it). It does
NOT read checkpoints (packed_host.py, quant_cache.py), choose where an expert is computed, or touch the cache.

Parts of a packed parameter `name` are stored under `name.<part>`; biases and other 1-D parameters stay in the
compute dtype under their own name. Shapes per parameter of n = out·in weights (dense shape [a, b] as the model
holds one expert's row, e.g. gate_up_proj [2I, H]):
- int8: `q` int8 [a, b], `scale` float32 [a]: w = q · scale (symmetric, per row of the stored layout).
- int4: `q` uint8 [a, b/2], `sz` [b/g, a, 2] in the compute dtype (g = INT4_GROUP, or 32 where b is not a multiple
  of it): asymmetric 4-bit per group of g along b, w = (code − 8) · scale + zero with (scale, zero) = sz[b/g, a],
  two codes per byte along b, the first in the low nibble — the function torch's weight-only int4 products compute,
  so a CPU runs them on it (`products`); on a CPU device RAM holds `q` in torch's CPU layout instead
  (`Int4Weight.from_portable`), which only those products read.
- nf4: `q` uint8 [ceil(n/2)], `absmax` float32 [ceil(n/64)]: the flattened weights in blocks of 64, each block
  scaled by its largest magnitude onto the 16 NormalFloat4 levels; two codes per byte, the first in the high nibble
  (bitsandbytes' layout and its NF4 table, so a bitsandbytes nf4 checkpoint's bytes are used as they are).
- mxfp4: `blocks` uint8 [o, G, 16], `scales` uint8 [o, G] (the checkpoint's own rows, OCP MX: E2M1 codes, low
  nibble first, a power-of-two scale per 32); GPT-OSS holds the dense row transposed ([in, out]), so `o` is the
  dense row's last dimension.

Exactness: dequantising computes in float32 and casts once to the compute dtype, so the same packed bytes always
give the same dense weights; the runtime then runs eager's own ops on them. "Lossless" for a quantised format means
the offloaded model equals transformers eager on these dequantised weights, not the bf16 model.

Where a packed expert is multiplied without a dense copy (`PackedRows`): on a CPU device int8 and int4 parameters
are read as torch's weight-only product operands (Int8Weight, Int4Weight; int4 held in RAM in torch's CPU layout,
made once per machine and kept on disk under a key of what it depends on: quant_cache.CpuLayout); on a CUDA GPU
of compute capability 8.0 or later computing in bf16, an int4 cache hit is multiplied by torch's CUDA int4 product
(Int4CudaWeight, tinygemm) on the layout `to_cuda_layout` makes in place when the copy lands (RAM and the disk keep
the portable bytes). Every other case dequantises.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from fmoe_local.config import EXPERT_FORMATS
from fmoe_local.host import dequantize_mxfp4

Tensor = torch.Tensor

FORMATS = EXPERT_FORMATS  # what a user chooses; mxfp4 is what auto picks for an MXFP4 checkpoint
PACKED = ("int8", "int4", "nf4", "mxfp4")
NF4_BLOCK = 64
INT4_GROUP = 64  # weights per int4 scale and zero: 4.5 bits per weight with bf16 ones, as nf4's 64-blocks
# Rows per step of torch's CPU int4 layout: a multiple of the row blocks its layout uses (16 to 64 by vector width).
INT4_LAYOUT_ROWS = 64
# bitsandbytes' NormalFloat4 levels (bitsandbytes/functional.py, get_4bit_type("nf4")), ascending.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
# Bits per weight of each format, scales included (int8's per-row scale is negligible for real rows): sizes of
# models that are not loaded (catalog, fit estimates, replay presets) are derived from these.
BITS = {"bf16": 16.0, "int8": 8.0, "int4": 4.0 + 32 / INT4_GROUP, "nf4": 4.0 + 32 / NF4_BLOCK, "mxfp4": 4.0 + 8 / 32}
INT4_FLOAT32_BITS = 4.0 + 64 / INT4_GROUP  # int4 with its scale and zero in float32: a CPU that computes in float32
LABELS = {
    "auto": "Auto: the checkpoint's own form (bf16 stays bf16, MXFP4 stays MXFP4, a 4-bit download stays 4-bit)",
    "bf16": "bf16: full size, the model's exact answers",
    "int8": "8-bit: ~2× smaller, nearly the same answers",
    "int4": "4-bit int4 (groups of 64): ~4× smaller, slightly different answers, the fastest 4-bit on a CPU",
    "nf4": "4-bit: ~4× smaller, slightly different answers",
    "mxfp4": "MXFP4 (GPT-OSS's own 4-bit): ~4× smaller, the released model's answers",
}

# Short names for places with no room for a label (a table column, a status line).
NAMES = {"auto": "Auto", "bf16": "bf16", "int8": "8-bit", "int4": "4-bit int4", "nf4": "4-bit", "mxfp4": "MXFP4"}


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
        if self.fmt == "int4":
            a, b = self.shape
            return {"q": ((a, b // 2), torch.uint8), "sz": ((b // int4_group(b), a, 2), dtype)}
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


# Rows quantised per step: a few MB of float32 temporaries stay in the core's caches (a whole Mixtral weight's 700 MB
# of temporaries made quantising memory-bound), and every step writes into the same buffers: a fresh 2 MB temporary
# per op is a fresh mapping the kernel zero-fills page by page, which cost more than the arithmetic (docs/bench.md,
# "Quantise-on-load in place"). Each packer gives the bytes of the plain vectorised formula it replaced
# (tests/test_expert_formats.py keeps that formula and compares).
PACK_BLOCK_BYTES = 1 << 21


Rows = Tensor | Sequence[Tensor]  # a weight [a, b], or its rows in parts stacked along dim 0 (gate then up)


def _stacked(w: Rows) -> tuple[list[Tensor], int, int]:
    """The parts of `w`, its row count and its row length: a packer reads the parts in turn, with no stacked copy."""
    parts = [w] if isinstance(w, Tensor) else list(w)
    return parts, sum(p.shape[0] for p in parts), parts[0].shape[-1]


def _block_rows(rows: int, cols: int) -> int:
    return max(1, min(rows, PACK_BLOCK_BYTES // (4 * cols)))


def _row_blocks(parts: list[Tensor], rows: int) -> Iterator[tuple[Tensor, int, int]]:
    """(the block's source rows, its first row in the whole weight, its row count); a block never spans two parts."""
    at = 0
    for part in parts:
        for start in range(0, part.shape[0], rows):
            n = min(rows, part.shape[0] - start)
            yield part[start : start + n], at + start, n
        at += part.shape[0]


class _Nibbles:
    """Two 4-bit codes per byte, from int8 codes [r, 2c] into uint8 [r, c], through buffers reused for every block:
    each pair of codes read as one little-endian int16 (three vectorised passes, where strided halves are not
    vectorised). `first_high`: the first code in the high nibble (nf4) or the low one (int4)."""

    def __init__(self, rows: int, cols: int, first_high: bool) -> None:
        self.codes = torch.empty(rows, cols, dtype=torch.int8)  # float → int8 is vectorised, float → uint8 is not
        self.shifted = torch.empty(rows, cols // 2, dtype=torch.int16)
        self.high = torch.empty(rows, cols // 2 if first_high else 0, dtype=torch.int16)  # only nf4 shifts down
        self.first_high = first_high

    def pack(self, block: Tensor, out: Tensor) -> None:
        """`block`'s codes into `out`; `block` may be `codes` itself, written by the caller (nf4's table)."""
        codes = self.codes[: block.shape[0]]
        if block.data_ptr() != codes.data_ptr():
            codes.copy_(block)
        if sys.byteorder != "little":  # no platform we ship: the plain strided form
            even, odd = codes[:, 0::2].to(torch.uint8), codes[:, 1::2].to(torch.uint8)
            out.copy_((even << 4) | odd if self.first_high else even | (odd << 4))
            return
        pair, shifted = codes.view(torch.int16), self.shifted[: block.shape[0]]  # pair = first | second << 8
        if self.first_high:
            high = torch.bitwise_right_shift(pair, 8, out=self.high[: block.shape[0]])
            torch.bitwise_left_shift(pair, 4, out=shifted).bitwise_or_(high)
        else:
            torch.bitwise_right_shift(pair, 4, out=shifted).bitwise_or_(pair)
        out.copy_(shifted)  # int16 → uint8 keeps the low byte: the two codes


def _check_finite(figures: Tensor, fmt: str) -> None:
    """Refuses a weight holding inf or NaN, seen in the figures of its rows, groups or blocks (a reduction carries
    both; asked once at the end, the codes of such a weight are discarded): its codes would be arbitrary bytes, a
    model that answers nonsense with no word why."""
    if not bool(torch.isfinite(figures).all()):
        raise ValueError(
            f"An expert weight holds inf or NaN, so it has no {fmt} form: the checkpoint is damaged. Download it "
            "again, or verify its files against the model's page."
        )


def pack_int8(w: Rows) -> dict[str, Tensor]:
    """Symmetric int8 per row: q = round(w / s), s = max|w| / 127 (float32), in place on a row block at a time."""
    parts, a, b = _stacked(w)
    q = torch.empty(a, b, dtype=torch.int8)
    scale = torch.empty(a, dtype=torch.float32)
    rows = _block_rows(a, b)
    work, magnitude = torch.empty(rows, b), torch.empty(rows, b)
    for source, start, n in _row_blocks(parts, rows):
        block, s = work[:n], scale[start : start + n]
        block.copy_(source)
        torch.amax(torch.abs(block, out=magnitude[:n]), 1, out=s)
        s.div_(127).clamp_(min=1e-12)
        q[start : start + n].copy_(block.div_(s[:, None]).round_().clamp_(-127, 127))
    _check_finite(scale, "int8")
    return {"q": q, "scale": scale}


def int4_group(in_features: int) -> int:
    """The int4 group along a row of `in_features`: INT4_GROUP, or 32 (the smallest torch's products take)."""
    return INT4_GROUP if in_features % INT4_GROUP == 0 else 32


def pack_int4(w: Rows, dtype: torch.dtype) -> dict[str, Tensor]:
    """Asymmetric 4-bit per group: w [a, b] → codes with (code − 8) · scale + zero ≈ w, scale and zero rounded to
    `dtype` first so that the codes are chosen against the values every reader uses. In place per block of rows."""
    parts, a, b = _stacked(w)
    g = int4_group(b)
    q = torch.empty(a, b // 2, dtype=torch.uint8)
    sz = torch.empty(b // g, a, 2, dtype=dtype)
    rows = _block_rows(a, b)
    work, nibbles = torch.empty(rows, b), _Nibbles(rows, b, first_high=False)
    for source, start, n in _row_blocks(parts, rows):
        block = work[:n]
        block.copy_(source)
        groups = block.view(n, b // g, g)
        low, high = groups.amin(-1), groups.amax(-1)  # [rows, b/g]
        scale = ((high - low) / 15).clamp_(min=1e-6).to(dtype).float()
        zero = (low + 8 * scale).to(dtype).float()
        groups.sub_(zero[..., None]).div_(scale[..., None]).add_(8).round_().clamp_(0, 15)
        nibbles.pack(block, q[start : start + n])
        sz[:, start : start + n, 0] = scale.t()
        sz[:, start : start + n, 1] = zero.t()
    _check_finite(sz, "int4")
    return {"q": q, "sz": sz}


# NF4's nearest level: the count of midpoints between ascending levels below a weight (bucketize's answer, faster;
# one compare per midpoint into float32, which torch vectorises, where a bool result is not).
_NF4_MIDS = tuple(((torch.tensor(NF4_CODE[1:]) + torch.tensor(NF4_CODE[:-1])) / 2).tolist())


def pack_nf4(w: Rows) -> dict[str, Tensor]:
    """nf4 parts of a weight: bf16 rows (checkpoints' own form) by a table lookup on their bits (`_pack_nf4_bf16`),
    other dtypes by counting the midpoints below each scaled weight (`pack_nf4_compares`); the same bytes either way."""
    parts, a, b = _stacked(w)
    if parts[0].dim() != 2 or b % NF4_BLOCK:
        return _pack_nf4_flat(torch.cat(parts) if len(parts) > 1 else parts[0])
    if all(p.dtype == torch.bfloat16 for p in parts):
        return _pack_nf4_bf16(parts, a, b)
    return pack_nf4_compares(w)


class _Nf4Compares:
    """nf4 codes of a block of rows by counting midpoints: the block scaled by its blocks' maxima in float32, then one
    compare per midpoint, in place on buffers made once per weight."""

    def __init__(self, rows: int, cols: int) -> None:
        self.work, self.other, self.count = torch.empty(rows, cols), torch.empty(rows, cols), torch.empty(rows, cols)
        self.nibbles = _Nibbles(rows, cols, first_high=True)

    def pack(self, source: Tensor, maxima: Tensor, q: Tensor) -> None:
        """Codes of `source` [n, cols] into `q` [n, cols/2], its blocks' largest magnitudes into `maxima`."""
        n = source.shape[0]
        block = self.work[:n]
        block.copy_(source)
        blocks = block.view(-1, NF4_BLOCK)
        torch.amax(torch.abs(blocks, out=self.other[:n].view(-1, NF4_BLOCK)), 1, out=maxima)
        blocks.div_(maxima.clamp(min=1e-12)[:, None])
        above, total = self.other[:n], self.count[:n].zero_()
        for mid in _NF4_MIDS:
            total.add_(torch.gt(block, mid, out=above))
        self.nibbles.pack(total, q)


def pack_nf4_compares(w: Rows) -> dict[str, Tensor]:
    """nf4 parts of rows of whole blocks, any float dtype, by counting midpoints: the packer for float16 and float32
    rows (bf16 rows take the table, `_pack_nf4_bf16`, which gives these bytes)."""
    parts, a, b = _stacked(w)
    q = torch.empty(a, b // 2, dtype=torch.uint8)
    absmax = torch.empty(a * b // NF4_BLOCK, dtype=torch.float32)
    rows = _block_rows(a, b)
    packer, per_row = _Nf4Compares(rows, b), b // NF4_BLOCK
    for source, start, n in _row_blocks(parts, rows):
        packer.pack(source, absmax[start * per_row : (start + n) * per_row], q[start : start + n])
    _check_finite(absmax, "nf4")
    return {"q": q.view(-1), "absmax": absmax}


# ---- nf4 of bf16 weights by table ---------------------------------------------------------------------------------
# The code of a bf16 weight w in a block of largest magnitude a is the count of midpoints below fl32(w/a): a function of
# the two 16-bit patterns alone, and of less than all their bits. Where a ≥ 2^-39 (normal, and above the counting
# packer's floor of 1e-12) it depends on a's 7 mantissa bits, w's sign and mantissa, and d = w's exponent − a's: the
# scale 2^(a's exponent) divides out exactly while the quotient is a normal float32, and for d ≤ −6 the code is 7 (|w/a|
# < 2^-5, inside the bin of the level 0.0). So one gather on w's bits replaces the 15 compares (2–2.5× less CPU:
# docs/bench.md, "nf4 of bf16 weights by table"): index = w's bits read as int16 + C(a), C(a) = 65408 − (a's exponent
# bits) + 65536 · (a's mantissa), i.e. a slice of 65536 entries per mantissa of a in which, with v = d·128 + w's
# mantissa (v ≤ 127: |w| ≤ a), w ≥ 0 lands at 65408 + v and w < 0 at 32640 + v. Its entries are the counting packer's
# own codes for d in [−5, 0], computed at one representative exponent, and 7 elsewhere, so its rounding and ties are the
# counting packer's by construction (tests/test_expert_formats.py compares every weight under every mantissa of a).
_NF4_POSITIVE, _NF4_NEGATIVE = 65408, 32640
# A block of ±0 only reads 7 through C = 32768 (±0 land on v = −32640: d = −255). A block whose maximum is nonzero and
# below 2^-39 (never seen in a checkpoint) has its row block counted by the compares instead.
_NF4_TABLE_MIN_BITS = (127 - 39) << 7
_NF4_ZERO_BLOCK = 32768


def _nf4_count(x: Tensor) -> Tensor:
    """The counting packer's code of each scaled weight (the midpoints below it), as int8."""
    total = torch.zeros_like(x)
    for mid in _NF4_MIDS:
        total.add_(torch.gt(x, mid))
    return total.to(torch.int8)


@functools.cache
def _nf4_bf16_table() -> Tensor:
    """int8 [128 · 65536]: the nf4 code at index C(a) + w's bits (see above); 8 MiB, made once per process."""
    table = torch.full((128, 1 << 16), 7, dtype=torch.int8)
    exponent = 127 << 7  # the representative: a in [1, 2), w in [2^-5, 2)
    a = (exponent | torch.arange(128, dtype=torch.int32)).to(torch.int16).view(torch.bfloat16).float()
    offset = torch.arange(-5 * 128, 128, dtype=torch.int32)  # d·128 + w's mantissa, d in [-5, 0]
    for negative, at in ((False, _NF4_POSITIVE), (True, _NF4_NEGATIVE)):
        bits = exponent + offset - (1 << 15 if negative else 0)  # the int16 value of w's pattern
        w = bits.to(torch.int16).view(torch.bfloat16).float()
        table[:, at + offset] = _nf4_count(w[None, :] / a[:, None])
    return table.view(-1)


def _pack_nf4_bf16(parts: list[Tensor], a: int, b: int) -> dict[str, Tensor]:
    """nf4 parts of bf16 rows of whole blocks by `_nf4_bf16_table`, a block of rows at a time on reused buffers."""
    table = _nf4_bf16_table()
    q = torch.empty(a, b // 2, dtype=torch.uint8)
    absmax = torch.empty(a * b // NF4_BLOCK, dtype=torch.float32)
    # The int32 indices are 4 bytes per weight: 1 MB of them per step (1–2 MB measured best, 0.5 and 4 MB slower).
    rows = max(1, min(a, PACK_BLOCK_BYTES // (8 * b)))
    per_row = b // NF4_BLOCK
    magnitude = torch.empty(rows * b, dtype=torch.int16)
    index = torch.empty(rows * b, dtype=torch.int32)
    top, scaled = torch.empty(rows * per_row, dtype=torch.int16), torch.empty(rows * per_row, 1, dtype=torch.int32)
    exponent = torch.empty(rows * per_row, dtype=torch.int32)
    nibbles = _Nibbles(rows, b, first_high=True)
    compares: _Nf4Compares | None = None
    for source, start, n in _row_blocks(parts, rows):
        m, blocks = n * b, n * per_row
        bits = source.view(torch.int16)  # any strides: every op below reads it through its view
        maxima = absmax[start * per_row : (start + n) * per_row]
        # Each block's largest magnitude from the bits, sign cleared: patterns order as magnitudes do (a NaN's is
        # the largest, so it reaches _check_finite), and every index then stays inside its slice.
        magnitudes = torch.bitwise_and(bits, 0x7FFF, out=magnitude[:m].view(n, b))
        largest = torch.amax(magnitudes.view(-1, NF4_BLOCK), 1, out=top[:blocks])
        zero = None
        if int(largest.min()) < _NF4_TABLE_MIN_BITS:  # rare: asked apart, the common case is one reduction
            zero = largest == 0
            if bool(((largest < _NF4_TABLE_MIN_BITS) & ~zero).any()):
                compares = compares or _Nf4Compares(rows, b)
                compares.pack(source, maxima, q[start : start + n])
                continue
        maxima.copy_(largest.view(torch.bfloat16))
        # C(a) = 65408 − (a & −128) + 65536 · (a & 127) = 65408 + 65536 · a − 65537 · (a & −128), all in int32.
        c = scaled[:blocks, 0].copy_(largest)
        high = torch.bitwise_and(c, -128, out=exponent[:blocks])
        c.mul_(1 << 16).add_(_NF4_POSITIVE).sub_(high, alpha=(1 << 16) + 1)
        if zero is not None:
            c.masked_fill_(zero, _NF4_ZERO_BLOCK)
        at = index[:m].view(-1, NF4_BLOCK)
        at.view(n, b).copy_(bits)
        at.add_(scaled[:blocks])
        codes = nibbles.codes[:n]
        torch.index_select(table, 0, index[:m], out=codes.view(-1))
        nibbles.pack(codes, q[start : start + n])
    _check_finite(absmax, "nf4")
    return {"q": q.view(-1), "absmax": absmax}


def _pack_nf4_flat(w: Tensor) -> dict[str, Tensor]:
    flat = w.float().reshape(-1)
    n = flat.numel()
    blocks = -(-n // NF4_BLOCK)
    padded = torch.zeros(blocks * NF4_BLOCK, dtype=torch.float32)
    padded[:n] = flat
    padded = padded.view(blocks, NF4_BLOCK)
    absmax = padded.abs().amax(1)
    _check_finite(absmax, "nf4")
    normed = padded / absmax.clamp(min=1e-12)[:, None]
    q = _nf4_count(normed.reshape(-1)[:n]).view(torch.uint8)  # counts 0–15: the same bits as uint8
    if n % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return {"q": ((q[0::2] << 4) | q[1::2]).contiguous(), "absmax": absmax.contiguous()}


def pack(param: PackedParam, dense: Rows, dtype: torch.dtype) -> dict[str, Tensor]:
    """One parameter's stored parts ({stored key: tensor}) from its dense row (any float dtype), or from that row's
    parts stacked along dim 0 (read_expert's for a packer: a gate and an up projection, never concatenated)."""
    if param.fmt == "dense":
        return {"": (dense if isinstance(dense, Tensor) else torch.cat(list(dense))).to(dtype).contiguous()}
    if param.fmt == "int8":
        return pack_int8(dense)
    if param.fmt == "int4":
        return pack_int4(dense, dtype)
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
    if param.fmt == "int4":
        q, sz = parts["q"], parts["sz"].float()
        a, b = param.shape
        g = int4_group(b)
        codes = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(a, b // g, g).float()
        scale, zero = sz[..., 0].t(), sz[..., 1].t()  # [a, b/g]
        return ((codes - 8) * scale[..., None] + zero[..., None]).reshape(a, b).to(dtype)
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


# ---- weight-only products (torch's CPU kernels on the stored form) ---------------------------------------------------
@dataclass(frozen=True)
class Int8Weight:
    """An int8 parameter as torch's weight-only int8 product reads it: x·(q · scale)ᵀ, accumulated in float32."""

    q: Tensor  # [out, in] int8
    scale: Tensor  # [out] float32

    def linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        out = torch._weight_int8pack_mm(x.contiguous(), self.q, self.scale.to(x.dtype))
        return out if bias is None else out + bias


@dataclass(frozen=True)
class Int4Weight:
    """An int4 parameter in torch's CPU layout, as its weight-only int4 product reads it."""

    packed: Tensor  # torch's CPU layout of the [out, in] codes (per build: blocked for its vector width)
    sz: Tensor  # [in/g, out, 2] scale and zero, the compute dtype
    group: int

    @staticmethod
    def from_portable(q: Tensor) -> Tensor:
        """Our stored `q` [out, in/2] (low nibble first) in torch's CPU layout, the same shape and dtype (it depends
        on torch's version and the CPU it dispatches for: quant_cache.CpuLayout keeps it per key). Converted a block of
        INT4_LAYOUT_ROWS rows at a time through reused buffers: torch takes one int32 per code, four times the
        packed bytes, and its layout blocks rows in groups that divide that count, so the blocks give the whole
        conversion's bytes (tests/test_expert_formats.py compares)."""
        convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        if sys.byteorder != "little":  # no platform we ship: the plain form, whole
            return convert(torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(q.shape[0], -1).to(torch.int32), 1)
        out_f, half = q.shape
        rows = min(out_f, max(INT4_LAYOUT_ROWS, PACK_BLOCK_BYTES // (8 * half) // INT4_LAYOUT_ROWS * INT4_LAYOUT_ROWS))
        pairs, high = torch.empty(rows, half, dtype=torch.int64), torch.empty(rows, half, dtype=torch.int64)
        packed: Tensor | None = None
        for source, start, n in _row_blocks([q], rows):
            codes = pairs[:n].copy_(source)  # one int64 per byte: its two codes as two int32
            torch.bitwise_right_shift(codes, 4, out=high[:n]).bitwise_left_shift_(32)
            codes.bitwise_and_(0x0F).bitwise_or_(high[:n])  # the first code in the low int32 (little-endian)
            part = convert(codes.view(torch.int32), 1)
            if packed is None:
                packed = part.new_empty((out_f, *part.shape[1:]))
            packed[start : start + n] = part
        return packed

    def linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group, self.sz.to(x.dtype))
        return out if bias is None else out + bias


@dataclass(frozen=True)
class Int4CudaWeight:
    """An int4 parameter in a CUDA slot, in torch's CUDA layout (`to_cuda_layout` made it when the copy landed), as
    torch's CUDA int4 product (tinygemm) reads it: no dense copy is written or read."""

    q: Tensor  # the slot's [out, in/2] uint8 bytes, holding torch's layout
    sz: Tensor  # [in/g, out, 2] bf16
    group: int
    inner_k_tiles: int

    def linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        out_f, half = self.q.shape
        t = self.inner_k_tiles
        packed = self.q.view(torch.int32).view(out_f // 8, 2 * half // (16 * t), 32, t // 2)
        out = torch._weight_int4pack_mm(x.contiguous(), packed, self.group, self.sz)
        return out if bias is None else out + bias


def cuda_int4_tiles(param: PackedParam, dtype: torch.dtype, device: torch.device) -> int:
    """torch's inner k-tiles for an int4 [out, in] parameter multiplied by its CUDA int4 product, or 0 where that
    product does not apply: int4 rows in [out, in] layout, bf16 activations, a GPU of compute capability 8.0 or later
    (tinygemm's), out a multiple of 8 and in of 32. The one rule both the copy's landing (`to_cuda_layout`) and the
    reader (`PackedRows`) follow, so a slot is never read in a layout it was not given."""
    if param.fmt != "int4" or param.transpose or dtype != torch.bfloat16 or device.type != "cuda":
        return 0
    out_f, in_f = param.shape
    if out_f % 8 or int4_group(in_f) not in (32, 64, 128, 256) or not _has_tinygemm(device):
        return 0
    return next((t for t in (8, 4, 2) if in_f % (16 * t) == 0), 0)


@functools.cache
def _has_tinygemm(device: torch.device) -> bool:
    """Asked on every int4 hit: the GPU's capability is read once per device."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def to_cuda_layout(params: Mapping[str, PackedParam], slot: Mapping[str, Tensor], dtype: torch.dtype) -> None:
    """A CUDA slot's int4 codes rewritten in place into torch's CUDA layout, where its product applies
    (`cuda_int4_tiles`): run on the copy stream once the copy has landed, so every later hit multiplies directly.
    The layout is made on the GPU (torch converts only there) and is the same size as our bytes."""
    device = next(iter(slot.values())).device
    for name, param in params.items():
        tiles = cuda_int4_tiles(param, dtype, device)
        if tiles:
            q = slot[part_key(name, "q")]
            swapped = (q << 4) | (q >> 4)  # torch's CUDA layout takes the first code in the high nibble
            packed = torch._convert_weight_to_int4pack(swapped, tiles)
            q.view(-1).copy_(packed.view(torch.uint8).view(-1))


PACKED_WEIGHTS = (Int8Weight, Int4Weight, Int4CudaWeight)  # what PackedRows gives in place of a dense tensor
PRODUCTS = ("int8", "int4")  # the formats a CPU computes with a library product instead of dequantising


@functools.cache
def product_runs(fmt: str, dtype: torch.dtype) -> bool:
    """Can this torch build multiply `fmt` ("int8" or "int4") weights with its weight-only CPU product, activations
    in `dtype`? One product on a 64 × 64 weight of constant codes: builds and CPUs without the kernel raise. Asked
    once per process (the build does not change under it)."""
    if fmt not in PRODUCTS:
        return False
    try:
        if fmt == "int8":
            weight: Int8Weight | Int4Weight = Int8Weight(torch.ones(64, 64, dtype=torch.int8), torch.ones(64))
        else:
            codes = Int4Weight.from_portable(torch.full((64, 32), 0x88, dtype=torch.uint8))
            weight = Int4Weight(codes, torch.zeros(64 // int4_group(64), 64, 2, dtype=dtype), int4_group(64))
        weight.linear(torch.ones(1, 64, dtype=dtype), None)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def check_cpu_products(formats: Iterable[str], dtype: torch.dtype) -> None:
    """Refuse (ValueError, a sentence naming a format that runs) weights a CPU device would multiply with a product
    this torch build lacks: asked at load, before the experts are read, rather than failing at the first token."""
    missing = [f for f in dict.fromkeys(formats) if f in PRODUCTS and not product_runs(f, dtype)]
    if not missing:
        return
    runs = [f for f in PRODUCTS if f not in missing and product_runs(f, dtype)]
    instead = f"choose {NAMES[runs[0]]} ({runs[0]}), which runs here," if runs else "choose bf16 (unpacked),"
    names = " and ".join(f"{NAMES[f]} ({f})" for f in missing)
    raise ValueError(
        f"This PyTorch build has no CPU product for {names} weights in {str(dtype).removeprefix('torch.')}, so this "
        f"computer's CPU cannot compute the model in that format: {instead} or update PyTorch (the launcher's "
        "--repair installs the tested version)."
    )


def has_products(params: Mapping[str, PackedParam]) -> bool:
    """Does a CPU compute these parameters with torch's products? Only [out, in] rows (not GPT-OSS's [in, out])."""
    return any(p.fmt in PRODUCTS for p in params.values()) and not any(p.transpose for p in params.values())


def to_cpu_layout(params: Mapping[str, PackedParam], stored: dict[str, Tensor]) -> dict[str, Tensor]:
    """One stored expert with its int4 codes in torch's CPU layout (what a CPU device's RAM and slots hold)."""
    for name, param in params.items():
        if param.fmt == "int4":
            stored[part_key(name, "q")] = Int4Weight.from_portable(stored[part_key(name, "q")])
    return stored


class PackedRows(Mapping[str, Tensor]):
    """One stored expert read as dense parameters: a packed parameter is dequantised when the expert reads it (once
    per read: the dense copy lives only while the product needs it). With `products` (a CPU device, whose store
    holds int4 in torch's CPU layout), int8 and int4 parameters are read as Int8Weight / Int4Weight instead, which
    the compute paths multiply with torch's weight-only kernels: no dense copy at all."""

    __slots__ = ("_stored", "_params", "_dtype", "_products")

    def __init__(
        self,
        stored: Mapping[str, Tensor],
        params: Mapping[str, PackedParam],
        dtype: torch.dtype,
        products: bool = False,
    ) -> None:
        self._stored, self._params, self._dtype, self._products = stored, params, dtype, products

    def __getitem__(self, name: str) -> Tensor:
        param = self._params[name]
        if param.fmt == "dense":
            return self._stored[name]
        parts = {s: self._stored[part_key(name, s)] for s in param.parts(self._dtype)}
        if self._products and param.fmt == "int8":
            return Int8Weight(parts["q"], parts["scale"])
        if self._products and param.fmt == "int4":
            return Int4Weight(parts["q"], parts["sz"], int4_group(param.shape[1]))
        tiles = cuda_int4_tiles(param, self._dtype, next(iter(parts.values())).device)
        if tiles:  # a slot `to_cuda_layout` rewrote when its copy landed
            return Int4CudaWeight(parts["q"], parts["sz"], int4_group(param.shape[1]), tiles)
        return unpack(param, parts, self._dtype)

    def __contains__(self, name: object) -> bool:
        return name in self._params

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)
