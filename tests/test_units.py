"""The one size formatter (fmoe_local/units.py): fixed-point numbers, one unit per view, both bases."""

from __future__ import annotations

import pytest

from fmoe_local.units import BINARY, DECIMAL, in_one_unit, number, size, size_auto, unit_for


@pytest.mark.parametrize(
    "x, text",
    [(19428.3, "19,428"), (589.824, "590"), (27.0, "27"), (13.84, "13.8"), (0.5625, "0.562"), (0.0123, "0.0123")],
)
def test_numbers_are_fixed_point_with_three_significant_digits(x: float, text: str):
    assert number(x) == text and "e" not in number(x * 1e6) and "e" not in number(x / 1e6)


def test_a_minimum_rounds_up_and_a_maximum_down_so_that_typing_it_back_stays_within():
    assert number(0.5625, toward="up") == "0.563" and number(0.5625, toward="down") == "0.562"
    assert number(19428.3, toward="down") == "19,428" and number(19428.3, toward="up") == "19,429"
    assert number(27.0, toward="up") == "27"  # exact figures are not pushed past themselves


def test_a_column_keeps_its_decimals():
    assert number(93.4, 1) == "93.4" and number(186.8, 1) == "186.8" and number(27, 1) == "27.0"


def test_the_unit_is_the_largest_in_which_the_figure_is_at_least_one():
    assert unit_for(28_311_552, BINARY).name == "MB" and unit_for(5e9).name == "GB" and unit_for(0).name == "KB"
    assert size(589_824, unit_for(28_311_552, BINARY)) == "0.562 MB"  # the demo's expert, in its cache's unit
    assert size_auto(20_371_931_136, BINARY) == "19 GB" and size_auto(300_000_000) == "300 MB"


def test_figures_of_one_sentence_share_the_unit_of_the_largest():
    assert in_one_unit(6e9, 5e8, decimals=1) == ["6.0 GB", "0.5 GB"]  # not "6.0 GB" beside "500.0 MB"
    assert in_one_unit(4e6, 1e6) == ["4 MB", "1 MB"] and DECIMAL[0].bytes == 10**9


def test_an_impossible_size_is_refused():
    with pytest.raises(ValueError, match="is not a size"):
        number(float("nan"))
