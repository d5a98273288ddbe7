"""RoutingObserver: forward hooks that turn each forward pass into policy events (the expert map as it forms).

Scope: reading the embedding layer's output (semantic embedding) and every router's output (gate probabilities)
with `register_forward_hook`, and publishing them to the prefetcher; optionally keeping per-token rows for trace
recording. It does NOT compute experts or change any module's output.

Shapes: T tokens in the forward pass, h hidden size, J experts, L MoE layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fmoe_local.architectures import Architecture, MoELayerRef


class RoutingObserver:
    def __init__(
        self,
        embedding: torch.nn.Module,
        moe_layers: Sequence[MoELayerRef],
        arch: Architecture,
        publish: Callable[..., None],
        semantic_mode: str = "running_mean",
        per_layer: Callable[[], bool] = lambda: True,
    ) -> None:
        self._embedding = embedding
        self._layers = list(moe_layers)
        self._arch = arch
        self._publish = publish
        self.semantic_mode = semantic_mode
        self._per_layer = per_layer  # False while the consumer takes the pass whole: no lookahead to compute
        self.want_lookahead = False
        self.recording = False  # keep per-token rows for a trace
        self.rows_probs: list[torch.Tensor] = []  # per layer [T, J] of the current forward pass
        self.rows_embed: torch.Tensor | None = None  # [T, h]
        self._sum: torch.Tensor | None = None  # running sum of the request's token embeddings [h]
        self._count = 0
        # The embeddings' sum and count of prompt tokens a kept KV cache holds (prefix_cache.py): not run through
        # the model in this request, they still count in its first iteration's semantic embedding.
        self._reused: tuple[torch.Tensor, int] | None = None
        # The last request's reused ids [m] and their sum: requests under one system prompt reuse the same ids, and
        # gathering their embeddings again cost as much as a layer's attention over them (docs/bench.md).
        self._last_reused: tuple[torch.Tensor, torch.Tensor] | None = None
        self._in_lookahead = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self) -> None:
        self._handles.append(self._embedding.register_forward_hook(self._on_embedding))
        for ref in self._layers:
            self._handles.append(ref.router.register_forward_hook(self._router_hook(ref.moe_index)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def begin_request(self, reused_ids: torch.Tensor | None = None) -> None:
        """`reused_ids` [1, m]: the prompt's first tokens, which a kept KV cache holds and the prefill skips. The
        semantic embedding still covers them, so the semantic match sees the whole prompt, as without reuse."""
        self._sum, self._count, self._reused = None, 0, None
        if reused_ids is not None and reused_ids.numel():
            self._reused = (self._reused_sum(reused_ids.reshape(-1)), reused_ids.numel())

    def _reused_sum(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings' sum over `ids`, the last request's own when it reused the same ids (the same bits)."""
        last = self._last_reused
        if last is not None and last[0].shape == ids.shape and torch.equal(last[0], ids):
            return last[1]
        total = self._embedding_sum(ids)
        self._last_reused = (ids.clone(), total)
        return total

    def _embedding_sum(self, ids: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """Sum of the embedding layer's output over `ids`, in chunks (a long prompt's [T, h] at once is large);
        `forward` directly, so that the hooks do not take it for an iteration."""
        total = None
        with torch.inference_mode():
            for start in range(0, ids.numel(), chunk):
                out = self._embedding.forward(ids[start : start + chunk].unsqueeze(0))
                part = out.reshape(-1, out.shape[-1]).float().sum(0)
                total = part if total is None else total + part
        return total

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def _on_embedding(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        tokens = output.detach().reshape(-1, output.shape[-1]).float()  # [T, h]
        reused, self._reused = self._reused, None
        if self.semantic_mode == "running_mean":
            total = tokens.sum(0)
            if reused is not None:
                total = total + reused[0]
                self._count += reused[1]
            self._sum = total if self._sum is None else self._sum + total
            self._count += tokens.shape[0]
            semantic = self._sum / self._count
        elif reused is not None:
            semantic = (tokens.sum(0) + reused[0]) / (tokens.shape[0] + reused[1])
        else:
            semantic = tokens.mean(0)
        if self.recording:
            self.rows_embed = tokens
            self.rows_probs = []
        # `semantic` is a fresh tensor (the running sum is replaced, never updated in place): no copy needed.
        self._publish("begin_iteration", value=semantic)

    def _router_hook(self, layer: int) -> Callable:
        def hook(module: torch.nn.Module, inputs: tuple, output: object) -> None:
            if self._in_lookahead:
                return
            probs = self._arch.router_probs(output).detach()  # [T, J] float32
            if self.recording:
                self.rows_probs.append(probs)
            lookahead = None
            if self.want_lookahead and layer + 1 < len(self._layers) and self._per_layer():
                lookahead = self._lookahead(layer, inputs[0])
            # A decode step's mean is its one row: a view costs a fraction of a reduction's dispatch.
            mean = probs[0] if probs.shape[0] == 1 else probs.mean(0)  # [J]
            self._publish("layer", layer=layer, value=mean, lookahead=lookahead)

        return hook

    def _lookahead(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Layer l+1's router applied to layer l's router input: the speculative policies' guess."""
        self._in_lookahead = True
        try:
            with torch.no_grad():
                out = self._layers[layer + 1].router(hidden)
            return self._arch.router_probs(out).detach().float().mean(0)
        finally:
            self._in_lookahead = False
