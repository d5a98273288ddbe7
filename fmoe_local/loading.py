"""Load a MoE checkpoint for offloading: non-expert weights on the device, routed experts in a host store.

Scope: build the model skeleton on the meta device from the checkpoint's config, read the safetensors files key by
key, put every non-expert parameter and buffer on the device (renaming keys exactly as transformers does when it
loads this model type), restore the buffers transformers computes at construction (rotary inv_freq), tie word
embeddings where the config says so, pack the dense linear layers where the dense format says so
(dense_formats.py), and build the HostStore that serves the experts one at a time. The experts
modules' 3-D parameters stay on meta: the runtime computes from cache slots. It does NOT register the experts
implementation, create the cache or generate.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from fmoe_local import bnb_checkpoint, dense_formats, dtype_verdicts, expert_formats, hardware, hf_internals
from fmoe_local.architectures import Architecture, MoELayerRef, architecture_for
from fmoe_local.config import RuntimeConfig
from fmoe_local.host import CheckpointFiles, CheckpointHostStore, TieredHostStore
from fmoe_local.packed_host import build_packed_host, resolve_format
from fmoe_local.quant_cache import DenseCopy, Progress

log = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass
class LoadedModel:
    model: PreTrainedModel  # non-expert weights on the device; experts' 3-D parameters on meta
    tokenizer: PreTrainedTokenizerBase
    arch: Architecture
    host: TieredHostStore  # dense (CheckpointHostStore) or packed (packed_host.PackedHostStore)
    moe_layers: list[MoELayerRef]
    dtype: torch.dtype  # compute dtype of the resident weights and of the host store's rows
    dense_format: str = "bf16"  # how the dense linear weights are stored (dense_formats.resolve: bf16, int8, int4)
    unexpected_keys: list[str] = field(default_factory=list)  # checkpoint keys the model has no place for


def load_model(
    model_dir: str | Path,
    config: RuntimeConfig | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    progress: Progress | None = None,
    prefers_openvino: Callable[[torch.dtype, str], bool] | None = None,
) -> LoadedModel:
    """Load `model_dir` (a Hugging Face checkpoint directory in safetensors) for expert offloading.

    `dtype=None` keeps the checkpoint's dtype. Host RAM for experts follows `config.host_ram_gb` (None = what
    the available RAM holds, hardware.host_ram_budget_gb).
    `progress(done, total)` is called per expert while an int8/nf4 copy is made (quant_cache.py), only then.
    `prefers_openvino(dtype, size)`: the machine's verdict on the dense int8 product for weights of a size class
    (DtypeVerdicts.dense_prefers_openvino; None = a fresh DtypeVerdicts', which measures it), asked only when dense
    weights are packed int8 and `config.dense_int8_product` is auto.
    """
    model_dir = Path(model_dir)
    config = config or RuntimeConfig()
    device = torch.device(device)
    hf_internals.check_installed()
    hf_config = read_config(model_dir)
    arch = architecture_for(hf_config)
    _drop_supported_quantization(hf_config, arch)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    files = CheckpointFiles(model_dir)
    try:
        model, moe_layers, host, unexpected, dtype, dense = _build(
            model_dir, hf_config, arch, files, config, device, dtype, progress, prefers_openvino
        )
    except BaseException:
        files.close()  # no half-loaded model keeps the checkpoint mapped
        raise
    if unexpected:
        log.info("Ignored %d checkpoint tensors the model does not use (e.g. %s)", len(unexpected), unexpected[0])
    return LoadedModel(model, tokenizer, arch, host, moe_layers, dtype, dense, unexpected)


def read_config(model_dir: str | Path) -> PretrainedConfig:
    """The checkpoint's config.json as transformers reads it. A file that is missing (FileNotFoundError), not JSON
    or holding a value transformers refuses (ValueError) is a sentence naming the file and what to do: a
    download cut short or a hand edit, which transformers reports as a traceback of its own types."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"No config.json in {model_dir}. Choose the folder of a downloaded model.")
    try:
        return AutoConfig.from_pretrained(model_dir)
    except ValueError:
        raise  # transformers' own sentences, e.g. a model type this version does not know
    except Exception as exc:  # noqa: BLE001 - OSError for broken JSON, huggingface_hub's validation errors, …
        why = _config_fault(path) or " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(
            f"The config.json of {model_dir.name} cannot be read ({why.rstrip('.')}). Download the model again, "
            "or correct the file."
        ) from exc


