"""What a request changes in the logits before a token is sampled: OpenAI's logit_bias, frequency_penalty and
presence_penalty, and a grammar the reply must follow (constrained.py).

Scope: one request's rules, applied to the last position's logits [V] and told each token sampled. Penalties as
OpenAI documents them: `logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty`, counted over
the reply's tokens; the bias is added first, the grammar's mask last (no bias can make a forbidden token possible).
It does NOT sample (generate.py).

Threads: a LogitsRules belongs to its request, on the runtime's worker thread.
"""

from __future__ import annotations

from collections import Counter

import torch

from fmoe_local.config import Sampling
from fmoe_local.constrained import Grammars, TokenConstraint


class LogitsRules:
    def __init__(self, sampling: Sampling, constraint: TokenConstraint | None = None) -> None:
        self._sampling, self._constraint = sampling, constraint
        self._counts: Counter[int] = Counter()

    @classmethod
    def for_request(cls, sampling: Sampling, grammars: Grammars | None) -> LogitsRules | None:
        """The rules `sampling` asks for; None when it asks for none (the token loop then touches no logits)."""
        constraint = grammars.start(sampling.grammar) if sampling.grammar and grammars is not None else None
        if sampling.grammar and constraint is None:
            raise ValueError("This model cannot hold a reply to a grammar. Send the request without one.")
        asks = sampling.frequency_penalty or sampling.presence_penalty or sampling.logit_bias
        return cls(sampling, constraint) if asks or constraint is not None else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] as the request's rules change them (a new tensor)."""
        s = self._sampling
        logits = logits.float().clone()
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
