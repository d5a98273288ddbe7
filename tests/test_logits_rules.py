"""One request's logit rules (fmoe_local/logits_rules.py): the repetition penalty follows transformers' rule over the
prompt and the reply, OpenAI's frequency and presence penalties count the reply's own tokens, each is off at its
default."""

from __future__ import annotations

import torch

from fmoe_local.config import Sampling
from fmoe_local.logits_rules import LogitsRules

LOGITS = torch.tensor([4.0, 3.0, 2.0, -1.0, 0.5])  # [V]


def penalised(sampling: Sampling, prompt: list[int], reply: list[int]) -> list[float]:
    rules = LogitsRules.for_request(sampling, None, torch.tensor([prompt]))
    for token in reply:
        rules.advance(token)
    return rules.apply(LOGITS).tolist()


def test_every_penalty_off_asks_for_no_rules():
    assert LogitsRules.for_request(Sampling(), None, torch.tensor([[0, 1]])) is None


def test_repetition_penalty_is_transformers_rule_over_prompt_and_reply():
    # positive logits divided, negative multiplied; token 99 is past the vocabulary and ignored
    assert penalised(Sampling(repetition_penalty=2.0), [0, 3, 99], [1]) == [2.0, 1.5, 2.0, -2.0, 0.5]


def test_frequency_and_presence_penalties_count_the_replys_own_tokens():
    out = penalised(Sampling(frequency_penalty=0.5, presence_penalty=1.0), [2], [0, 0, 1])
    assert out == [4.0 - 1.0 - 1.0, 3.0 - 0.5 - 1.0, 2.0, -1.0, 0.5]  # the prompt's token 2 is not counted
    assert penalised(Sampling(presence_penalty=-1.0), [2], [4]) == [4.0, 3.0, 2.0, -1.0, 1.5]
