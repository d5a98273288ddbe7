"""Stats tab: pictures of what the expert cache did — heatmap of the last reply, hit rate over time, cache in
use, TTFT/TPOT history.

Scope: drawing RequestStats (kept by Session.history) with matplotlib's Agg backend. It does NOT collect
statistics (the runtime does) or keep its own history.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr
import matplotlib

matplotlib.use("Agg")  # no display on a server thread; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator, PercentFormatter  # noqa: E402

from fmoe_local.stats import RequestStats  # noqa: E402
from fmoe_local.units import BINARY, Unit  # noqa: E402
from ui import (
    page_header,  # noqa: E402
    sizes,  # noqa: E402
)
from ui.render import literal  # noqa: E402
from ui.session import Session, format_in_use  # noqa: E402

# A red-to-green scale: a cell's colour is its hit rate, so a rare miss does not paint a mostly-hit expert red.
RATE_CMAP = "RdYlGn"
UNUSED = "#f1f5f9"


@dataclass
class StatsTab:
    summary: gr.Markdown
    heatmap: gr.Plot
    timeline: gr.Plot
    refresh: gr.Button


def cell_rates(stats: RequestStats) -> np.ndarray:
    """[L, J] hit rate of each (layer, expert) over this reply's uses of it; NaN where the expert was not used.

    A late prefetch counts as a use that was not a hit, as in RequestStats.hit_rate.
    """
    hits = np.asarray(stats.layer_hits, dtype=np.float64)
    if hits.size == 0:
        return np.zeros((0, 0))
    misses = np.asarray(stats.layer_misses, dtype=np.float64)
    late = np.asarray(stats.layer_late, dtype=np.float64) if stats.layer_late else np.zeros_like(hits)
    uses = hits + misses + late
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(uses > 0, hits / uses, np.nan)


def heatmap_figure(stats: RequestStats | None):
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=100)
    if stats is None or not stats.layer_hits:
        ax.text(0.5, 0.5, "Send a message to see which experts it used.", ha="center", va="center", fontsize=12)
        ax.axis("off")
        return fig
    cmap = matplotlib.colormaps[RATE_CMAP].with_extremes(bad=UNUSED)
    rates = np.ma.masked_invalid(cell_rates(stats).T)
    image = ax.imshow(rates, aspect="auto", cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("expert")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(
        f"Last reply: {stats.tokens} tokens, expert hit rate {stats.hit_rate:.0%}"
        f" ({stats.hits} hits, {stats.late} late, {stats.misses} misses)\n"
        "one cell per expert and layer, coloured by how often it was already in the cache when the reply needed it",
        fontsize=10,
    )
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02, format=PercentFormatter(1.0))
    bar.set_label("hit rate of the expert's uses (pale: not used)", fontsize=9)
    fig.tight_layout()
    return fig


def timeline_figure(history: list[RequestStats], cache_unit: Unit = BINARY[1]):
    """Hit rate, TTFT, TPOT and cache use per reply; cache use in `cache_unit` (the model's, as the summary above)."""
    fig, axes = plt.subplots(1, 4, figsize=(13, 2.8), dpi=100)
    if not history:
        for ax in axes:
            ax.axis("off")
        axes[1].text(
            1.1, 0.5, "Hit rate, TTFT, TPOT and cache use appear here after the first reply.", ha="center", va="center"
        )
        return fig
    x = np.arange(1, len(history) + 1)
    series = [
        ("Expert hit rate", [100 * s.hit_rate for s in history], "%", "#16a34a"),
        ("Time to first token", [1000 * s.ttft_s for s in history], "ms", "#6366f1"),
        ("Time per output token", [1000 * s.tpot_s for s in history], "ms", "#f59e0b"),
        (
            "Expert cache in use",
            [s.cache_gb_used * BINARY[0].bytes / cache_unit.bytes for s in history],
            cache_unit.name,
            "#0ea5e9",
        ),
    ]
    for ax, (title, ys, unit, colour) in zip(axes, series, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("reply (oldest kept first)")
        ax.set_ylabel(unit)
        # min_n_ticks=1: with one or two replies the default falls back to 0.5, 0.6 … ticks, which are no replies.
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        if history:
            ax.plot(x, ys, marker="o", color=colour, linewidth=1.5, markersize=3)
            ax.set_xlim(0.5, len(history) + 0.5)
            ax.set_ylim(bottom=0)  # from zero, so that small wobbles do not look like big changes
        ax.grid(alpha=0.3)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].set_ylim(0, 100)
    fig.tight_layout()
    return fig


def summary(session: Session) -> str:
    if session.runtime is None:  # loading, or why none is loaded, as the header says: not a bare "No model loaded."
        return page_header.model_line(session)
    i = session.runtime.info
    s = session.last_stats
    line = (
        f"**Cache:** {sizes.cache_gib(i, i.cache_gb)} on {literal(i.device)} ({i.cache_experts} experts in "
        f"{literal(format_in_use(i.expert_format, i.dtype))})"
    )
    if s is not None:
        line += (
            f" · **last reply:** {s.tokens_per_s:.1f} tok/s, TTFT {1000 * s.ttft_s:.0f} ms, hit rate {s.hit_rate:.0%},"
            f" {sizes.cache_size(i, s.bytes_moved)} copied, {1000 * s.stall_s:.0f} ms waiting for misses,"
            f" {sizes.cache_gib(i, s.cache_gb_used)} of cache in use"
        )
        if s.on_host:
            line += f", {s.on_host} misses computed on the CPU ({1000 * s.host_s:.0f} ms)"
        if s.prompt_tokens:
            line += f", {s.cached_tokens:,} of {s.prompt_tokens:,} prompt tokens reused from the last replies"
    return f"{line}\n\n**Misses:** {literal(session.runtime.miss_explanation)}"


def build(session: Session) -> StatsTab:
    text = gr.Markdown(summary(session), elem_id="stats-summary")
    heatmap = gr.Plot(label="Experts of the last reply", elem_id="heatmap")
    timeline = gr.Plot(label="Over time", elem_id="timeline")
    refresh = gr.Button("Refresh", size="sm")
    return StatsTab(text, heatmap, timeline, refresh)


def outputs(tab: StatsTab) -> list:
    return [tab.summary, tab.heatmap, tab.timeline]


def draw(session: Session) -> tuple:
    # With no model loaded (unloaded for a load, or the load failed) the last model's pictures would describe a
    # cache that is gone.
    runtime = session.runtime  # read once: a load on another thread may unload it meanwhile
    loaded = runtime is not None
    history = list(session.history) if loaded else []
    heat, line = (
        heatmap_figure(session.last_stats if loaded else None),
        timeline_figure(history, sizes.cache_unit(runtime.info if loaded else None)),
    )
    plt.close(heat)  # gr.Plot renders the figure object it receives; closing frees pyplot's registry
    plt.close(line)
    return summary(session), heat, line


def wire(session: Session, tab: StatsTab, demo: gr.Blocks) -> None:
    tab.refresh.click(lambda: draw(session), None, outputs(tab), api_visibility="private")
    demo.load(lambda: draw(session), None, outputs(tab), api_visibility="private")
