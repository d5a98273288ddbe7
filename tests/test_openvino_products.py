"""openvino_products: OpenVINO's int8 product is float32's x·Wᵀ on the dequantised weight; importing it sends no
telemetry; where openvino cannot be imported or a weight does not compile, a load says which product runs instead
and still gives eager's tokens; forcing it where it cannot run is refused with a sentence."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from fmoe_local import openvino_products
from fmoe_local.dense_formats import PackedLinear
from fmoe_local.openvino_products import Int8Product
from fmoe_local.runtime import Runtime
from tests.test_dense_formats import _config, reference_tokens
from tests.test_runtime_quantized import PROMPT


def _weight(out_f: int, in_f: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(out_f * 7 + in_f)
    q = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, generator=gen)
    return q, torch.rand(out_f, generator=gen) * 1e-2 + 1e-4


@pytest.mark.parametrize("shape", [(96, 64), (1000, 256), (33, 17)])
def test_the_product_is_float32_s_on_the_dequantised_weight(shape):
    q, scale = _weight(*shape)
    product = Int8Product(q, scale, threads=1)
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(1))
    exact = x.double() @ (q.double() * scale.double()[:, None]).T
    out = product(x)
    assert out.dtype == torch.float32 and out.shape == (5, shape[0])
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 2e-6
    # bf16 activations are widened exactly and the answer rounded once: float32's answer in bf16.
    xb = x.bfloat16()
    assert torch.equal(product(xb), product(xb.float()).bfloat16())
    # The request's output buffer is reused: an answer kept from one call is not changed by the next.
    first = product(x[:1])
    product(-x[:1])
    assert torch.equal(first, product(x[:1]))


def test_the_weight_is_read_where_it_lies_not_copied_at_build():
    q, scale = _weight(64, 32)
    product = Int8Product(q, scale, threads=1)
    # The constant shares q's memory (no copy at build); the plugin repacks it at the first call.
    q.neg_()
    x = torch.randn(1, 32)
    assert torch.allclose(product(x), x @ (q.float() * scale[:, None]).T, rtol=1e-5, atol=1e-6)


def test_importing_openvino_sends_no_telemetry():
    # openvino's package imports its model converter, which sends an event on import when openvino_telemetry (a
    # dependency of openvino) imports: ours blocks that import, so the converter takes its no-op stub.
    code = (
        "from fmoe_local import openvino_products as o; assert o.unavailable() == '', o.unavailable(); "
        "import openvino.tools.ovc.telemetry_utils as t, sys; "
        "print(t.tm.__name__, sys.modules.get('openvino_telemetry'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["openvino.tools.ovc.telemetry_stub", "None"]


@pytest.fixture
def no_openvino(monkeypatch):
    """openvino as on a machine where it cannot be imported (the module's import seam)."""

    def fail() -> None:
        raise ImportError("No module named 'openvino'")

    openvino_products._openvino.cache_clear()
    monkeypatch.setattr(openvino_products, "_import_openvino", fail)
    yield
    openvino_products._openvino.cache_clear()


def test_without_openvino_a_load_says_torch_s_product_runs_and_gives_eager_s_tokens(
    no_openvino, tiny_model_dir, tmp_path, caplog
):
    model_dir = tiny_model_dir("mixtral")
    with (
        caplog.at_level(logging.WARNING),
        Runtime.load(model_dir, _config("int8", tmp_path, dense_int8_product="auto")) as runtime,
    ):
        assert runtime.info.dense_product == "torch" and runtime.info.dense_repacked_bytes == 0
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "multiplied by torch's _weight_int8pack_mm" in said and "openvino is not importable here" in said
        expected, _ = reference_tokens(model_dir, "int8", runtime.engine.encode_prompt(PROMPT))
        runtime.reconfigure(cache_experts=runtime.engine.shape.top_k, policy="on_demand", miss_handling="cpu")
        final = runtime.generate(PROMPT)
        assert final.token_ids == expected[: len(final.token_ids)]


def test_openvino_forced_where_it_cannot_be_imported_is_refused_with_what_to_do(no_openvino, tiny_model_dir, tmp_path):
    config = _config("int8", tmp_path, dense_int8_product="openvino")
    with pytest.raises(ValueError, match="openvino is not importable here.*choose dense int8 product auto or torch"):
        Runtime.load(tiny_model_dir("mixtral"), config)


def test_a_weight_that_does_not_compile_falls_back_to_torch_s_product_for_the_rest(
    tiny_model_dir, tmp_path, caplog, monkeypatch
):
    built = []

    def compile_once(q, scale, threads, core=None):
        if built:
            raise RuntimeError("Exception from src/inference/src/cpp/core.cpp: compile failed")
        built.append(Int8Product(q, scale, threads, core))
        return built[-1]

    monkeypatch.setattr(openvino_products, "Int8Product", compile_once)
    model_dir = tiny_model_dir("mixtral")
    config = _config("int8", tmp_path, dense_int8_product="openvino")
    with caplog.at_level(logging.WARNING), Runtime.load(model_dir, config) as runtime:
        layers = [m for m in runtime.engine.model.modules() if isinstance(m, PackedLinear)]
        assert [m.product is not None for m in layers] == [True] + [False] * (len(layers) - 1)
        assert runtime.info.dense_product == "openvino, torch"
        assert "could not compile" in caplog.text and "torch's _weight_int8pack_mm" in caplog.text
        expected, _ = reference_tokens(model_dir, "int8", runtime.engine.encode_prompt(PROMPT))
        runtime.reconfigure(cache_experts=runtime.engine.shape.top_k, policy="on_demand", miss_handling="cpu")
        final = runtime.generate(PROMPT)
        assert final.token_ids == expected[: len(final.token_ids)]


@pytest.mark.parametrize("size", ["small", "large"])
def test_the_probe_measures_both_products(size):
    ratio = openvino_products.measured_ratio(torch.float32, threads=1, repeats=1, size=size)
    assert 0 < ratio < float("inf")


def test_an_output_head_is_judged_by_the_large_probe_and_attention_weights_by_the_small():
    from fmoe_local.catalog import CATALOG

    for entry in CATALOG:  # none ties its head to the input table: the head has the table's shape, one byte a code
        assert openvino_products.size_class(entry.embedding_bytes // 2) == "large", entry.repo_id
    for out_f, in_f in [(4096, 4096), (4096, 2880), (1024, 4096), (10944, 2048)]:  # Mixtral, GPT-OSS, DeepSeek
        assert openvino_products.size_class(out_f * in_f) == "small"
