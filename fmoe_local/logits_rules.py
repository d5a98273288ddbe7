"""What a request changes in the logits before a token is sampled: the repetition penalty, OpenAI's logit_bias,
frequency_penalty and presence_penalty, and a grammar the reply must follow (constrained.py). The one place each
is applied, for the chat and the API alike.

Scope: one request's rules, applied to the last position's logits [V] and told each token sampled. The repetition
penalty as transformers' RepetitionPenaltyLogitsProcessor (a positive logit divided by it, a negative one multiplied)
over every token of the prompt and the reply, first; the bias next; then OpenAI's penalties as it documents them,
`logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty`, counted over the reply's tokens; the
grammar's mask last (no bias can make a forbidden token possible). It does NOT sample (generate.py: temperature,
top-k, top-p).

Threads: a LogitsRules belongs to its request, on the runtime's worker thread.
"""

from __future__ import annotations

from collections import Counter

import torch

from fmoe_local.config import Sampling
from fmoe_local.constrained import Grammars, TokenConstraint


class LogitsRules:
    def __init__(
        self,
        sampling: Sampling,
        constraint: TokenConstraint | None = None,
        prompt_ids: torch.Tensor | None = None,
    ) -> None:
        """`prompt_ids` [1, T] or [T]: the prompt's tokens, which the repetition penalty counts too."""
        self._sampling, self._constraint = sampling, constraint
        self._counts: Counter[int] = Counter()
        self._prompt: set[int] = set() if prompt_ids is None else set(prompt_ids.reshape(-1).tolist())

    @classmethod
    def for_request(
        cls, sampling: Sampling, grammars: Grammars | None, prompt_ids: torch.Tensor | None = None
    ) -> LogitsRules | None:
        """The rules `sampling` asks for; None when it asks for none (the token loop then touches no logits)."""
        constraint = grammars.start(sampling.grammar) if sampling.grammar and grammars is not None else None
        if sampling.grammar and constraint is None:
            raise ValueError("This model cannot hold a reply to a grammar. Send the request without one.")
        asks = (
            sampling.frequency_penalty
            or sampling.presence_penalty
            or sampling.logit_bias
            or sampling.repetition_penalty != 1.0
        )
        return cls(sampling, constraint, prompt_ids) if asks or constraint is not None else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] as the request's rules change them (a new tensor)."""
        s = self._sampling
        logits = logits.float().clone()
        if s.repetition_penalty != 1.0:
            vocab = logits.shape[-1]
            # A tokenizer's added ids past the model's vocabulary have no logit.
            seen = torch.tensor([t for t in self._prompt | set(self._counts) if 0 <= t < vocab], dtype=torch.long)
            if len(seen):
                picked = logits[seen]
                logits[seen] = torch.where(picked < 0, picked * s.repetition_penalty, picked / s.repetition_penalty)
        for token, bias in s.logit_bias:
            if 0 <= token < logits.shape[-1]:
                logits[token] += bias
        if self._counts and (s.frequency_penalty or s.presence_penalty):
            ids = torch.tensor(list(self._counts), dtype=torch.long)
            counts = torch.tensor(list(self._counts.values()), dtype=logits.dtype)
            logits[ids] -= counts * s.frequency_penalty + s.presence_penalty
        if self._constraint is not None:
            logits = self._constraint.mask(logits)
        return logits

    def advance(self, token: int) -> None:
        self._counts[token] += 1
        if self._constraint is not None:
            self._constraint.advance(token)
