"""The one place fmoe-local touches transformers' internals (anything not in its documented public API).

Scope: loading a checkpoint key by key the way `from_pretrained` does (key renaming, keep-in-fp32 rules, weight
tying, computed buffers), the experts hook (`ExpertsInterface`), which attention implementation a model runs and its
modeling file's eager attention function, the attributes of the fused experts modules our experts implementation
reads (layout flags, the gate), and rendering a chat template the way `apply_chat_template` does (its sandboxed
environment), which chat_template.py runs in a child process; which layers of a DynamicCache are sliding-window
ones, and their window (kv_cache.py replaces them with its own). torch is imported for type hints only, so that child
starts without it. Everything else in fmoe_local uses public API only.
It does NOT decide anything: each function is a thin, named door to one internal.

Why: these internals change between transformers releases without notice. pyproject and constraints.txt pin the
minor release the tests ran on (.ci/next-transformers tries the next one); `missing_internals()` says by name which
one moved, or no longer takes the arguments we pass it (its signature, checked with inspect), when another version is
installed, and the loader calls it first so a user on a broken combination gets a sentence instead of an
AttributeError or a TypeError deep inside loading.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class _Internal:
    """One internal this file uses and how it calls it: the parameters it passes by position (their names, in
    order; `self` first for a method looked up on its class) and by name ("**": names of its own choosing). A class
    we only test with isinstance has `called=False`."""

    module: str
    name: str
    positional: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    called: bool = True


# The experts modules' attributes are checked on a live module (missing_experts_attributes).
_REQUIRED = (
    _Internal("transformers.conversion_mapping", "get_model_conversion_mapping", ("model",)),
    _Internal("transformers.core_model_loading", "WeightConverter", called=False),
    _Internal("transformers.core_model_loading", "WeightRenaming", called=False),
    _Internal("transformers.core_model_loading", "build_glob_alternation", ("globs",)),
    _Internal(
        "transformers.core_model_loading",
        "rename_source_key",
        ("source_key", "weight_renamings", "weight_converters", "base_model_prefix", "meta_state_dict"),
    ),
    _Internal("transformers.integrations.moe", "ExpertsInterface.register", ("key", "value")),
    _Internal("transformers", "PreTrainedModel._get_dtype_plan", ("self", "dtype")),
    _Internal("transformers", "PreTrainedModel._init_weights", ("self", "module")),
    _Internal("transformers", "PreTrainedModel.tie_weights", ("self",), ("missing_keys", "recompute_mapping")),
    _Internal("transformers", "PreTrainedModel.set_experts_implementation", ("self", "experts_implementation")),
    _Internal(
        "transformers.utils.chat_template_utils",
        "render_jinja_template",
        keywords=("conversations", "chat_template", "add_generation_prompt", "continue_final_message", "**"),
    ),
    _Internal("transformers.cache_utils", "DynamicSlidingWindowLayer", called=False),
)
_EXPERTS_FLAGS = ("is_transposed", "has_bias", "has_gate", "num_experts")


def _lookup(module: str, dotted: str) -> object:
    obj: object = importlib.import_module(module)
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _signature_changed(internal: _Internal, obj: object) -> str | None:
    """How `obj` no longer takes the call this file makes, or None when it does."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "has no signature to check"
    n = len(internal.positional)
    leading = list(sig.parameters.values())[:n]
    by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = {k: None for k in internal.keywords if k != "**"}
    if "**" in internal.keywords:
        named["a_template_variable"] = None
    fits = [p.name for p in leading] == list(internal.positional) and all(p.kind in by_position for p in leading)
    try:
        sig.bind(*internal.positional, **named)
    except TypeError:
        fits = False
    return None if fits else f"now takes {sig}"


def missing_internals() -> list[str]:
    """The internals this module needs that the installed transformers lacks, as `module.name` strings, and those
    whose signature no longer takes our call, as `module.name (now takes (...))`."""
    problems = []
    for internal in _REQUIRED:
        where = f"{internal.module}.{internal.name}"
        try:
            obj = _lookup(internal.module, internal.name)
        except (ImportError, AttributeError):
            problems.append(where)
            continue
        changed = _signature_changed(internal, obj) if internal.called else None
        if changed:
            problems.append(f"{where} ({changed})")
    return problems


