"""Routing traces: the replay benchmark's input and the runtime's `--record-trace` output (format in DESIGN.md).

Scope: the `.npz` format (format_version 1), the `Trace` dataclass with its groupings (requests, iterations) and
the rebuilt per-layer distributions, and `TraceRecorder`, which the runtime feeds one forward pass at a time.
It does NOT simulate caches or drive policies (replay.py does), and it never touches tensors: the recorder takes
numpy arrays, so the caller decides when to copy off the GPU.

Legend for shapes: T rows (tokens), L MoE layers, J routed experts per layer, k recorded experts per row (k ≥ K),
h semantic embedding size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
PREFILL, DECODE = 0, 1
# A recording is rewritten whole (the .npz cannot be appended to safely), so its cost grows with its length. Saving
# only once this many times the last save's duration has passed keeps the rewrites to about 5 % of the wall time
# whatever the length, while a crash loses at most that interval. Measured: a 200-request recording saved after
# every request spent 122 s in saves (docs/bench.md, "Trace recording").
SAVE_INTERVAL_PER_SAVE_S = 20.0
_clock = time.monotonic  # the recorder's only clock; tests replace it


@dataclass(frozen=True)
class Iteration:
    """One forward pass: rows [start, stop) of its request."""

    seq_id: int
    iter_id: int
    start: int
    stop: int
    phase: int  # PREFILL or DECODE (of its first row)


@dataclass
class Trace:
    model: str
    num_layers: int
    num_experts: int
    top_k: int
    seq_ids: np.ndarray  # [T] int32, rows of a request contiguous
    iter_ids: np.ndarray  # [T] int32, rows of a forward pass contiguous
    phase: np.ndarray  # [T] int8
    topk_ids: np.ndarray  # [T, L, k] int16, -1 = missing
    topk_probs: np.ndarray  # [T, L, k] float32
    probs: np.ndarray | None = None  # [T, L, J] float32
    embeddings: np.ndarray | None = None  # [T, h] float32
    seq_labels: list[str] | None = None  # per request, in order of first appearance
    seq_texts: list[str] | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_rows(self) -> int:
        return int(self.seq_ids.shape[0])

    @property
    def embed_dim(self) -> int:
        return 0 if self.embeddings is None else int(self.embeddings.shape[1])

    def validate(self) -> None:
        """Raise ValueError with a sentence saying what is wrong with the arrays."""
        t, lay, j = self.num_rows, self.num_layers, self.num_experts
        if self.topk_ids.ndim != 3 or self.topk_ids.shape[:2] != (t, lay):
            raise ValueError(f"topk_ids must have shape [T={t}, L={lay}, k]; got {self.topk_ids.shape}.")
        if self.topk_probs.shape != self.topk_ids.shape:
            raise ValueError("topk_probs must have the same shape as topk_ids.")
        if self.topk_ids.shape[2] < self.top_k:
            raise ValueError(f"The trace records {self.topk_ids.shape[2]} experts per layer but top_k is {self.top_k}.")
        for name in ("iter_ids", "phase"):
            if getattr(self, name).shape != (t,):
                raise ValueError(f"{name} must have one entry per row ({t}).")
        if self.probs is not None and self.probs.shape != (t, lay, j):
            raise ValueError(f"probs must have shape [T, L, J] = {(t, lay, j)}; got {self.probs.shape}.")
        if self.embeddings is not None and (self.embeddings.ndim != 2 or self.embeddings.shape[0] != t):
            raise ValueError("embeddings must have shape [T, h].")
        if t and (self.topk_ids.max() >= j or self.topk_ids.min() < -1):
            raise ValueError(f"topk_ids must lie in -1..{j - 1}.")
        if t and not (_contiguous(self.seq_ids) and _contiguous(self.iter_ids)):
            raise ValueError("Rows of one request (and of one forward pass) must be contiguous in the trace.")

    def requests(self) -> list[tuple[int, int, int]]:
        """(seq_id, start, stop) per request, in trace order."""
        return [(int(self.seq_ids[a]), a, b) for a, b in _runs(self.seq_ids)]

    def iterations(self, start: int = 0, stop: int | None = None) -> Iterator[Iteration]:
        """Forward passes of rows [start, stop), in order; a pass never straddles two requests."""
        stop = self.num_rows if stop is None else stop
        # A new request also starts a new pass, even if a recorder reused an iter id.
        bounds = np.diff(self.iter_ids[start:stop]) != 0
        bounds = np.flatnonzero(bounds | (np.diff(self.seq_ids[start:stop]) != 0)) + 1
        edges = [0, *bounds.tolist(), stop - start]
        for a, b in zip(edges[:-1], edges[1:], strict=False):
            if b > a:
                r = start + a
                yield Iteration(int(self.seq_ids[r]), int(self.iter_ids[r]), r, start + b, int(self.phase[r]))

    def distributions(self, start: int, stop: int) -> np.ndarray:
        """[n, L, J] gate distributions of rows [start, stop): recorded ones, else sparse from top-k (zeros elsewhere)."""
        if self.probs is not None:
            return self.probs[start:stop]
        ids = self.topk_ids[start:stop].astype(np.int64)
        vals = np.where(ids >= 0, self.topk_probs[start:stop], 0.0).astype(np.float32)
        out = np.zeros((stop - start, self.num_layers, self.num_experts + 1), np.float32)
        # Missing ids (-1) land in a spare column that is cut off.
        np.put_along_axis(out, np.where(ids >= 0, ids, self.num_experts), vals, axis=2)
        return out[:, :, : self.num_experts]

    def selected(self, start: int, stop: int) -> np.ndarray:
        """[n, L, K] the model's top-K experts of rows [start, stop) (the first K recorded, by probability)."""
        ids, p = self.topk_ids[start:stop], self.topk_probs[start:stop]
        if ids.shape[2] == self.top_k:
            return ids
        order = np.argsort(-np.where(ids >= 0, p, -np.inf), axis=2, kind="stable")[:, :, : self.top_k]
        return np.take_along_axis(ids, order, axis=2)

    def subset(self, request_indices: list[int]) -> Trace:
        """A trace holding only the given requests (indices into `requests()`), in the given order."""
        reqs = self.requests()
        rows = np.concatenate([np.arange(reqs[i][1], reqs[i][2]) for i in request_indices]) if request_indices else []
        rows = np.asarray(rows, np.int64)

        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[rows]

        def labels(xs: list[str] | None) -> list[str] | None:
            return None if xs is None else [xs[i] for i in request_indices]

        return Trace(
            self.model,
            self.num_layers,
            self.num_experts,
            self.top_k,
            self.seq_ids[rows],
            self.iter_ids[rows],
            self.phase[rows],
            self.topk_ids[rows],
            self.topk_probs[rows],
            pick(self.probs),
            pick(self.embeddings),
            labels(self.seq_labels),
            labels(self.seq_texts),
        )


