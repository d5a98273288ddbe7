"""Which requests of a trace `bench replay` uses (`--requests`), and the hit rate over its first N (`--first-requests`).

Scope: choosing a part of a trace's requests by name or slice, and reading a replay's per-request counts back as
the hit rate over its first N measured requests. It does NOT replay anything (replay.py) or print (replay_report.py).

Why in the command: the tuning protocol (docs/bench.md, "Generalising") decides on the first half of each trace's
requests and confirms on the second half, and judges a new user's start by the first 10, 50, 200 requests of an
online replay. With both in `bench replay` every figure of it is one command anyone can run again, every policy in
the same run.

Halves: the first half is the first ⌊n / 2⌋ requests (intent: 63 of 127, law: 16 of 33), the second the rest.
A slice `A:B` is Python's (0-based, B excluded, either end may be left out, negative counts from the end).
"""

from __future__ import annotations

from dataclasses import replace

from fmoe_local.bench.replay import ReplayResult
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
