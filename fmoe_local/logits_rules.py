"""What a request changes in the logits before a token is sampled: the repetition penalty, OpenAI's logit_bias,
frequency_penalty and presence_penalty, a grammar the reply must follow (constrained.py), and the tokens forced to
end a thought that has spent its budget (`ThoughtRule`). The one place each is applied, for the chat and the API
alike.

Scope: one request's rules, applied to the last position's logits [V] and told each token sampled. The repetition
penalty as transformers' RepetitionPenaltyLogitsProcessor (a positive logit divided by it, a negative one multiplied)
over every token of the prompt and the reply, first; the bias next; then OpenAI's penalties as it documents them,
`logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty`, counted over the reply's tokens; the
grammar's mask last (no bias can make a forbidden token possible). A token the thought's budget forces replaces all
of them: every other logit is -inf. With a thought and a grammar, the grammar holds the reply from the token after
the thought's end — only where the prompt opened the thought (the reply cannot be both held to the grammar and free
to open a thought of its own at its first token), else from the first token, with no thought; until then the tokens
that end a reply are barred, so the reply cannot end before the grammar's text. It does NOT sample (generate.py:
temperature, top-k, top-p).

Threads: a LogitsRules belongs to its request, on the runtime's worker thread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from fmoe_local.config import Sampling
from fmoe_local.constrained import Grammars, TokenConstraint

# A text's token ids, as the model's tokenizer writes it alone (no special tokens added).
Encode = Callable[[str], list[int]]


class LogitsRules:
    def __init__(
        self,
        sampling: Sampling,
        constraint: TokenConstraint | None = None,
        prompt_ids: torch.Tensor | None = None,
        thought: ThoughtRule | None = None,
        eos_ids: tuple[int, ...] = (),
    ) -> None:
        """`prompt_ids` [1, T] or [T]: the prompt's tokens, which the repetition penalty counts too; `eos_ids`: the
        tokens that end a reply, barred during a thought that a grammar's text must follow."""
        self._sampling, self._constraint, self._thought = sampling, constraint, thought
        # Only a thought that a grammar's text must follow bars them (the grammar's own mask ends a reply after it).
        held = eos_ids and constraint is not None and thought is not None
        self._eos = torch.tensor(eos_ids, dtype=torch.long) if held else None
        self._counts: Counter[int] = Counter()
        self._prompt: set[int] = set() if prompt_ids is None else set(prompt_ids.reshape(-1).tolist())

    @classmethod
    def for_request(
        cls,
        sampling: Sampling,
        grammars: Grammars | None,
        prompt_ids: torch.Tensor | None = None,
        encode: Encode | None = None,
    ) -> LogitsRules | None:
        """The rules `sampling` asks for; None when it asks for none (the token loop then touches no logits).
        `encode`: the model's tokenizer, for the markers of a thought's budget (needed only with one)."""
        constraint = grammars.start(sampling.grammar) if sampling.grammar and grammars is not None else None
        if sampling.grammar and constraint is None:
            raise ValueError("This model cannot hold a reply to a grammar. Send the request without one.")
        thought = ThoughtRule.for_request(sampling, encode, held=constraint is not None)
        asks = (
            sampling.frequency_penalty
            or sampling.presence_penalty
            or sampling.logit_bias
            or sampling.repetition_penalty != 1.0
        )
        if asks or constraint is not None or thought is not None:
            eos = tuple(grammars.eos_ids) if constraint is not None else ()  # constraint: grammars gave it
            return cls(sampling, constraint, prompt_ids, thought, eos)
        return None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] as the request's rules change them (a new tensor)."""
        forced = self._thought.forced() if self._thought is not None else None
        if forced is not None:
            out = torch.full_like(logits, float("-inf"), dtype=torch.float32)
            out[forced] = 0.0
            return out
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
        if self._constraint is not None and self._after_thought:
            logits = self._constraint.mask(logits)
        elif self._eos is not None:  # the grammar's text is still to come: no end before it
            logits[self._eos[self._eos < logits.shape[-1]]] = float("-inf")
        return logits

    @property
    def _after_thought(self) -> bool:
        return self._thought is None or self._thought.done

    def advance(self, token: int) -> None:
        self._counts[token] += 1
        after = self._after_thought  # the token was sampled after the thought: the grammar's first, or a later one
        if self._thought is not None:
            self._thought.advance(token)
        if self._constraint is not None and after:
            self._constraint.advance(token)


