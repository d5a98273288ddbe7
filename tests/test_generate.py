"""The token loop's sampling: top-k keeps only the k likeliest tokens, the penalties follow transformers' and OpenAI's
rules, each is off at its default, and generate_ids hands the reply's own tokens to the penalties."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import MixtralConfig

from fmoe_local.config import Sampling
from fmoe_local.generate import generate_ids, penalised, sample_next

LOGITS = torch.tensor([4.0, 3.0, 2.0, -1.0, 0.5])  # [V]


def draws(sampling: Sampling, n: int = 400) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    return {sample_next(LOGITS, sampling, generator) for _ in range(n)}


def test_top_k_keeps_only_the_k_likeliest_tokens():
    hot = Sampling(temperature=5.0, top_p=1.0)  # flat enough that every token comes up in 400 draws
    assert draws(hot) == {0, 1, 2, 3, 4}
    assert draws(Sampling(temperature=5.0, top_p=1.0, top_k=2)) == {0, 1}
    assert draws(Sampling(temperature=5.0, top_p=1.0, top_k=1)) == {0}
    assert draws(Sampling(temperature=5.0, top_p=1.0, top_k=50)) == {0, 1, 2, 3, 4}  # more than V: no limit


def test_every_penalty_off_leaves_the_logits_as_they_are():
    assert penalised(LOGITS, Sampling(), torch.tensor([[0, 1]]), [0, 0]) is LOGITS


def test_repetition_penalty_is_transformers_rule_over_prompt_and_reply():
    out = penalised(LOGITS, Sampling(repetition_penalty=2.0), torch.tensor([[0, 3, 99]]), [1])
    # positive logits divided, negative multiplied; token 99 is past the vocabulary and ignored
    assert out.tolist() == [2.0, 1.5, 2.0, -2.0, 0.5]


def test_frequency_and_presence_penalties_count_the_replys_own_tokens():
    out = penalised(LOGITS, Sampling(frequency_penalty=0.5, presence_penalty=1.0), torch.tensor([[2]]), [0, 0, 1])
    assert out.tolist() == [4.0 - 1.0 - 1.0, 3.0 - 0.5 - 1.0, 2.0, -1.0, 0.5]  # the prompt's token 2 is not counted
    negative = penalised(LOGITS, Sampling(presence_penalty=-1.0), torch.tensor([[2]]), [4])
    assert negative.tolist() == [4.0, 3.0, 2.0, -1.0, 1.5]


class _Favourite(torch.nn.Module):
    """A model whose next-token logits always prefer token 0, then 1, then 2: greedy repeats token 0 forever."""

    def __init__(self) -> None:
        super().__init__()
        self.config = MixtralConfig(num_hidden_layers=1)

    def forward(self, input_ids, past_key_values, use_cache, logits_to_keep):  # noqa: ANN001, ANN201
        return SimpleNamespace(logits=LOGITS[:3].expand(1, input_ids.shape[1], 3))


def reply(sampling: Sampling) -> list[int]:
    return list(generate_ids(_Favourite(), torch.tensor([[2]]), sampling, set(), threading.Event()))


def test_generate_ids_penalises_what_the_reply_already_said():
    assert reply(Sampling(greedy=True, max_new_tokens=4)) == [0, 0, 0, 0]
    # 4 − 1.5·count of token 0 falls under token 1's 3 after one use, and so on in turn
    assert reply(Sampling(greedy=True, max_new_tokens=4, frequency_penalty=1.5)) == [0, 1, 0, 2]
    assert reply(Sampling(greedy=True, max_new_tokens=3, repetition_penalty=4.0)) == [0, 1, 0]


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"top_k": -1}, "Top-k"),
        ({"top_k": 2.5}, "Top-k"),
        ({"repetition_penalty": 0.0}, "repetition penalty"),
        ({"repetition_penalty": float("nan")}, "repetition penalty"),
        ({"frequency_penalty": 2.5}, "frequency penalty"),
        ({"presence_penalty": float("nan")}, "presence penalty"),
    ],
)
def test_impossible_values_are_refused_in_a_sentence(changes, named):
    with pytest.raises(ValueError, match=named):
        Sampling(**changes).validate()
