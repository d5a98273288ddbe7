import pytest

from fmoe_local.bench.presets import cost_model
from fmoe_local.prefetch_distance import distance_for


def test_distance_covers_one_copy_plus_a_layer() -> None:
    assert distance_for(0.69e-3, 0.286e-3, 26) == 4  # 2.4 layer times → 3, plus one
    assert distance_for(1e-3, 1e-3, 26) == 2  # exactly one layer time
    assert distance_for(1e-6, 1e-3, 26) == 2
    assert distance_for(1.0, 1e-3, 32) == 31  # never past the last layer
    assert distance_for(1.0, 1e-3, 1) == 1


def test_presets_give_the_documented_distances() -> None:
    ds = cost_model("deepseek-v2-lite")
    mx = cost_model("mixtral-8x7b")
    assert distance_for(ds.load_s, ds.layer_time_s, 26) == 4
    assert distance_for(mx.load_s, mx.layer_time_s, 32) == 14


def test_impossible_times_are_refused() -> None:
    for load, layer in ((0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="positive"):
            distance_for(load, layer, 26)
