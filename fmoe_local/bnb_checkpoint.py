"""Checkpoints quantised with bitsandbytes 4-bit (the per-expert nf4 files people publish), read without bitsandbytes.

Scope: recognising such a checkpoint (config.json `quantization_config`), and reading one weight in the layout
bitsandbytes serialises a `Linear4bit` with: `X.weight` uint8 [n/2, 1] (two nf4 codes per byte, high nibble first),
`X.weight.absmax` (float32 per 64-weight block, or with double quantisation uint8 codes into
`X.weight.nested_quant_map` [256] scaled per 256 blocks by `X.weight.nested_absmax`, plus `nested_offset`),
`X.weight.quant_map` [16] (the NF4 levels) and `X.weight.quant_state.bitsandbytes__nf4` (the JSON state: quant_type,
blocksize, dtype, shape, nested_*). An expert's weight becomes our nf4 packed form (expert_formats.py) as it is
— its code bytes and its block scales — so experts are never dequantised on load; the non-expert weights, few and
resident, are dequantised once. It does NOT write such files or read 8-bit (LLM.int8) or fp4 ones: those are
refused with a sentence naming what we read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Container

import torch

from fmoe_local.expert_formats import NF4_BLOCK, NF4_CODE

STATE = ".quant_state.bitsandbytes__nf4"
AUX = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", STATE)
READ = "bitsandbytes 4-bit nf4 (blocksize 64, with or without double quantisation)"


def check_config(quant: dict) -> None:
    """Accept a bitsandbytes 4-bit nf4 quantization_config; refuse the layouts we do not read, saying which we do."""
    if quant.get("load_in_8bit") or not quant.get("load_in_4bit", True):
        raise ValueError(
            f"This checkpoint is quantized with bitsandbytes 8-bit, which fmoe-local does not read. We read {READ} "
            "checkpoints and bf16/fp16 ones (which we can quantise to int8 ourselves): download one of those."
        )
    kind = str(quant.get("bnb_4bit_quant_type", "nf4")).lower()
    if kind != "nf4":
        raise ValueError(
            f"This checkpoint is quantized with bitsandbytes 4-bit {kind}, which fmoe-local does not read. We read "
            f"{READ} checkpoints and bf16/fp16 ones: download one of those."
        )


def is_quantised(files: Container[str], key: str) -> bool:
    return key + STATE in files


def is_auxiliary(key: str) -> bool:
    """A quant-state tensor that belongs to a weight (never a model parameter of its own)."""
    return key.endswith(AUX)


def _state(files: object, key: str) -> dict:
    state = json.loads(bytes(files.get(key + STATE).tolist()))
    if state.get("quant_type") != "nf4" or int(state.get("blocksize", 0)) != NF4_BLOCK:
        raise ValueError(
            f"'{key}' is stored as bitsandbytes {state.get('quant_type')} with blocksize {state.get('blocksize')}; "
            f"fmoe-local reads {READ}. Download a bf16 release of the model instead."
        )
    return state


def read_nf4(files: object, key: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(code bytes uint8 [ceil(n/2)], block scales float32 [ceil(n/64)], dense shape) of one 4-bit weight, as
    bitsandbytes dequantises its scales (double quantisation undone in float32)."""
    state = _state(files, key)
    levels = files.get(key + ".quant_map").float()
    if not torch.equal(levels, torch.tensor(NF4_CODE)):
        raise ValueError(f"'{key}' uses other 4-bit levels than NF4's; fmoe-local reads {READ}.")
    absmax = files.get(key + ".absmax")
    if key + ".nested_absmax" in files:
        nested_map = files.get(key + ".nested_quant_map").float()
        nested_absmax = files.get(key + ".nested_absmax").float()
        per = int(state["nested_blocksize"])
        scale = nested_absmax.repeat_interleave(per)[: absmax.numel()]
        absmax = nested_map[absmax.long()] * scale + float(state["nested_offset"])
    shape = tuple(int(d) for d in state["shape"])
    q = files.get(key).reshape(-1)
    n = math.prod(shape)
    if q.numel() != (n + 1) // 2 or absmax.numel() != -(-n // NF4_BLOCK):
        raise ValueError(f"'{key}' has {q.numel()} code bytes for a {shape} weight: the file is damaged.")
    return q.contiguous(), absmax.float().contiguous(), shape


def dequantize(files: object, key: str, dtype: torch.dtype) -> torch.Tensor:
    """One 4-bit weight as dense [out, in] in `dtype` (float32 arithmetic, as bitsandbytes)."""
    from fmoe_local.expert_formats import PackedParam, unpack

    q, absmax, shape = read_nf4(files, key)
    return unpack(PackedParam("nf4", shape), {"q": q, "absmax": absmax}, dtype)


def read_concat_nf4(files: object, keys: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Several per-expert weights concatenated on dim 0 (gate_up = cat([w1, w3])) as one nf4 weight: the code bytes
    and block scales of each, one after the other — exact when each has whole blocks."""
    parts = [read_nf4(files, k) for k in keys]
    for k, (_, _, shape) in zip(keys, parts, strict=True):
        if len(parts) > 1 and math.prod(shape) % NF4_BLOCK:
            raise ValueError(f"'{k}' is not a whole number of 64-weight blocks; choose expert format bf16 or int8.")
    shapes = [p[2] for p in parts]
    shape = (sum(s[0] for s in shapes), *shapes[0][1:])
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), shape