def _runs(a: np.ndarray) -> list[tuple[int, int]]:
    if a.shape[0] == 0:
        return []
    edges = [0, *(np.flatnonzero(np.diff(a) != 0) + 1).tolist(), a.shape[0]]
    return list(zip(edges[:-1], edges[1:], strict=False))


def _contiguous(a: np.ndarray) -> bool:
    firsts = a[[s for s, _ in _runs(a)]]
    return np.unique(firsts).shape[0] == firsts.shape[0]


def load_trace(path: str | Path) -> Trace:
    """Read a trace `.npz`; raises ValueError naming the problem when the file is not format_version 1."""
    with np.load(path, allow_pickle=False) as z:
        keys = set(z.files)
        required = {"format_version", "num_layers", "num_experts", "top_k", "seq_ids", "iter_ids", "phase"}
        required |= {"topk_ids", "topk_probs"}
        missing = sorted(required - keys)
        if missing:
            raise ValueError(f"{path} is not a routing trace: it lacks {', '.join(missing)}.")
        version = int(z["format_version"])
        if version != FORMAT_VERSION:
            raise ValueError(f"{path} has trace format {version}; this version reads format {FORMAT_VERSION}.")

        def opt(name: str, dtype: type) -> np.ndarray | None:
            return np.asarray(z[name], dtype) if name in keys else None

        def strs(name: str) -> list[str] | None:
            return [str(s) for s in z[name]] if name in keys else None

        return Trace(
            model=str(z["model"]) if "model" in keys else "",
            num_layers=int(z["num_layers"]),
            num_experts=int(z["num_experts"]),
            top_k=int(z["top_k"]),
            seq_ids=np.asarray(z["seq_ids"], np.int32),
            iter_ids=np.asarray(z["iter_ids"], np.int32),
            phase=np.asarray(z["phase"], np.int8),
            topk_ids=np.asarray(z["topk_ids"], np.int16),
            topk_probs=np.asarray(z["topk_probs"], np.float32),
            probs=opt("probs", np.float32),
            embeddings=opt("embeddings", np.float32),
            seq_labels=strs("seq_labels"),
            seq_texts=strs("seq_texts"),
        )


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write `trace` as a compressed `.npz` (no pickled objects, so any numpy can read it)."""
    arrays: dict[str, np.ndarray] = {
        "format_version": np.int32(FORMAT_VERSION),
        "model": np.str_(trace.model),
        "num_layers": np.int32(trace.num_layers),
        "num_experts": np.int32(trace.num_experts),
        "top_k": np.int32(trace.top_k),
        "seq_ids": trace.seq_ids.astype(np.int32),
        "iter_ids": trace.iter_ids.astype(np.int32),
        "phase": trace.phase.astype(np.int8),
        "topk_ids": trace.topk_ids.astype(np.int16),
        "topk_probs": trace.topk_probs.astype(np.float32),
    }
    if trace.probs is not None:
        arrays["probs"] = trace.probs.astype(np.float32)
    if trace.embeddings is not None:
        arrays["embeddings"] = trace.embeddings.astype(np.float32)
    if trace.seq_labels is not None:
        arrays["seq_labels"] = np.asarray(trace.seq_labels, dtype=np.str_)
    if trace.seq_texts is not None:
        arrays["seq_texts"] = np.asarray(trace.seq_texts, dtype=np.str_)
    # Written beside the target and renamed over it: the recorder rewrites its file after every request, and a
    # reader (or a crash) must only ever see the previous whole trace or the new one, never a half-written zip.
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:  # a file object keeps numpy from appending ".npz" to the caller's name
            np.savez_compressed(f, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class TraceRecorder:
    """Collects what the runtime saw, one forward pass at a time, and writes it in the trace format.

    Usage (runtime): `rec = TraceRecorder(model_name, L, J, K)`; after each forward pass
    `rec.add(seq_id, phase, probs, embeddings)` with numpy arrays already on the CPU; `rec.label(seq_id, text=...)`
    optionally; `rec.checkpoint(path)` after each request (saves when due) and `rec.save(path)` at the end.
    Every `add` is one iteration. Full distributions are kept, and the top-K ids/probs are derived from them.
    Not thread-safe: call it from the thread that owns the forward pass.
    """

    def __init__(self, model: str, num_layers: int, num_experts: int, top_k: int) -> None:
        self.model, self.num_layers, self.num_experts, self.top_k = model, num_layers, num_experts, top_k
        self._chunks: list[tuple[int, int, np.ndarray, np.ndarray | None]] = []
        self._labels: dict[int, tuple[str, str]] = {}
        self._embed_dim: int | None = None
        self._saved_at: float | None = None  # _clock() when the last save ended
        self._save_s = 0.0  # how long it took
        self.unsaved = False  # something was added or labelled since the last save

    def __len__(self) -> int:
        """Rows (tokens) recorded so far."""
        return sum(c[2].shape[0] for c in self._chunks)

    def add(self, seq_id: int, phase: int, probs: np.ndarray, embeddings: np.ndarray | None = None) -> None:
        """Record one forward pass of request `seq_id`: `probs` [T, L, J], `embeddings` [T, h] or None."""
        probs = np.asarray(probs, np.float32)
        if probs.ndim != 3 or probs.shape[1:] != (self.num_layers, self.num_experts):
            raise ValueError(f"probs must be [T, {self.num_layers}, {self.num_experts}]; got {probs.shape}.")
        if self._chunks and self._chunks[-1][0] != seq_id and any(c[0] == seq_id for c in self._chunks):
            raise ValueError(f"Request {seq_id} was already finished; give each request its own seq_id.")
        if self._chunks and (embeddings is None) != (self._embed_dim is None):
            raise ValueError("Record embeddings for every forward pass or for none.")
        if embeddings is not None:
            embeddings = np.asarray(embeddings, np.float32)
            if embeddings.ndim != 2 or embeddings.shape[0] != probs.shape[0]:
                raise ValueError("embeddings must be [T, h] with one row per row of probs.")
            if self._embed_dim not in (None, embeddings.shape[1]):
                raise ValueError(f"embeddings changed size from {self._embed_dim} to {embeddings.shape[1]}.")
            self._embed_dim = embeddings.shape[1]
        self._chunks.append((int(seq_id), int(phase), probs.copy(), None if embeddings is None else embeddings.copy()))
        self.unsaved = True

    def label(self, seq_id: int, label: str = "", text: str = "") -> None:
        """Attach a label and/or the prompt text to request `seq_id` (saved as seq_labels/seq_texts)."""
        self._labels[int(seq_id)] = (label, text)
        self.unsaved = True

    def to_trace(self) -> Trace:
        lay, j, k = self.num_layers, self.num_experts, self.top_k
        if not self._chunks:
            empty = np.zeros((0,), np.int32)
            ids = np.zeros((0, lay, k), np.int16)
            return Trace(self.model, lay, j, k, empty, empty, empty.astype(np.int8), ids, ids.astype(np.float32))
        sizes = [c[2].shape[0] for c in self._chunks]
        seq_ids = np.repeat([c[0] for c in self._chunks], sizes).astype(np.int32)
        iter_ids = np.repeat(np.arange(len(self._chunks)), sizes).astype(np.int32)
        phase = np.repeat([c[1] for c in self._chunks], sizes).astype(np.int8)
        probs = np.concatenate([c[2] for c in self._chunks])  # [T, L, J]
        top = np.argsort(-probs, axis=2, kind="stable")[:, :, :k]
        emb = None if self._embed_dim is None else np.concatenate([c[3] for c in self._chunks])
        order = list(dict.fromkeys(int(s) for s in seq_ids))
        has_labels = bool(self._labels)
        return Trace(
            self.model,
            lay,
            j,
            k,
            seq_ids,
            iter_ids,
            phase,
            top.astype(np.int16),
            np.take_along_axis(probs, top, axis=2),
            probs,
            emb,
            [self._labels.get(s, ("", ""))[0] for s in order] if has_labels else None,
            [self._labels.get(s, ("", ""))[1] for s in order] if has_labels else None,
        )

    def save(self, path: str | Path) -> None:
        """Write everything recorded so far to `path` now."""
        start = _clock()
        save_trace(self.to_trace(), path)
        self._saved_at = _clock()
        self._save_s = self._saved_at - start
        self.unsaved = False

    def checkpoint(self, path: str | Path) -> bool:
        """Save if it is due (`SAVE_INTERVAL_PER_SAVE_S` × the last save's duration since it ended); True if it
        saved. The owner calls `save` once more at the end so nothing recorded is left out."""
        if not self.unsaved:
            return False
        if self._saved_at is not None and _clock() - self._saved_at < SAVE_INTERVAL_PER_SAVE_S * self._save_s:
            return False
        self.save(path)
        return True
