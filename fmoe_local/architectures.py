"""Per-model facts about the supported MoE families, as implemented by the installed transformers (5.x).

Scope: where the MoE blocks, routers and fused experts modules sit in a model; which decoder layers are MoE; how a
router's output becomes a probability distribution over all J experts; how one expert's weights are named in a
checkpoint; which modules gate experts (routers, shared-expert gates: dense_formats.py never packs them). It does
NOT read files (host.py), load weights (loading.py) or compute experts (experts.py).

Families (`ARCHITECTURES`, a dict keyed by `config.model_type`): Mixtral, PhiMoE, Qwen2-MoE (Qwen1.5-MoE),
Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS — with their dense layers, shared experts and router kinds.
Shapes: T tokens, J routed experts, H hidden size, I expert intermediate size.

Checkpoint layouts (`Architecture.expert_sources`): most checkpoints store one tensor per expert and projection
(Mixtral `block_sparse_moe.experts.{e}.w1/w2/w3`; Qwen, DeepSeek, OLMoE `mlp.experts.{e}.gate_proj/up_proj/
down_proj`), which transformers fuses at load (`gate_up_proj[e] == cat([w1, w3])`); GPT-OSS stores them fused per
layer (`mlp.experts.gate_up_proj [E, H, 2I]`, transposed, gate/up interleaved, with biases), its official release as
MXFP4 (`*_blocks`, `*_scales`). Either way one expert's row is read without reading the layer.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

import torch
from torch import nn

# ---- how one expert's fused-parameter row is read from a checkpoint -----------------------------------------------


@dataclass(frozen=True)
class ConcatRows:
    """Per-expert tensors (each [out, in]) concatenated on dim 0, e.g. gate_up = cat([w1, w3])."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class FusedRow:
    """Row `expert` of a tensor fused over experts ([E, ...]), read with a slice."""

    key: str
    expert: int


@dataclass(frozen=True)
class Mxfp4Row:
    """Row `expert` of an MXFP4-packed fused tensor (`*_blocks` [E, out, G, 16], `*_scales` [E, out, G]).

    Dequantised it is [out, in]; GPT-OSS's parameter rows are [in, out], hence `transpose`.
    """

    blocks_key: str
    scales_key: str
    expert: int
    transpose: bool = True


ExpertSource = ConcatRows | FusedRow | Mxfp4Row


@dataclass(frozen=True)
class MoELayerRef:
    moe_index: int  # 0..L-1 over MoE layers only
    layer_index: int  # index among all decoder layers
    block: nn.Module  # the sparse MoE block (router + experts [+ shared experts])
    router: nn.Module  # its forward returns (router_logits [T, J], top-k weights, top-k indices)
    experts: nn.Module  # the fused experts module whose 3-D parameters the runtime replaces


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.float(), dim=-1)


def _normalised_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    # DeepSeek-V3 scores experts with a sigmoid; normalising makes them a distribution comparable across maps.
    scores = torch.sigmoid(logits.float())
    return scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)


def _every_layer(config: object, layer: int) -> bool:
    return True


def _qwen_is_moe(config: object, layer: int) -> bool:
    # Mirrors Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer.__init__.
    only_mlp = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer not in only_mlp and config.num_experts > 0 and (layer + 1) % step == 0


def _deepseek_is_moe(config: object, layer: int) -> bool:
    # Mirrors DeepseekV2/V3DecoderLayer.__init__ (transformers ignores moe_layer_freq).
    return layer >= (getattr(config, "first_k_dense_replace", 0) or 0)


