"""Sampling a token (fmoe_local/generate.py's sample_next): top_k keeps only the k likeliest tokens."""

from __future__ import annotations

import pytest
import torch

from fmoe_local.config import Sampling
from fmoe_local.generate import sample_next

LOGITS = torch.tensor([4.0, 3.9, 3.8, 3.7, 0.0])  # four near-equal tokens, one unlikely


def _drawn(sampling: Sampling, draws: int = 400) -> set[int]:
    gen = torch.Generator().manual_seed(0)
    return {sample_next(LOGITS, sampling, gen) for _ in range(draws)}


def test_top_k_samples_only_the_k_likeliest_tokens():
    assert _drawn(Sampling(temperature=1.0, top_p=1.0, top_k=2)) == {0, 1}
    assert _drawn(Sampling(temperature=1.0, top_p=1.0, top_k=1)) == {0}
    assert {0, 1, 2, 3} <= _drawn(Sampling(temperature=1.0, top_p=1.0, top_k=0))  # 0: every token may be drawn
    assert {0, 1, 2, 3} <= _drawn(Sampling(temperature=1.0, top_p=1.0, top_k=99))  # more than there are: all


@pytest.mark.parametrize("top_k", [-1, 1.5, True])
def test_a_top_k_that_cannot_be_one_is_refused_in_a_sentence(top_k):
    with pytest.raises(ValueError, match="Top-k must be a whole number"):
        Sampling(top_k=top_k).validate()
