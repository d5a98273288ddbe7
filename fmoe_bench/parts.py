"""Which requests of a trace `bench replay` uses (`--requests`), what the policies learned before them
(`--learn-first`), and the hit rate over its first N (`--first-requests`).

Scope: choosing a part of a trace's requests by name or slice, putting another trace's requests before them as the
warm-up, and reading a replay's per-request counts back as the hit rate over its first N measured requests. It does
NOT replay anything (replay.py) or print (replay_report.py).

Why in the command: the tuning protocol (docs/bench.md, "Generalising") decides on the first half of each trace's
requests and confirms on the second half, and judges a new user's start by the first 10, 50, 200 requests of an
online replay. With both in `bench replay` every figure of it is one command anyone can run again, every policy in
the same run.

Halves: the first half is the first ⌊n / 2⌋ requests (intent: 63 of 127, law: 16 of 33), the second the rest.
A slice `A:B` is Python's (0-based, B excluded, either end may be left out, negative counts from the end).

Learned first: a user whose map store holds another kind of work (docs/bench.md, "A store full of another topic").
The learned trace's requests only teach the policies, as the offline warm-up does (its last request is served), and
every request of the measured trace is measured.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fmoe_bench.replay import ReplayResult
from fmoe_local.traces import Trace

PARTS = ("all", "first-half", "second-half")


def request_range(count: int, spec: str) -> range:
    """The request indices `spec` names in a trace of `count` requests; a sentence when it names none."""
    half = count // 2
    if spec == "all":
        chosen = range(count)
    elif spec == "first-half":
        chosen = range(half)
    elif spec == "second-half":
        chosen = range(half, count)
    else:
        chosen = range(count)[_slice(spec)]
    if len(chosen) == 0:
        raise ValueError(f"--requests {spec} selects no request of a trace with {count}; give a part that holds one.")
    return chosen


def _slice(spec: str) -> slice:
    parts = spec.split(":")
    if len(parts) != 2:
        raise ValueError(
            f"Give --requests as {', '.join(PARTS)} or a slice of request indices A:B such as 0:10 (got '{spec}')."
        )
    try:
        start, stop = (int(p) if p.strip() else None for p in parts)
    except ValueError:
        raise ValueError(f"A request slice is two whole numbers A:B, either may be left out (got '{spec}').") from None
    return slice(start, stop)


def select_requests(trace: Trace, spec: str) -> Trace:
    """The trace holding only the requests `spec` names, in order; its model name says which part it is."""
    count = len(trace.requests())
    chosen = request_range(count, spec)
    if spec == "all":
        return trace
    part = trace.subset(list(chosen))
    label = f"requests {chosen.start}–{chosen[-1]} of {count}" + (f" ({spec})" if spec in PARTS else "")
    return replace(part, model=f"{trace.model}, {label}")


def learned_first(learned: Trace, trace: Trace) -> Trace:
    """One trace: every request of `learned`, then every request of `trace` (request and pass ids renumbered to stay
    apart); recorded distributions and embeddings are kept only where both traces have them."""
    shape, other = (
        (trace.num_layers, trace.num_experts, trace.top_k),
        (
            learned.num_layers,
            learned.num_experts,
            learned.top_k,
        ),
    )
    if shape != other:
        raise ValueError(
            f"--learn-first needs a trace of the same shape (layers, experts, top-k): {other} against {shape}."
        )
    width = max(learned.topk_ids.shape[2], trace.topk_ids.shape[2])

    def padded(t: Trace, a: np.ndarray, fill: float) -> np.ndarray:
        return np.pad(a, ((0, 0), (0, 0), (0, width - a.shape[2])), constant_values=fill)

    def both(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
        return None if a is None or b is None or a.shape[1:] != b.shape[1:] else np.concatenate([a, b])

    def labels(a: list[str] | None, b: list[str] | None, n: int, m: int) -> list[str] | None:
        return None if a is None and b is None else (a or [""] * n) + (b or [""] * m)

    n, m = len(learned.requests()), len(trace.requests())
    seq_shift = int(learned.seq_ids.max()) + 1 - int(trace.seq_ids.min()) if learned.num_rows else 0
    iter_shift = int(learned.iter_ids.max()) + 1 - int(trace.iter_ids.min()) if learned.num_rows else 0
    return Trace(
        f"{trace.model}, after all of {learned.model}",
        trace.num_layers,
        trace.num_experts,
        trace.top_k,
        np.concatenate([learned.seq_ids, trace.seq_ids + seq_shift]).astype(np.int32),
        np.concatenate([learned.iter_ids, trace.iter_ids + iter_shift]).astype(np.int32),
        np.concatenate([learned.phase, trace.phase]),
        np.concatenate([padded(learned, learned.topk_ids, -1), padded(trace, trace.topk_ids, -1)]),
        np.concatenate([padded(learned, learned.topk_probs, 0.0), padded(trace, trace.topk_probs, 0.0)]),
        both(learned.probs, trace.probs),
        both(learned.embeddings, trace.embeddings),
        labels(learned.seq_labels, trace.seq_labels, n, m),
        labels(learned.seq_texts, trace.seq_texts, n, m),
    )


def parse_counts(text: str) -> list[int]:
    """'10,50,200' → [10, 50, 200] (sorted, each once); a sentence for anything but positive whole numbers."""
    try:
        counts = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise ValueError(
            f"Give --first-requests as whole numbers separated by commas, e.g. 10,50,200 (got '{text}')."
        ) from None
    if not counts or counts[0] < 1:
        raise ValueError(f"--first-requests needs at least one count of 1 or more requests (got '{text}').")
    return counts


def first_requests(result: ReplayResult, counts: list[int]) -> list[dict]:
    """Hit rate over the first n measured requests, per n; n beyond the measured requests is all of them, said so
    (`requests` is how many were counted, `all` whether that is every measured request)."""
    hits, accesses = result.request_hits, result.request_accesses
    out = []
    for n in counts:
        m = min(n, len(hits))
        total = sum(accesses[:m])
        out.append({"n": n, "requests": m, "all": m == len(hits), "hit_rate": sum(hits[:m]) / total if total else 0.0})
    return out
