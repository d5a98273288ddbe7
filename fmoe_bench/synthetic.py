"""Synthetic models for the live benchmark: real per-layer shapes, random weights, routing forced from a trace.

Scope: `SYNTHETIC` (published shapes), `build_synthetic` (a checkpoint directory with N layers of those shapes,
random weights and a small byte-level tokenizer, written with save_pretrained so that the runtime loads and
offloads it like any download), `fold_trace` (a recorded trace folded onto the synthetic model's L × J) and
`ForcedRouting` (router forward hooks that RETURN the trace's routing, the official hook API). It does NOT time
anything or run policies (fmoe_bench/live.py does), and the outputs of a random model mean nothing: only the copies,
the compute and the routing are real.

Shapes: R trace rows (tokens), T tokens in a forward pass, N model MoE layers, J model experts, K model top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fmoe_local.traces import Trace

# Sources: each model's config.json on the Hub (mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B); num_hidden_layers
# is --layers.
SYNTHETIC: dict[str, dict] = {
    "mixtral-8x7b": dict(
        model_type="mixtral",
        hidden_size=4096,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32000,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        sliding_window=None,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
    ),
}
TOKENIZER_VOCAB = 2048  # the model's vocabulary stays real-sized; ids the tokenizer lacks decode to nothing


def experts_and_top_k(shapes: dict) -> tuple[int, int]:
    """(J, K) of a SYNTHETIC entry: the families name the expert count differently (Mixtral num_local_experts,
    Qwen num_experts)."""
    experts = shapes.get("num_local_experts", shapes.get("num_experts"))
    return int(experts), int(shapes["num_experts_per_tok"])


def build_synthetic(
    out_dir: str | Path,
    shapes: dict,
    num_layers: int,
    texts: Sequence[str],
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    init_device: str = "cpu",
) -> Path:
    """Write a `shapes` model with `num_layers` layers and random weights to `out_dir`; returns `out_dir`.

    The tokenizer is byte-level BPE trained on `texts` (the benchmark's prompts). No token is end-of-sequence, so
    every request generates exactly the tokens asked for.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if num_layers < 1:
        raise ValueError("A synthetic model needs at least one layer: pass --layers 1 or more.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(texts, out_dir, min(TOKENIZER_VOCAB, int(shapes["vocab_size"])))
    fields = {k: v for k, v in shapes.items() if k != "model_type"}
    config = AutoConfig.for_model(
        shapes["model_type"],
        **fields,
        num_hidden_layers=num_layers,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    # Initialising billions of weights is far faster on a GPU; save_pretrained copies them back to the host.
    with torch.device(init_device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None
    model.save_pretrained(out_dir)
    del model
    if init_device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out_dir


def _train_tokenizer(texts: Sequence[str], out_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(list(texts) or ["synthetic"], trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(out_dir)


@dataclass(frozen=True)
class FoldedTrace:
    """A trace's routing mapped onto a model with N MoE layers, J experts and top-K."""

    probs: np.ndarray  # [R, N, J] float32, folded distributions
    ids: np.ndarray  # [R, N, K] int64, top-K of the folded distribution (descending probability)
    weights: np.ndarray  # [R, N, K] float32, their probabilities renormalised to sum 1 (Mixtral's router does)
    request_starts: list[int]  # first row of every trace request
    mapping: str  # one sentence saying how the trace was folded


def fold_trace(trace: Trace, num_layers: int, num_experts: int, top_k: int, name: str = "trace") -> FoldedTrace:
    """Model layer m takes trace layer m mod L; trace expert e counts for model expert e mod J (probabilities are
    summed); the model's experts are the top-K of that folded distribution, ties to the lower expert id."""
    dist = trace.distributions(0, trace.num_rows)  # [R, L, J_trace]
    layers = [m % trace.num_layers for m in range(num_layers)]
    probs = np.zeros((trace.num_rows, num_layers, num_experts), np.float32)
    for e in range(trace.num_experts):
        probs[:, :, e % num_experts] += dist[:, layers, e]
    ids = np.argsort(-probs, axis=2, kind="stable")[:, :, :top_k]
    top = np.take_along_axis(probs, ids, axis=2)
    weights = top / np.clip(top.sum(axis=2, keepdims=True), 1e-20, None)
    mapping = (
        f"routing forced from {name} ({trace.num_layers} layers x {trace.num_experts} experts, top-{trace.top_k}): "
        f"model layer m <- trace layer m mod {trace.num_layers}; trace expert e -> model expert e mod {num_experts} "
        f"(probabilities summed); top-{top_k} of the folded distribution; request i follows trace request "
        f"i mod {len(trace.requests())} from its first row, one trace row per token"
    )
    starts = [start for _, start, _ in trace.requests()]
    return FoldedTrace(probs, ids.astype(np.int64), weights.astype(np.float32), starts, mapping)


class ForcedRouting:
    """Forward hooks on the routers that replace `(logits, top-K weights, top-K ids)` with the folded trace's.

    Registered with `prepend=True` so that every other hook (the runtime's observer) already sees the forced
    routing. Logits are log-probabilities, so a softmax of them gives back the folded distribution. The whole
    folded trace is uploaded once, so a hook never copies from the host or waits for the device.
    """

    def __init__(self, folded: FoldedTrace, routers: Sequence[object], device: object) -> None:
        import torch

        self._routers = list(routers)
        self._starts = folded.request_starts
        self._rows = int(folded.probs.shape[0])
        self._log_probs = torch.from_numpy(folded.probs).clamp_min(1e-9).log().to(device)  # [R, N, J]
        self._ids = torch.from_numpy(folded.ids).to(device)  # [R, N, K]
        self._weights = torch.from_numpy(folded.weights).to(device)  # [R, N, K]
        self._start = 0  # first row of the current forward pass
        self._next = 0  # first row of the next forward pass
        self._handles: list = []

    def attach(self) -> ForcedRouting:
        for layer, router in enumerate(self._routers):
            self._handles.append(router.register_forward_hook(self._hook(layer), prepend=True))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def begin_request(self, index: int) -> None:
        """Call between requests: request `index` follows trace request `index` (mod their number)."""
        self._next = self._starts[index % len(self._starts)]

    def _hook(self, layer: int):  # noqa: ANN202 - returns a torch forward hook
        import torch

        def hook(module: object, inputs: tuple, output: tuple) -> tuple:
            logits, weights, ids = output
            tokens = logits.shape[0]
            if layer == 0:  # a new forward pass: it takes the next `tokens` rows
                self._start, self._next = self._next, self._next + tokens
            rows = torch.arange(self._start, self._start + tokens, device=self._ids.device) % self._rows  # [T]
            return (
                self._log_probs[rows, layer].to(logits.dtype),
                self._weights[rows, layer].to(weights.dtype),
                self._ids[rows, layer].to(ids.dtype),
            )

        return hook
