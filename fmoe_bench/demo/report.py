"""Loss-curve table and plot for weights/TRAINING.md, from the training log (log.jsonl written by train.py).

Scope: read the log, write `loss_curve.png` and print a Markdown table of train/held-out loss by step. It does NOT
write the prose of TRAINING.md (that is edited by hand around the table) and does NOT train or evaluate anything.

    python -m fmoe_bench.demo.report build/demo-train/log.jsonl fmoe_local/demo/weights/loss_curve.png
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def markdown_table(rows: list[dict], every: int = 100) -> str:
    """One line per eval point (plus the final one): step, tokens, train loss (mean of the last logged points)."""
    train = [r for r in rows if r["event"] == "train"]
    evals = [r for r in rows if r["event"] in ("eval", "final")]
    lines = [
        "| step | tokens seen | minutes | train loss | held-out loss | held-out ppl |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for ev in evals:
        recent = [t["loss"] for t in train if ev["step"] - every < t["step"] <= ev["step"]]
        minutes = max((t["minutes"] for t in train if t["step"] <= ev["step"]), default=0.0)
        train_loss = f"{sum(recent) / len(recent):.3f}" if recent else "–"
        lines.append(
            f"| {ev['step']} | {ev['tokens']:,} | {ev.get('minutes', minutes):.0f} | {train_loss} | "
            f"{ev['heldout_loss']:.3f} | {math.exp(ev['heldout_loss']):.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r["event"] == "train"]
    evals = [r for r in rows if r["event"] in ("eval", "final")]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([t["tokens"] / 1e6 for t in train], [t["loss"] for t in train], label="train (LM loss)", lw=1)
    ax.plot([e["tokens"] / 1e6 for e in evals], [e["heldout_loss"] for e in evals], "o-", label="held-out", ms=3)
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("fmoe-local demo MoE: training curve")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    rows = read_log(Path(args[0]))
    if len(args) > 1:
        plot(rows, Path(args[1]))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
