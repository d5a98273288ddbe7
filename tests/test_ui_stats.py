"""Stats tab drawing: heatmap cell codes and that the figures draw real data."""

from __future__ import annotations

import numpy as np

from fmoe_local.stats import RequestStats
from ui.stats import cell_states, heatmap_figure, timeline_figure


def _stats() -> RequestStats:
    s = RequestStats(tokens=5, hits=3, misses=2, ttft_s=0.2, tpot_s=0.05, cache_gb_used=0.5)
    s.layer_hits = [[2, 0, 1], [0, 0, 0]]
    s.layer_misses = [[0, 0, 1], [1, 0, 0]]
    s.layer_prefetched = [[1, 1, 0], [0, 0, 0]]
    return s


def test_cell_codes_rank_miss_over_prefetch_over_hit():
    codes = cell_states(_stats())
    # [L, J]: (0,0) hit after a prefetch, (0,1) prefetched but unused stays blank, (0,2) hit and miss → miss.
    assert codes.tolist() == [[2, 0, 3], [3, 0, 0]]
    assert cell_states(RequestStats()).shape == (0, 0)


def test_heatmap_draws_layers_by_experts():
    fig = heatmap_figure(_stats())
    image = fig.axes[0].images[0].get_array()
    assert image.shape == (3, 2)  # experts on y, layers on x
    assert "hit rate 60%" in fig.axes[0].get_title()
    empty = heatmap_figure(None)
    assert not empty.axes[0].images


def test_timeline_plots_one_point_per_reply():
    history = [_stats(), _stats()]
    fig = timeline_figure(history)
    hit_line = fig.axes[0].lines[0]
    assert np.allclose(hit_line.get_ydata(), [60.0, 60.0])
    assert np.allclose(fig.axes[1].lines[0].get_ydata(), [200.0, 200.0])  # TTFT in ms
    assert np.allclose(fig.axes[3].lines[0].get_ydata(), [512.0, 512.0])  # cache in use, MB
    assert not timeline_figure([]).axes[0].lines
