"""hf_internals: every transformers internal we use exists in the installed version and takes the call we make, and
a moved or changed one is named."""

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


def test_a_changed_signature_is_named_before_loading_starts(tiny_model_dir, monkeypatch):
    """Same name, a new required parameter before the ones we pass: found by its signature, not by a TypeError
    deep inside loading."""

    def rename_source_key(source_key, scope, weight_renamings, weight_converters, base_model_prefix=None, **kw):
        raise AssertionError("never called: the check comes first")

    monkeypatch.setattr(core_model_loading, "rename_source_key", rename_source_key)
    [problem] = hf_internals.missing_internals()
    assert problem.startswith("transformers.core_model_loading.rename_source_key (now takes (source_key, scope, ")
    with pytest.raises(RuntimeError, match=r"lacks transformers\.core_model_loading\.rename_source_key \(now takes"):
        load_model(tiny_model_dir("olmoe"), RuntimeConfig(), "cpu", None)


def test_a_method_that_drops_a_keyword_we_pass_is_named(monkeypatch):
    from transformers import PreTrainedModel

    def tie_weights(self, missing_keys=None):
        pass

    monkeypatch.setattr(PreTrainedModel, "tie_weights", tie_weights)
    assert hf_internals.missing_internals() == [
        "transformers.PreTrainedModel.tie_weights (now takes (self, missing_keys=None))"
    ]


def test_positional_parameters_renamed_or_made_keyword_only_are_named(monkeypatch):
    """A call by position binds to whatever sits there: a renamed or reordered parameter is a changed meaning."""

    def renamed(patterns):
        pass

    def keyword_only(*, globs):
        pass

    for changed in (renamed, keyword_only):
        monkeypatch.setattr(core_model_loading, "build_glob_alternation", changed)
        [problem] = hf_internals.missing_internals()
        assert problem.startswith("transformers.core_model_loading.build_glob_alternation (now takes")


def test_a_template_renderer_that_takes_no_variables_is_named(monkeypatch):
    from transformers.utils import chat_template_utils

    def render_jinja_template(
        conversations, chat_template=None, add_generation_prompt=False, continue_final_message=False
    ):
        pass

    monkeypatch.setattr(chat_template_utils, "render_jinja_template", render_jinja_template)
    [problem] = hf_internals.missing_internals()
    assert problem.startswith("transformers.utils.chat_template_utils.render_jinja_template (now takes")


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