def _config_fault(path: Path) -> str:
    """What is wrong with config.json's text itself, or "" when it is readable JSON (then transformers' reason
    counts, not its "It looks like the config file … is not a valid JSON file" for any failure to read it)."""
    import json

    try:
        json.loads(path.read_bytes())
    except OSError as exc:
        return exc.strerror or str(exc)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        return f"it is not valid JSON: {exc}"
    return ""


def _build(
    model_dir: Path,
    hf_config: object,
    arch: Architecture,
    files: CheckpointFiles,
    config: RuntimeConfig,
    device: torch.device,
    dtype: torch.dtype | None,
    progress: Progress | None = None,
    prefers_openvino: Callable[[torch.dtype, str], bool] | None = None,
) -> tuple[PreTrainedModel, list[MoELayerRef], TieredHostStore, list[str], torch.dtype, str]:
    """The meta skeleton, its resident weights (dense linear layers packed as the dense format says) and the host
    store (see load_model)."""
    dense_formats.check(config.dense_format, device)  # before any weight is read
    dtype = dtype or _checkpoint_dtype(hf_config, files)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.eval()
    if (model_dir / "generation_config.json").exists():
        # Extra stop tokens (e.g. chat end-of-turn ids) often live only here; from_pretrained reads it too.
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    moe_layers = arch.moe_layers(model)
    lacking = hf_internals.missing_experts_attributes(moe_layers[0].experts)
    if lacking:
        raise RuntimeError(
            f"This transformers version's {type(moe_layers[0].experts).__name__} lacks {', '.join(lacking)}, which "
            "fmoe-local computes experts with. Reinstall with the launcher's --repair (the tested version)."
        )
    module_names = {id(m): n for n, m in model.named_modules()}
    expert_prefixes = tuple(module_names[id(ref.experts)] + "." for ref in moe_layers)
    expert_params = {p + name for p in expert_prefixes for name in arch.expert_param_names}

    unexpected = _load_resident(model, files, expert_prefixes, device, dtype)
    _restore_computed_buffers(model, device)
    _check_complete(model, expert_params)

    param_shapes = {name: tuple(getattr(moe_layers[0].experts, name).shape[1:]) for name in arch.expert_param_names}
    num_experts = arch.num_experts(hf_config)
    sources = [[arch.expert_sources(ref.layer_index, e, files) for e in range(num_experts)] for ref in moe_layers]
    fmt = resolve_format(config.expert_format, sources, files)
    dense = dense_formats.resolve(config.dense_format, device, fmt)
    transposed = hf_internals.is_transposed(moe_layers[0].experts)
    if device.type == "cpu":  # before the packed weights are read: the formats this device multiplies packed
        expert_formats.check_cpu_products([dense] + ([] if transposed else [fmt]), dtype)
    copy, product = None, None
    if dense in dense_formats.PACKED:  # only ever on a CPU device: int4 is kept in this CPU's layout
        layout_key = dtype_verdicts.torch_cpu_key() if dense == "int4" else None
        copy = DenseCopy(config.quant_cache_dir, model_dir, dense, dtype, layout_key)
    if dense == "int8":
        prefers = prefers_openvino or dtype_verdicts.DtypeVerdicts().dense_prefers_openvino
        product = dense_formats.int8_product(config.dense_int8_product, dtype, prefers)
    keep = hf_internals.keep_in_fp32(model, dtype)
    dense_formats.quantise(model, arch, moe_layers, dense, keep, copy, product)
    if config.host_ram_gb is None:
        # Measured now, with the resident weights loaded; on the CPU the expert cache's slots come out of RAM too.
        on_host = device.type == "cpu" and config.cache_experts is None
        budget = hardware.host_ram_budget_gb(int(config.cache_gb * hardware.GIB) if on_host else 0)
        config = replace(config, host_ram_gb=budget)
    if fmt == "bf16":
        host = CheckpointHostStore(files, sources, param_shapes, dtype, config.host_ram_gb)
    else:
        products = device.type == "cpu"  # computed where they are stored: torch's weight-only CPU products
        host = build_packed_host(files, sources, param_shapes, dtype, fmt, transposed, config, progress, products)
    return model, moe_layers, host, unexpected, dtype, dense


