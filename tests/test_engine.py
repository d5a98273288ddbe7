"""engine.resolve_dtype: what `--dtype auto` computes in, per device and checkpoint dtype."""

from __future__ import annotations

import torch

from fmoe_local.engine import resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_keeps_a_bf16_checkpoint_on_a_cpu_measured_to_decode_it_well():
    def stored() -> torch.dtype:
        return torch.bfloat16

    asked = []

    def fast(dtype: torch.dtype) -> bool:
        asked.append(dtype)
        return True

    assert resolve_dtype("auto", CPU, stored, keeps_half=fast) is None  # None: the checkpoint's own bf16
    assert asked == [torch.bfloat16]
    assert resolve_dtype("auto", CPU, stored, keeps_half=lambda d: False) == torch.float32  # slow bf16: fp32
    assert resolve_dtype("auto", CUDA, stored, keeps_half=lambda d: False) is None  # a GPU keeps it unmeasured


def test_auto_on_the_cpu_never_keeps_fp16_and_keeps_fp32_without_measuring():
    def never(dtype: torch.dtype) -> bool:
        raise AssertionError("no measurement needed")

    assert resolve_dtype("auto", CPU, lambda: torch.float16, keeps_half=never) == torch.float32
    assert resolve_dtype("auto", CPU, lambda: torch.float32, keeps_half=never) is None
    assert resolve_dtype("bfloat16", CPU, lambda: torch.float32, keeps_half=never) == torch.bfloat16
