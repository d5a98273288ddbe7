"""Stats tab drawing: heatmap cell codes and that the figures draw real data."""

from __future__ import annotations

import numpy as np

from fmoe_local.stats import RequestStats
from ui.stats import cell_rates, heatmap_figure, timeline_figure


def _stats() -> RequestStats:
    s = RequestStats(tokens=5, hits=3, misses=2, ttft_s=0.2, tpot_s=0.05, cache_gb_used=0.5)
    s.layer_hits = [[2, 0, 1], [0, 0, 0]]
    s.layer_misses = [[0, 0, 1], [1, 0, 0]]
    s.layer_prefetched = [[1, 1, 0], [0, 0, 0]]
    return s


def test_cells_are_coloured_by_their_hit_rate_not_by_any_miss():
    rates = cell_rates(_stats())
    # [L, J]: (0,0) 2 hits → 100 %, (0,1) prefetched but unused → blank, (0,2) one hit one miss → 50 %.
    assert np.allclose(rates, [[1.0, np.nan, 0.5], [0.0, np.nan, np.nan]], equal_nan=True)
    assert cell_rates(RequestStats()).shape == (0, 0)


def test_a_late_prefetch_is_not_a_hit_in_its_cell():
    s = _stats()
    s.layer_late = [[2, 0, 0], [0, 0, 0]]
    assert cell_rates(s)[0, 0] == 0.5


def test_heatmap_draws_layers_by_experts():
    fig = heatmap_figure(_stats())
    image = fig.axes[0].images[0].get_array()
    assert image.shape == (3, 2)  # experts on y, layers on x
    assert "hit rate 60%" in fig.axes[0].get_title()
    assert "hit rate" in fig.axes[1].get_ylabel()  # the colour bar says what a colour means
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
    one = timeline_figure([_stats()])
    one.canvas.draw()
    assert [t for t in one.axes[0].get_xticks() if 0.5 <= t <= 1.5] == [1.0]  # replies, not 0.5, 0.6 … 1.5


def test_the_summary_says_what_happens_to_a_miss_and_counts_the_ones_the_cpu_computed(tmp_path):
    from fmoe_local.config import RuntimeConfig, Sampling
    from fmoe_local.demo import demo_model_dir
    from store import open_store
    from ui.session import Session
    from ui.stats import summary

    store = open_store(tmp_path)
    session = Session(store=store, config=RuntimeConfig(device="cpu", cache_experts=6))
    short = Sampling(max_new_tokens=8)  # the prompt's pass alone misses: the default (up to 512) adds seconds
    try:
        session.load(demo_model_dir())
        final = session.runtime.generate([{"role": "user", "content": "Tell me about the ocean."}], short)
        session.record(final.stats)
        text = summary(session)
        assert "**Misses:** No GPU: every miss is computed on the CPU, the only meaningful choice here" in text
        assert f"{final.stats.on_host} misses computed on the CPU" in text and final.stats.on_host > 0
        again = session.runtime.generate([{"role": "user", "content": "Tell me about the ocean."}], short)
        session.record(again.stats)
        n = again.stats.prompt_tokens
        assert f"{n - 1} of {n} prompt tokens reused from the last replies" in summary(session)
    finally:
        session.close()
        store.close()


def test_with_no_model_loaded_the_tab_says_why_and_draws_no_stale_pictures(tmp_path):
    from pathlib import Path

    from fmoe_local.config import RuntimeConfig
    from store import open_store
    from ui.load_job import LoadJob
    from ui.session import Session
    from ui.stats import draw

    store = open_store(tmp_path)
    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    try:
        session.record(_stats())  # the last reply of a model since unloaded
        session.load_error = "Could not load big-model: its checkpoint lacks 3 weights."
        text, heat, line = draw(session)
        assert "Could not load big-model" in text and "Load another model" in text  # was: "No model loaded." alone
        assert not heat.axes[0].images  # the placeholder, not the unloaded model's heatmap
        session.loading = LoadJob(Path("/models/next-model"), "nf4")
        assert "Loading next-model…" in draw(session)[0]
        session.loading.finished.set()
    finally:
        session.close()
        store.close()
