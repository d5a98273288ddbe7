"""The token loop: prefill, then one decode step at a time with a KV cache; sampling; incremental detokenising.

Scope: turning a prompt's ids into generated ids, honouring a stop flag between tokens. It does NOT know about
offloading (the experts implementation does that inside the model's forward) nor about threads or statistics.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import torch
from transformers import DynamicCache

from fmoe_local.config import Sampling
from fmoe_local.logits_rules import LogitsRules


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Pick the next token from `logits` [V]."""
    if sampling.greedy or sampling.temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float()
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # ties with the k-th likeliest stay in
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < sampling.top_p  # always keeps the first
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def generate_ids(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,  # [1, T]
    sampling: Sampling,
    eos_ids: set[int],
    stop: threading.Event,
    after_forward: Callable[[], None] = lambda: None,
    rules: LogitsRules | None = None,
) -> Iterator[int]:
    """Yield generated token ids until EOS, max_new_tokens or `stop` (checked before every forward pass).
    `rules`: the request's changes to the logits before each token is sampled (penalties, bias, a grammar)."""
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    cache = DynamicCache(config=model.config)
    inputs = prompt_ids
    with torch.inference_mode():
        for _ in range(sampling.max_new_tokens):
            if stop.is_set():
                return
            out = model(input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
            after_forward()
            logits = out.logits[0, -1].cpu()
            if rules is not None:
                logits = rules.apply(logits)
            token = sample_next(logits, sampling, generator)
            if rules is not None:
                rules.advance(token)
            yield token
            if token in eos_ids:
                return
            inputs = torch.tensor([[token]], device=prompt_ids.device)


class Detokenizer:
    """Streams text for a growing list of ids without splitting multi-byte characters."""

    def __init__(self, tokenizer: object) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self._tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        delta, self._text = text[len(self._text) :], text
        return delta

    @property
    def text(self) -> str:
        return self._tok.decode(self.ids, skip_special_tokens=True)
