"""hf_internals: every transformers internal we use exists in the installed version, and a moved one is named."""

from __future__ import annotations

import pytest
import transformers.core_model_loading as core_model_loading

from fmoe_local import hf_internals
from fmoe_local.config import RuntimeConfig
from fmoe_local.loading import load_model
from tests.tiny import FAMILIES


def test_the_installed_transformers_has_every_internal_we_use():
    assert hf_internals.missing_internals() == []


def test_a_moved_internal_is_named_before_loading_starts(tiny_model_dir, monkeypatch):
    monkeypatch.delattr(core_model_loading, "rename_source_key")
    assert hf_internals.missing_internals() == ["transformers.core_model_loading.rename_source_key"]
    with pytest.raises(RuntimeError, match=r"lacks transformers\.core_model_loading\.rename_source_key.*--repair"):
        load_model(tiny_model_dir("olmoe"), RuntimeConfig(), "cpu", None)


def test_a_moved_method_is_named(monkeypatch):
    from transformers import PreTrainedModel

    monkeypatch.delattr(PreTrainedModel, "_get_dtype_plan")
    assert hf_internals.missing_internals() == ["transformers.PreTrainedModel._get_dtype_plan"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_s_experts_module_has_what_we_read(tiny_model_dir, family):
    loaded = load_model(tiny_model_dir(family), RuntimeConfig(), "cpu", None)
    for ref in loaded.moe_layers:
        assert hf_internals.missing_experts_attributes(ref.experts) == []


def test_an_experts_module_without_the_gate_is_named(tiny_model_dir, monkeypatch):
    from transformers.models.olmoe import modeling_olmoe

    monkeypatch.delattr(modeling_olmoe.OlmoeExperts, "_apply_gate")
    with pytest.raises(RuntimeError, match="OlmoeExperts lacks _apply_gate"):
        load_model(tiny_model_dir("olmoe"), RuntimeConfig(), "cpu", None)
