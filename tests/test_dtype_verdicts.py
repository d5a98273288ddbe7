"""dtype_verdicts: the dtype probes' ratios measured once per machine key, read back from what the app saved, and
measured again for another key or anything unreadable; and a load that reuses them runs no probe."""

from __future__ import annotations

import importlib.metadata
import json
import math

import pytest
import torch

from fmoe_local import bandwidth, dtype_verdicts, openvino_products
from fmoe_local.config import RuntimeConfig
from fmoe_local.dtype_verdicts import DtypeVerdicts, resolve_dtype
from fmoe_local.runtime import Runtime


class Probes:
    """Counting stand-ins for bandwidth's two probes: bf16 dense slower than float32, int4 products faster in bf16,
    int8 without a product here (infinitely slow)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def half(self, dtype: object) -> float:
        self.calls.append(f"half {dtype}")
        return 1.4

    def products(self, fmt: str) -> float:
        self.calls.append(f"products {fmt}")
        return {"int4": 0.3}.get(fmt, math.inf)

    def verdicts(self, saved: object = None, key: str = "machine A") -> DtypeVerdicts:
        return DtypeVerdicts(saved, key, self.half, self.products)


def _ask(v: DtypeVerdicts) -> tuple[bool, bool, bool]:
    return v.keeps_half(torch.bfloat16), v.products_prefer_bf16("int4"), v.products_prefer_bf16("int8")


def _saved(v: DtypeVerdicts) -> object:
    return json.loads(json.dumps(v.to_dict(), allow_nan=False))  # strict JSON: the app saves it as text


def test_saved_ratios_of_the_same_machine_are_read_back_without_probing():
    probes = Probes()
    first = probes.verdicts()
    assert _ask(first) == (False, True, False) and first.measured == 3
    assert _ask(first) == (False, True, False) and len(probes.calls) == 3  # asked again: no new probe
    second = probes.verdicts(_saved(first))
    assert _ask(second) == (False, True, False)
    assert len(probes.calls) == 3 and second.measured == 0  # the second load probed nothing


def test_only_the_probe_a_load_asks_for_is_run_and_a_later_one_adds_to_the_saved():
    probes = Probes()
    first = probes.verdicts()
    first.products_prefer_bf16("int4")
    assert probes.calls == ["products int4"]
    second = probes.verdicts(_saved(first))
    second.products_prefer_bf16("int4"), second.keeps_half(torch.bfloat16)
    assert probes.calls == ["products int4", "half torch.bfloat16"]
    assert set(_saved(second)["ratios"]) == {"products int4", "half bfloat16"}


def test_another_machine_key_measures_again():
    probes = Probes()
    first = probes.verdicts()
    _ask(first)
    other = probes.verdicts(_saved(first), key="machine A with 2 threads")
    assert _ask(other) == (False, True, False) and other.measured == 3 and len(probes.calls) == 6
    assert _saved(other)["key"] == "machine A with 2 threads"


@pytest.mark.parametrize(
    "saved",
    [
        None,
        "not a mapping",
        [1, 2],
        {"key": "machine A"},
        {"key": "machine A", "ratios": "x"},
        {"key": "machine A", "ratios": {"half bfloat16": "fast"}},
        {"key": "machine A", "ratios": {"half bfloat16": True}},
        {"key": "machine A", "ratios": {"half bfloat16": -1.0}},
        {"key": "machine A", "ratios": {"half bfloat16": float("nan")}},
    ],
)
def test_unreadable_saved_ratios_are_measured_again_and_replaced(saved):
    probes = Probes()
    v = probes.verdicts(saved)
    assert _ask(v) == (False, True, False) and v.measured == 3
    assert _saved(v)["ratios"] == {"half bfloat16": 1.4, "products int4": 0.3, "products int8": "inf"}


def test_the_key_names_the_cpu_torch_and_the_thread_count():
    threads = torch.get_num_threads()
    key = dtype_verdicts.machine_key()
    assert torch.__version__ in key and f"threads {threads}" in key
    try:
        torch.set_num_threads(threads + 1)
        assert dtype_verdicts.machine_key() != key  # the probes ran with another thread count: measured again
    finally:
        torch.set_num_threads(threads)


def test_a_cpu_load_in_auto_dtype_reuses_the_saved_verdicts(tiny_model_dir, monkeypatch, tmp_path):
    calls: list[str] = []
    monkeypatch.setattr(bandwidth, "half_decode_ratio", lambda dtype: calls.append("half") or 1.4)
    monkeypatch.setattr(bandwidth, "products_decode_ratio", lambda fmt: calls.append(fmt) or 0.3)
    model = tiny_model_dir("mixtral", dtype=torch.bfloat16)
    config = RuntimeConfig(device="cpu", dtype="auto", expert_format="int4", quant_cache_dir=str(tmp_path))
    with Runtime.load(model, config) as runtime:
        assert runtime.info.dtype == "bfloat16"  # the int4 products' probe said bf16
        saved = json.loads(json.dumps(runtime.dtype_verdicts.to_dict()))
    assert calls == ["int4"]
    with Runtime.load(model, config, dtype_verdicts=DtypeVerdicts(saved)) as runtime:
        assert runtime.info.dtype == "bfloat16" and runtime.dtype_verdicts.measured == 0
    assert calls == ["int4"]  # the second load ran no probe


def test_the_dense_int8_product_verdict_is_kept_per_dtype_size_and_openvino_version():
    calls: list[object] = []
    v = DtypeVerdicts(None, "machine A", openvino_ratio=lambda dtype, size: calls.append((dtype, size)) or 0.6)
    assert v.dense_prefers_openvino(torch.bfloat16) and v.dense_prefers_openvino(torch.bfloat16)
    assert calls == [(torch.bfloat16, "small")]  # asked twice, measured once
    name = f"openvino int8 bfloat16 {openvino_products.version()}"
    assert _saved(v)["ratios"] == {name: 0.6}
    slower = DtypeVerdicts(
        _saved(v), "machine A", openvino_ratio=lambda dtype, size: calls.append((dtype, size)) or 1.7
    )
    assert slower.dense_prefers_openvino(torch.bfloat16) and slower.measured == 0  # read back, not measured
    assert not slower.dense_prefers_openvino(torch.float32) and calls[1:] == [(torch.float32, "small")]
    # A large weight (an output head) has a verdict of its own beside the small one's.
    assert not slower.dense_prefers_openvino(torch.bfloat16, "large") and calls[2:] == [(torch.bfloat16, "large")]
    assert _saved(slower)["ratios"][f"openvino int8 large bfloat16 {openvino_products.version()}"] == 1.7


def test_a_verdict_saved_before_sizes_were_told_apart_is_the_small_size_s():
    """The small size's probe is the one every verdict was measured with before: read back, the large one measured."""
    saved = {"key": "machine A", "ratios": {f"openvino int8 bfloat16 {openvino_products.version()}": 0.6}}
    calls: list[str] = []
    v = DtypeVerdicts(saved, "machine A", openvino_ratio=lambda dtype, size: calls.append(size) or 1.3)
    assert v.dense_prefers_openvino(torch.bfloat16, "small") and calls == []
    assert not v.dense_prefers_openvino(torch.bfloat16, "large") and calls == ["large"]


