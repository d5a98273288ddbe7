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
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from fmoe_local.stats import RequestStats  # noqa: E402
from ui.session import Session, fmt_gb  # noqa: E402

# Cell colours of the heatmap: unused, hit (resident already), prefetched then hit, miss (loaded on demand).
CELL_COLOURS = ["#f1f5f9", "#16a34a", "#6366f1", "#dc2626"]
CELL_LABELS = ["not used", "hit", "prefetched", "miss"]


@dataclass
class StatsTab:
    summary: gr.Markdown
    heatmap: gr.Plot
    timeline: gr.Plot
    refresh: gr.Button


def cell_states(stats: RequestStats) -> np.ndarray:
    """[L, J] codes for the heatmap: 3 where any miss happened, else 2 if prefetched, else 1 if hit, else 0."""
    hits = np.asarray(stats.layer_hits, dtype=np.int64)
    misses = np.asarray(stats.layer_misses, dtype=np.int64)
    prefetched = np.asarray(stats.layer_prefetched, dtype=np.int64)
    if hits.size == 0:
        return np.zeros((0, 0), np.int8)
    codes = np.zeros(hits.shape, np.int8)
    codes[hits > 0] = 1
    codes[(prefetched > 0) & (hits > 0)] = 2
    codes[misses > 0] = 3
    return codes


def heatmap_figure(stats: RequestStats | None):
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=100)
    if stats is None or not stats.layer_hits:
        ax.text(0.5, 0.5, "Send a message to see which experts it used.", ha="center", va="center", fontsize=12)
        ax.axis("off")
        return fig
    codes = cell_states(stats)
    ax.imshow(codes.T, aspect="auto", cmap=ListedColormap(CELL_COLOURS), vmin=0, vmax=3, interpolation="nearest")
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("expert")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(
        f"Last reply: {stats.tokens} tokens, expert hit rate {stats.hit_rate:.0%}"
        f" ({stats.hits} hits, {stats.late} late, {stats.misses} misses)",
        fontsize=11,
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in CELL_COLOURS[1:]]
    ax.legend(handles, CELL_LABELS[1:], loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False, fontsize=9)
    fig.tight_layout()
    return fig


def timeline_figure(history: list[RequestStats]):
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
        ("Expert cache in use", [1024 * s.cache_gb_used for s in history], "MB", "#0ea5e9"),
    ]
    for ax, (title, ys, unit, colour) in zip(axes, series, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("reply")
        ax.set_ylabel(unit)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
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
    if session.runtime is None:
        return "No model loaded."
    i = session.runtime.info
    s = session.last_stats
    line = f"**Cache:** {fmt_gb(i.cache_gb)} on {i.device} ({i.cache_experts} experts)"
    if s is not None:
        line += (
            f" · **last reply:** {s.tokens_per_s:.1f} tok/s, TTFT {1000 * s.ttft_s:.0f} ms, hit rate {s.hit_rate:.0%},"
            f" {s.bytes_moved / 1e6:.1f} MB copied, {1000 * s.stall_s:.0f} ms waiting for misses,"
            f" {fmt_gb(s.cache_gb_used)} of cache in use"
        )
    return line


def build(session: Session) -> StatsTab:
    text = gr.Markdown(summary(session), elem_id="stats-summary")
    heatmap = gr.Plot(label="Experts of the last reply (layers × experts)", elem_id="heatmap")
    timeline = gr.Plot(label="Over time", elem_id="timeline")
    refresh = gr.Button("Refresh", size="sm")
    return StatsTab(text, heatmap, timeline, refresh)


def outputs(tab: StatsTab) -> list:
    return [tab.summary, tab.heatmap, tab.timeline]


def draw(session: Session) -> tuple:
    history = list(session.history)
    heat, line = heatmap_figure(session.last_stats), timeline_figure(history)
    plt.close(heat)  # gr.Plot renders the figure object it receives; closing frees pyplot's registry
    plt.close(line)
    return summary(session), heat, line


def wire(session: Session, tab: StatsTab, demo: gr.Blocks) -> None:
    tab.refresh.click(lambda: draw(session), None, outputs(tab), api_visibility="private")
    demo.load(lambda: draw(session), None, outputs(tab), api_visibility="private")