def check_installed() -> None:
    """Raise a sentence naming what moved or changed when the installed transformers lacks an internal we use."""
    missing = missing_internals()
    if missing:
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__} lacks {', '.join(missing)}, which fmoe-local needs to load "
            "models in the form it calls them. Reinstall with the launcher's --repair (it installs the tested "
            "transformers version)."
        )


def missing_experts_attributes(experts: nn.Module) -> list[str]:
    """The attributes our experts implementation reads that this fused experts module lacks (the gate for gated
    and GPT-OSS layouts, the activation for the ungated one)."""
    missing = [a for a in _EXPERTS_FLAGS if not hasattr(experts, a)]
    if missing:
        return missing
    gated = experts.has_gate or experts.is_transposed
    return [a for a in (("_apply_gate",) if gated else ("act_fn",)) if not hasattr(experts, a)]


# ---- loading: key renaming and dtype rules as from_pretrained applies them ----------------------------------------


def key_renamer(model: nn.Module) -> Callable[[str, dict], str]:
    """A function checkpoint key → model parameter name, with this model type's conversion mapping."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    prefix = model.base_model_prefix

    def rename(key: str, targets: dict) -> str:
        name, _ = rename_source_key(key, renamings, converters, prefix, targets)
        return name

    return rename


def keep_in_fp32(model: nn.Module, dtype: torch.dtype) -> Callable[[str], bool]:
    """Whether a parameter name stays float32 under transformers' keep-in-fp32 rules for `dtype`."""
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype)
    if not plan:
        return lambda name: False
    pattern = build_glob_alternation(list(plan))[0]
    return lambda name: pattern.search(name) is not None


def tie_weights(model: nn.Module, missing: set[str]) -> None:
    """Tie word embeddings where the config says so, for parameters still on meta."""
    model.tie_weights(missing_keys=missing, recompute_mapping=False)


def init_computed_buffers(model: nn.Module, module: nn.Module) -> None:
    """Let transformers compute `module`'s non-persistent buffers (rotary inv_freq), as from_pretrained does."""
    model._init_weights(module)


# ---- the experts hook and the fused experts modules ----------------------------------------------------------------


def attention_implementation(model: nn.Module) -> str | None:
    """The attention implementation `model` runs ("sdpa", "eager", …; set_attn_implementation sets it)."""
    return model.config._attn_implementation


def eager_attention(module: nn.Module) -> Callable | None:
    """The eager attention function of the modeling file that defines `module` (an attention layer or its model),
    the one its forward falls back to (GPT-OSS's adds the sinks), or None where that file has none by that name."""
    import sys

    found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return found if callable(found) else None


def register_experts_implementation(name: str, forward: Callable) -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, forward)


def is_transposed(experts: nn.Module) -> bool:
    """GPT-OSS layout: rows [H, 2I] and [I, H], gate/up interleaved."""
    return bool(experts.is_transposed)


def has_bias(experts: nn.Module) -> bool:
    return bool(experts.has_bias)


def has_gate(experts: nn.Module) -> bool:
    return bool(experts.has_gate)


def apply_gate(experts: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """The module's own gated activation of a fused gate/up projection."""
    return experts._apply_gate(gate_up)


def activation(experts: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return experts.act_fn


# ---- chat templates --------------------------------------------------------------------------------------------


def render_chat_template(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool,
    continue_final_message: bool | str,
    variables: dict,
) -> str:
    """The prompt text `tokenizer.apply_chat_template(messages, tokenize=False, ...)` renders: the same sandboxed
    jinja2 environment (its globals, filters and extensions), the same handling of a message to continue, and
    `variables` (the tokenizer's special_tokens_map) as template variables; keys whose value is None are dropped
    first, as apply_chat_template drops them. Needs no tokenizer, so a process without the model can run it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    rendered, _ = render_jinja_template(
        conversations=[chat],
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **variables,
    )
    return rendered[0]


# ---- KV cache layers -----------------------------------------------------------------------------------------------


def sliding_window(layer: object) -> int | None:
    """The window of transformers' sliding-window dynamic layer (which keeps only its last window − 1 tokens), None
    for any other layer."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    return int(layer.sliding_window) if type(layer) is DynamicSlidingWindowLayer else None
