"""The map/recency mix (policies/blend.py): the blend's arithmetic and the weight the measured record chooses."""

from __future__ import annotations

import numpy as np
import pytest

from fmoe_local.policies.blend import MixChoice, blend


def test_blend_normalises_each_side_then_mixes_at_the_weight():
    mixed = blend(np.array([2.0, 2.0, 0.0]), np.array([0.0, 0.0, 0.5]), 0.25)
    assert mixed.tolist() == pytest.approx([0.125, 0.125, 0.75])


def test_blend_at_weight_one_is_the_map_unchanged():
    predicted = np.array([0.2, 0.0, 0.1], np.float32)
    assert blend(predicted, np.array([0.0, 1.0, 0.0]), 1.0) is predicted


def test_blend_takes_the_side_with_mass_when_the_other_has_none():
    rows = np.array([[0.0, 0.0], [1.0, 3.0]])
    prior = np.array([[1.0, 1.0], [0.0, 0.0]])
    np.testing.assert_allclose(blend(rows, prior, 0.5), [[0.5, 0.5], [0.25, 0.75]])


def test_mix_choice_trusts_the_map_until_recency_has_predicted_better():
    choice = MixChoice(top_k=2)
    assert choice.weight == 1.0  # nothing measured: the paper's rule
    map_row = np.array([0.6, 0.4, 0, 0], np.float32)  # predicts {0, 1}
    recent = np.array([0, 0, 0.7, 0.3], np.float32)  # predicts {2, 3}
    used = np.array([False, False, True, True])
    choice.score(map_row, recent, used)
    # w = 0 and 0.25 hold both used experts, 0.5 one ({2, 0}), 0.75 and 1 none: the largest of the best is 0.25.
    assert choice.weight == 0.25
    for _ in range(2):
        choice.score(map_row, recent, ~used)  # now the map is right, twice: w = 1 holds 4, w = 0.25 holds 2
    assert choice.weight == 1.0


def test_mix_choice_skips_a_run_one_side_had_nothing_to_say_about():
    choice = MixChoice(top_k=1)
    choice.score(np.zeros(3), np.array([1.0, 0, 0]), np.array([True, False, False]))
    assert choice.weight == 1.0
