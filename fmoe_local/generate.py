"""The token loop: prefill, then one decode step at a time with a KV cache; sampling; incremental detokenising.

Scope: turning a prompt's ids into generated ids, honouring a stop flag between tokens. It does NOT know about
offloading (the experts implementation does that inside the model's forward) nor about threads or statistics.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import torch
from transformers import DynamicCache, RepetitionPenaltyLogitsProcessor

from fmoe_local.config import Sampling


def penalised(logits: torch.Tensor, sampling: Sampling, prompt_ids: torch.Tensor, generated: list[int]) -> torch.Tensor:
    """`logits` [V] with the sampling's penalties applied: repetition on every token of the prompt and the reply
    (as transformers' RepetitionPenaltyLogitsProcessor), frequency and presence on the reply's own tokens (OpenAI's
    and vLLM's rule). The same tensor when every penalty is off."""
    rep, freq, pres = sampling.repetition_penalty, sampling.frequency_penalty, sampling.presence_penalty
    if rep == 1.0 and freq == 0.0 and pres == 0.0:
        return logits
    vocab = logits.shape[-1]
    logits = logits.float()
    if rep != 1.0:
        seen = torch.cat([prompt_ids.reshape(-1).cpu(), torch.tensor(generated, dtype=torch.long)]).unique()
        seen = seen[(seen >= 0) & (seen < vocab)]  # a tokenizer's extra ids past the model's vocabulary have no logit
        logits = RepetitionPenaltyLogitsProcessor(rep)(seen[None], logits[None])[0]
    if generated and (freq or pres):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=vocab)[:vocab].float()  # [V]
        logits = logits - freq * counts - pres * (counts > 0).float()
    return logits


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Pick the next token from `logits` [V]."""
    if sampling.greedy or sampling.temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float()
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # ties at the k-th are kept, as transformers does
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
) -> Iterator[int]:
    """Yield generated token ids until EOS, max_new_tokens or `stop` (checked before every forward pass)."""
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    cache = DynamicCache(config=model.config)
    inputs = prompt_ids
    generated: list[int] = []  # the reply's tokens so far, for the penalties
    with torch.inference_mode():
        for _ in range(sampling.max_new_tokens):
            if stop.is_set():
                return
            out = model(input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
            after_forward()
            logits = penalised(out.logits[0, -1].cpu(), sampling, prompt_ids, generated)
            token = sample_next(logits, sampling, generator)
            generated.append(token)
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