@dataclass(frozen=True)
class Architecture:
    """Facts about one model family. Build with `architecture_for(config)`."""

    model_type: str
    experts_key: str  # config attribute holding J
    router_attr: str  # attribute of the MoE block holding the router
    is_moe_layer: Callable[[object, int], bool]
    to_probs: Callable[[torch.Tensor], torch.Tensor]
    expert_param_names: tuple[str, ...]  # the 3-D parameters of the experts module
    # Per-expert checkpoint layout: f"model.layers.{l}.{ckpt_block}.experts.{e}.{proj}.weight".
    ckpt_block: str = "mlp"
    gate_up_projs: tuple[str, ...] = ("gate_proj", "up_proj")
    down_projs: tuple[str, ...] = ("down_proj",)
    # Attribute of the MoE block holding the shared expert's gate (an nn.Linear to one logit), "" for none.
    shared_gate_attr: str = ""

    def num_experts(self, config: object) -> int:
        """J: routed experts per MoE layer."""
        return int(getattr(config, self.experts_key))

    def top_k(self, config: object) -> int:
        """K: experts the router picks per token."""
        return int(config.num_experts_per_tok)

    def moe_layer_indices(self, config: object) -> list[int]:
        """Decoder-layer indices whose MLP is a sparse MoE block, in order."""
        return [i for i in range(config.num_hidden_layers) if self.is_moe_layer(config, i)]

    def moe_layers(self, model: nn.Module) -> list[MoELayerRef]:
        """The MoE blocks of a built model (meta or real), numbered 0..L-1."""
        layers = model.base_model.layers
        refs = []
        for moe_index, layer_index in enumerate(self.moe_layer_indices(model.config)):
            block = layers[layer_index].mlp
            router = getattr(block, self.router_attr, None)
            experts = getattr(block, "experts", None)
            if router is None or experts is None:
                raise ValueError(
                    f"Layer {layer_index} of this {self.model_type} model has no router/experts where transformers "
                    f"{_transformers_version()} puts them. Update transformers or report the model."
                )
            refs.append(MoELayerRef(moe_index, layer_index, block, router, experts))
        return refs

    def gates(self, ref: MoELayerRef) -> list[nn.Module]:
        """The modules of one MoE block whose outputs weigh experts: its router and its shared expert's gate."""
        shared = getattr(ref.block, self.shared_gate_attr, None) if self.shared_gate_attr else None
        return [ref.router] + ([shared] if shared is not None else [])

    def router_probs(self, router_output: tuple | torch.Tensor) -> torch.Tensor:
        """Gate probabilities [T, J] (float32) from a router's output `(router_logits, weights, indices)`."""
        logits = router_output[0] if isinstance(router_output, tuple | list) else router_output
        return self.to_probs(logits.reshape(-1, logits.shape[-1]))

    # ---- checkpoint names ------------------------------------------------------------------------------------------
    def experts_prefix(self, layer_index: int) -> str:
        """Module path of the fused experts module (also the prefix of fused checkpoint keys)."""
        return f"model.layers.{layer_index}.mlp.experts"

    def expert_checkpoint_keys(self, layer_index: int, expert: int) -> dict[str, tuple[str, ...]]:
        """Per-expert checkpoint keys of one expert, by fused parameter (concatenated on dim 0 in this order)."""
        base = f"model.layers.{layer_index}.{self.ckpt_block}.experts.{expert}"
        keys = {
            "gate_up_proj": tuple(f"{base}.{p}.weight" for p in self.gate_up_projs),
            "down_proj": tuple(f"{base}.{p}.weight" for p in self.down_projs),
        }
        return {name: k for name, k in keys.items() if k}  # GPT-OSS has no per-expert layout

    def expert_sources(self, layer_index: int, expert: int, available: Container[str]) -> dict[str, ExpertSource]:
        """How to read each fused-parameter row of (layer, expert) from a checkpoint holding the keys `available`.

        Handles the three layouts found in the wild: one tensor per expert and projection, tensors already fused
        per layer (as transformers holds them, and GPT-OSS ships), and MXFP4-packed fused tensors (GPT-OSS).
        """
        sources: dict[str, ExpertSource] = {}
        per_expert = self.expert_checkpoint_keys(layer_index, expert)
        prefix = self.experts_prefix(layer_index)
        for name in self.expert_param_names:
            fused = f"{prefix}.{name}"
            if name in per_expert and all(k in available for k in per_expert[name]):
                sources[name] = ConcatRows(per_expert[name])
            elif fused in available:
                sources[name] = FusedRow(fused, expert)
            elif f"{fused}_blocks" in available and f"{fused}_scales" in available:
                sources[name] = Mxfp4Row(f"{fused}_blocks", f"{fused}_scales", expert)
            else:
                wanted = per_expert.get(name, ()) + (fused,)
                raise ValueError(
                    f"The checkpoint has no weights for expert {expert} of layer {layer_index} "
                    f"(looked for {', '.join(wanted)}). The download may be incomplete: download the model again."
                )
        return sources


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


_GATE_UP_DOWN = ("gate_up_proj", "down_proj")

ARCHITECTURES: dict[str, Architecture] = {
    "mixtral": Architecture(
        "mixtral", "num_local_experts", "gate", _every_layer, _softmax, _GATE_UP_DOWN,
        ckpt_block="block_sparse_moe", gate_up_projs=("w1", "w3"), down_projs=("w2",),
    ),
    "phimoe": Architecture(
        "phimoe", "num_local_experts", "router", _every_layer, _softmax, _GATE_UP_DOWN,
        ckpt_block="block_sparse_moe", gate_up_projs=("w1", "w3"), down_projs=("w2",),
    ),
    "qwen2_moe": Architecture(
        "qwen2_moe", "num_experts", "gate", _qwen_is_moe, _softmax, _GATE_UP_DOWN, shared_gate_attr="shared_expert_gate"
    ),
    "qwen3_moe": Architecture("qwen3_moe", "num_experts", "gate", _qwen_is_moe, _softmax, _GATE_UP_DOWN),
    "olmoe": Architecture("olmoe", "num_experts", "gate", _every_layer, _softmax, _GATE_UP_DOWN),
    "deepseek_v2": Architecture("deepseek_v2", "n_routed_experts", "gate", _deepseek_is_moe, _softmax, _GATE_UP_DOWN),
    "deepseek_v3": Architecture(
        "deepseek_v3", "n_routed_experts", "gate", _deepseek_is_moe, _normalised_sigmoid, _GATE_UP_DOWN
    ),
    # GPT-OSS ships its experts fused per layer ([E, H, 2I], gate/up interleaved) with biases: no per-expert keys.
    "gpt_oss": Architecture(
        "gpt_oss", "num_local_experts", "router", _every_layer, _softmax,
        ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"), gate_up_projs=(), down_projs=(),
    ),
}  # fmt: skip

SUPPORTED = tuple(ARCHITECTURES)


def architecture_for(config: object) -> Architecture:
    """The Architecture of a model config; a ValueError a user can act on for dense or unsupported models."""
    model_type = getattr(config, "model_type", None)
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        names = ", ".join(SUPPORTED)
        if not any(getattr(config, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
            raise ValueError(
                f"This model ({model_type}) is not a Mixture-of-Experts model, so there are no experts to offload. "
                f"Choose a MoE model of one of these families: {names}."
            )
        raise ValueError(f"MoE models of type '{model_type}' are not supported yet. Supported families: {names}.")
    if arch.num_experts(config) < 1 or not arch.moe_layer_indices(config):
        raise ValueError(
            f"This {model_type} configuration has no MoE layers, so there are no experts to offload. "
            f"Choose a MoE checkpoint of one of these families: {', '.join(SUPPORTED)}."
        )
    return arch