def grammar_after_thought(sampling: Sampling) -> bool:
    """Whether `sampling`'s grammar starts after the reply's thought rather than at its first token: where a budget
    bounds a thought the prompt opened (an unbounded thought could keep a forced tool call from ever being written;
    one the reply would open itself cannot be told from the grammar's first token)."""
    return sampling.thought is not None and sampling.thought.opened


_BEFORE, _THINKING, _CLOSING, _DONE = "before", "thinking", "closing", "done"


class ThoughtRule:
    """A reply's thought held to its budget (Sampling.thought), as llama.cpp's reasoning-budget sampler and vLLM's
    thinking_token_budget do it: the thought's tokens are counted — from the reply's first token where the prompt
    opened it, else from after `start` when the reply begins with it — and once `budget` of them are sampled without
    the model writing `end`, the `close` tokens are forced one by one; the reply then goes on as the answer. The
    model's own `end` is recognised in the tokens the tokenizer gives it alone (one token in Qwen3's and GPT-OSS's
    vocabularies). Only the reply's first thought is held; a reply that does not begin with one is left alone. The
    count is of the reply's tokens: a thought a prefilled assistant message began is counted from where the reply
    goes on, not from its start."""

    def __init__(self, budget: int, start: list[int], end: list[int], close: list[int], opened: bool) -> None:
        if not (start and end and close):
            raise ValueError(
                "This model's tokenizer writes the thought's markers as no token at all, so its thinking cannot be held "
                "to a budget. Send the request without a thinking budget (thinking_token_budget, "
                "thinking.budget_tokens)."
            )
        self._start, self._end, self._close = start, end, close
        self._left, self._matched = budget, 0  # tokens the thought may still take; of `start`, `end` or forced matched
        self._forcing = close  # what is forced once the budget is spent (`_closing`)
        self._state = _BEFORE
        if opened:
            self._think()

    @classmethod
    def for_request(cls, sampling: Sampling, encode: Encode | None, held: bool) -> ThoughtRule | None:
        """The rule of `sampling.thought`; None without a budget, or for a reply `held` to a grammar from its first
        token (grammar_after_thought: it has no thought). A budget of max_new_tokens or more never forces anything:
        every token of the reply counts toward max_new_tokens, the thought's own too."""
        budget = sampling.thought
        if budget is None or (held and not grammar_after_thought(sampling)):
            return None
        if encode is None:
            raise ValueError("A thinking budget needs the model's tokenizer to find the thought's markers.")
        return cls(budget.tokens, encode(budget.start), encode(budget.end), encode(budget.close), budget.opened)

    def _think(self) -> None:
        self._state, self._matched = _THINKING, 0
        if self._left == 0:
            self._closing()

    def _closing(self) -> None:
        """The budget is spent: what is forced is the close, or, where the thought's last tokens began the model's
        own end, the rest of that end (the close written after them would leave half a marker in the thought)."""
        self._forcing = self._end[self._matched :] if self._matched else self._close
        self._state, self._matched = _CLOSING, 0

    @property
    def done(self) -> bool:
        """The thought has ended (or the reply had none): what comes next is the answer."""
        return self._state == _DONE

    def forced(self) -> int | None:
        """The token the reply must take next, or None when it is free."""
        return self._forcing[self._matched] if self._state == _CLOSING else None

    def advance(self, token: int) -> None:
        if self._state == _BEFORE:
            if token != self._start[self._matched]:
                self._state = _DONE
            else:
                self._matched += 1
                if self._matched == len(self._start):
                    self._think()
        elif self._state == _THINKING:
            self._left -= 1
            if token == self._end[self._matched]:
                self._matched += 1
            else:
                self._matched = 1 if token == self._end[0] else 0
            if self._matched == len(self._end):
                self._state = _DONE
            elif self._left == 0:
                self._closing()
        elif self._state == _CLOSING:
            if token != self._forcing[self._matched]:  # the logits allowed nothing else: a bug here, not the model's
                raise RuntimeError(f"The thinking budget forced token {self._forcing[self._matched]}, not {token}.")
            self._matched += 1
            if self._matched == len(self._forcing):
                self._state = _DONE