def check_quantization(hf_config: object, arch: Architecture) -> None:
    """Refuse (ValueError, a sentence) a checkpoint quantized in a way the host store cannot read: it reads MXFP4
    GPT-OSS and bitsandbytes nf4. From the config alone, so that the app can refuse such a model before it unloads
    the one that works."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if arch.model_type == "gpt_oss" and str(method).lower().endswith("mxfp4"):
        return
    if str(method).lower() == "bitsandbytes":
        bnb_checkpoint.check_config(quant if isinstance(quant, dict) else quant.to_dict())
        return
    raise ValueError(
        f"This checkpoint is quantized ({method}), which fmoe-local cannot load. We read bf16/fp16/fp32 checkpoints, "
        f"GPT-OSS's MXFP4 and {bnb_checkpoint.READ}: download one of those releases of the model instead."
    )


def _drop_supported_quantization(hf_config: object, arch: Architecture) -> None:
    """The skeleton must hold plain (dequantised) parameters, not transformers' quantized modules: the host store
    reads the experts packed (packed_host.py), the rest is dequantised as it loads."""
    check_quantization(hf_config, arch)
    if getattr(hf_config, "quantization_config", None):
        del hf_config.quantization_config


def checkpoint_dtype(model_dir: str | Path) -> torch.dtype:
    """The dtype the checkpoint's weights are stored in (config.json's, else the first floating tensor's)."""
    files = CheckpointFiles(Path(model_dir))
    try:
        return _checkpoint_dtype(read_config(model_dir), files)
    finally:
        files.close()


def _checkpoint_dtype(hf_config: object, files: CheckpointFiles) -> torch.dtype:
    declared = getattr(hf_config, "dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    if isinstance(declared, torch.dtype) and declared.is_floating_point:
        return declared
    for key in files.keys():
        found = _SAFETENSORS_DTYPES.get(files.dtype_name(key))
        if found is not None:
            return found
    return torch.float32


def _load_resident(
    model: PreTrainedModel,
    files: CheckpointFiles,
    expert_prefixes: tuple[str, ...],
    device: torch.device,
    dtype: torch.dtype,
) -> list[str]:
    """Every non-expert tensor of the checkpoint onto `device`, key by key; returns the keys with no target."""
    rename = hf_internals.key_renamer(model)
    targets = model.state_dict()  # meta tensors: names, shapes and dtypes, no memory
    fp32 = hf_internals.keep_in_fp32(model, dtype)
    loaded: dict[str, torch.Tensor] = {}
    unexpected = []
    for file_keys in files.files_keys().values():
        for key in file_keys:
            name = rename(key, targets)
            if name not in targets and key in targets:
                name = key
            if name.startswith(expert_prefixes):
                continue  # routed experts: the host store reads them per expert
            if bnb_checkpoint.is_auxiliary(key):
                continue  # a 4-bit weight's quant state: read with its weight
            target = targets.get(name)
            if target is None:
                unexpected.append(key)
                continue
            want = torch.float32 if fp32(name) else target.dtype
            quantised = bnb_checkpoint.is_quantised(files, key)
            tensor = bnb_checkpoint.dequantize(files, key, want) if quantised else files.get(key)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"'{key}' has shape {tuple(tensor.shape)} in the checkpoint but the model expects "
                    f"{tuple(target.shape)}. The checkpoint does not match its config.json: download it again."
                )
            loaded[name] = tensor.to(device=device, dtype=want if tensor.is_floating_point() else tensor.dtype)
    # assign=True swaps the meta tensors for ours (no copy, no extra device memory).
    model.load_state_dict(loaded, strict=False, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    missing = {n for n, t in model.state_dict().items() if t.device.type == "meta"}
    hf_internals.tie_weights(model, missing)
    return unexpected


def _restore_computed_buffers(model: PreTrainedModel, device: torch.device) -> None:
    """Non-persistent buffers (rotary inv_freq) are computed in __init__, so on meta they hold nothing: recompute.

    transformers' own weight initialisation knows how (it is what from_pretrained runs for them); NaN-filling first
    lets us tell when it did not.
    """
    owners: dict[int, tuple[nn.Module, list[str]]] = {}
    for module in model.modules():
        names = [n for n in module._non_persistent_buffers_set if getattr(module, n, None) is not None]
        if names:
            owners[id(module)] = (module, names)
    for module, names in owners.values():
        for name in names:
            meta = getattr(module, name)
            module.register_buffer(name, torch.full_like(meta, math.nan, device=device), persistent=False)
        hf_internals.init_computed_buffers(model, module)
        for name in names:
            value = getattr(module, name)
            if value.is_floating_point() and torch.isnan(value).any():
                raise ValueError(
                    f"Could not compute buffer '{name}' of {type(module).__name__} for this model. "
                    "Update transformers or report the model."
                )


def _check_complete(model: PreTrainedModel, expert_params: set[str]) -> None:
    missing = [n for n, t in model.state_dict().items() if t.device.type == "meta" and n not in expert_params]
    if missing:
        shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
        raise ValueError(
            f"The checkpoint lacks {len(missing)} weights the model needs ({shown}). "
            "The download may be incomplete: download the model again."
        )
