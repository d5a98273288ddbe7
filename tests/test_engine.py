"""engine: what `--dtype auto` computes in (resolve_dtype), and what a settings change does to the policy."""

from __future__ import annotations

import torch

from fmoe_local.config import RuntimeConfig
from fmoe_local.engine import resolve_dtype
from fmoe_local.runtime import Runtime

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


def test_a_distance_change_retunes_a_policy_that_can_and_replaces_one_that_cannot(tiny_model_dir):
    config = RuntimeConfig(device="cpu", cache_experts=4, miss_handling="copy", policy="fmoe", prefetch_distance=1)
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        fmoe = runtime.engine.policy
        runtime.reconfigure(prefetch_distance=2)
        assert runtime.engine.policy is fmoe and fmoe.prefetch_distance == 2  # retuned: it keeps what it learned
        runtime.reconfigure(policy="lru")
        lru = runtime.engine.policy
        assert lru.reconfigure(prefetch_distance=3) is False  # Policy's default: it cannot retune
        runtime.reconfigure(prefetch_distance=3)
        assert runtime.engine.policy is not lru and runtime.engine.policy.name == "lru"  # so it is made anew


def test_auto_keeps_bf16_for_int8_and_int4_experts_where_the_products_are_measured_faster_so():
    asked = []

    def products(fmt: str) -> bool:
        asked.append(fmt)
        return fmt == "int4"

    def slow_dense(dtype: torch.dtype) -> bool:
        return False

    def bf16() -> torch.dtype:
        return torch.bfloat16

    # The dense probe says float32, the products' probe bf16: a packed model computes in bf16 (its experts are most
    # of a token's bytes), an unpacked one in float32.
    assert resolve_dtype("auto", CPU, bf16, slow_dense, "int4", products) is None
    assert resolve_dtype("auto", CPU, bf16, slow_dense, "int8", products) == torch.float32  # measured slower so
    assert resolve_dtype("auto", CPU, bf16, slow_dense, "bf16", products) == torch.float32
    assert resolve_dtype("auto", CPU, bf16, slow_dense, "nf4", products) == torch.float32  # no product: not asked
    assert asked == ["int4", "int8"]
    # An explicit dtype, a float32 checkpoint and a GPU are not measured.
    assert resolve_dtype("float32", CPU, bf16, slow_dense, "int4", products) == torch.float32
    assert resolve_dtype("auto", CPU, lambda: torch.float32, slow_dense, "int4", products) is None
    assert resolve_dtype("auto", CUDA, bf16, slow_dense, "int4", products) is None
    assert asked == ["int4", "int8"]