def test_where_openvino_cannot_be_imported_nothing_is_measured(monkeypatch):
    openvino_products._openvino.cache_clear()
    monkeypatch.setattr(openvino_products, "_import_openvino", lambda: (_ for _ in ()).throw(ImportError("none")))
    try:
        v = DtypeVerdicts(None, "machine A", openvino_ratio=lambda dtype, size: pytest.fail("probed without openvino"))
        assert not v.dense_prefers_openvino(torch.float32) and v.measured == 0 and _saved(v)["ratios"] == {}
    finally:
        openvino_products._openvino.cache_clear()


def test_a_saved_openvino_verdict_is_read_without_importing_openvino(monkeypatch):
    """Every app start asks (hardware.probe): importing openvino would cost it about 0.3 s."""
    openvino_products._openvino.cache_clear()
    monkeypatch.setattr(openvino_products, "_import_openvino", lambda: pytest.fail("openvino imported"))
    try:
        saved = {"key": "machine A", "ratios": {f"openvino int8 bfloat16 {openvino_products.version()}": 0.6}}
        v = DtypeVerdicts(saved, "machine A", openvino_ratio=lambda dtype, size: pytest.fail("probed again"))
        assert v.dense_prefers_openvino(torch.bfloat16) and v.measured == 0
    finally:
        openvino_products._openvino.cache_clear()


def test_where_openvino_is_not_installed_its_product_is_never_chosen(monkeypatch):
    def absent(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", absent)
    assert openvino_products.version() == ""
    saved = {"key": "machine A", "ratios": {"openvino int8 bfloat16 2026.4.1": 0.6}}  # measured before an uninstall
    v = DtypeVerdicts(saved, "machine A", openvino_ratio=lambda dtype, size: pytest.fail("probed without openvino"))
    assert not v.dense_prefers_openvino(torch.bfloat16) and v.measured == 0


@pytest.mark.parametrize(("ratio", "product"), [(0.5, "openvino"), (2.0, "torch")])
def test_an_int8_load_multiplies_with_the_faster_product_and_a_second_load_probes_nothing(
    ratio, product, tiny_model_dir, monkeypatch, tmp_path
):
    calls: list[object] = []
    monkeypatch.setattr(openvino_products, "int8_ratio", lambda dtype, size: calls.append(dtype) or ratio)
    model = tiny_model_dir("mixtral")
    config = RuntimeConfig(device="cpu", expert_format="int8", quant_cache_dir=str(tmp_path))
    with Runtime.load(model, config) as runtime:
        assert runtime.info.dense_format == "int8" and runtime.info.dense_product == product
        saved = json.loads(json.dumps(runtime.dtype_verdicts.to_dict()))
    assert calls == [torch.float32]
    with Runtime.load(model, config, dtype_verdicts=DtypeVerdicts(saved)) as runtime:
        assert runtime.info.dense_product == product and runtime.dtype_verdicts.measured == 0
    assert calls == [torch.float32]  # the second load ran no probe
    # Forced, the setting wins over the verdict and nothing is measured.
    with Runtime.load(model, config.with_changes(dense_int8_product="torch")) as runtime:
        assert runtime.info.dense_product == "torch"
    assert calls == [torch.float32]


def test_a_probe_runs_under_the_verdicts_lock_so_threads_sharing_them_never_measure_at_once():
    """The app's page and its start-up load share one object (ui/session.py): a second asker waits for the probe
    under way and reads its answer; it never runs a probe beside it."""
    held: list[bool] = []
    v = DtypeVerdicts(None, "machine A", half_ratio=lambda dtype: held.append(v._lock.locked()) or 1.4)
    assert not v.keeps_half(torch.bfloat16) and held == [True]


def test_forget_measures_every_verdict_again_when_next_asked():
    calls: list[str] = []
    v = DtypeVerdicts(None, "machine A", half_ratio=lambda dtype: calls.append("half") or 1.4)
    assert not v.keeps_half(torch.bfloat16) and not v.keeps_half(torch.bfloat16) and calls == ["half"]
    v.forget()  # the Models tab's "Re-check this computer"
    assert _saved(v)["ratios"] == {}
    assert not v.keeps_half(torch.bfloat16) and calls == ["half", "half"]


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
