"""How far the fmoe policy reads a successor chain, and the first run of it that predicts each expert
(policies/successor_chain.py)."""

from __future__ import annotations

import numpy as np
import pytest

from fmoe_local.policies.successor_chain import chain_horizon, runs_until_predicted


@pytest.mark.parametrize(
    ("experts", "top_k", "runs"),
    [(64, 6, 16), (8, 2, 6), (128, 8, 24), (32, 4, 12), (16, 2, 12), (60, 4, 23), (1, 1, 2)],
)
def test_horizon_is_one_and_a_half_chains_worth_of_different_experts(experts, top_k, runs):
    # DeepSeek-V2-Lite, Mixtral, Qwen3-30B-A3B, GPT-OSS-20B, Phi-3.5-MoE, Qwen1.5-MoE, one expert.
    assert chain_horizon(experts, top_k) == runs


def test_horizon_refuses_a_model_without_experts():
    with pytest.raises(ValueError, match="at least one expert"):
        chain_horizon(0, 2)


def test_runs_count_from_the_next_run_of_each_case():
    # One layer, three experts; the chain predicts expert 0 in row 0, expert 1 in row 2, expert 2 in row 3.
    chain = np.zeros((4, 1, 3), bool)
    chain[0, 0, 0] = chain[2, 0, 1] = chain[3, 0, 2] = True
    runs, past = runs_until_predicted(chain, horizon=4)
    # Still to run (case 0): next run = row 0, then rows 1, 2, 3 are runs 1, 2, 3 after it. Expert 0 is predicted
    # by none of them: past the chain (3 runs covered).
    np.testing.assert_array_equal(runs[0, 0], [3, 2, 3])
    np.testing.assert_array_equal(past[0, 0], [1, 0, 0])
    # Ran (case 1): next run = row 1, then rows 2, 3 are runs 1, 2 after it.
    np.testing.assert_array_equal(runs[1, 0], [2, 1, 2])
    np.testing.assert_array_equal(past[1, 0], [1, 0, 0])


def test_runs_past_the_horizon_do_not_count():
    chain = np.zeros((4, 1, 3), bool)
    chain[3, 0, 2] = True  # three runs after the next for a layer still to run
    runs, past = runs_until_predicted(chain, horizon=3)  # reads rows 1 and 2 only
    np.testing.assert_array_equal(runs[0, 0], [2, 2, 2])
    np.testing.assert_array_equal(past[0, 0], [1, 1, 1])
