"""The map store's semantic side: stored embeddings, their norms, and a random-projection sketch for fast search.

Scope: `SemanticIndex` keeps one embedding per map slot and answers cosine questions about them — the best slot for
a query (`search`), every slot's cosine (`cosines`), and exact cosines for a few slots (`exact`). It does NOT lock
(the owning `MapStore` holds its lock around every call), mix in trajectory scores (RDY is maps.py's) or persist.

Why a sketch: a full search reads every stored embedding (32K maps × h = 2048 float32 = 256 MB per forward pass,
≈ 14 ms on a 2-core CPU), over the matcher's budget. A fixed, seeded Gaussian projection R [k, h]
(Johnson–Lindenstrauss) keeps a unit-length sketch [k, C] of every embedding; a search reads the sketch (k/h of the
bytes), keeps the top `candidates` slots by sketch cosine, and re-ranks those with the exact cosine on the full
embeddings.

What is exact and what is not:
- The returned score is always the exact cosine of the returned slot.
- The returned slot is the exact best whenever the exact best is among the `candidates` highest sketch cosines.
  Normalising each sketch by its own length makes the estimate's error shrink as the cosine nears 1 (its variance
  is about (1 − cos²)² / k), so a clearly best, close match is kept; when all cosines are near 0 (unrelated random
  embeddings, the worst case) the sketch cannot tell them apart and another near-0 match may be returned.
- `cosines` returns sketch estimates for every slot; `exact` the true cosines of the slots asked for.
- With h ≤ k (or k = 0) there is no sketch: `cosines` and `search` are the exact full scan.

The sketch is derived data: rows written since the last search are projected in one batch on the next call (or on
`flush`), so a store filled by `load_from` builds it with a few matrix products instead of one per map.

Array legend: C capacity, n slots in use (0..n-1), h embedding size, k sketch size, m candidates.
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-12
# Fixed so that the same stored maps give the same answers in the runtime, the replay and after a restart.
SKETCH_SEED = 20251122
_GEMM_ROWS = 16  # fewer new rows are projected one blocked gemv each: a [1, h] @ [h, k] gemm went multi-threaded, ~7 ms
_FLUSH_ROWS = 4096  # rows projected per matrix product when the sketch catches up (bounds the temporary copy)
# Elements per BLAS call of the sketch scan: OpenBLAS keeps a gemv this small on one thread. Measured on the busy
# 2-core machine, CPU time of one 32768-map scan at k = 256: 2.0–2.3 ms in 131072-element blocks, 1.5–1.7 ms in
# 262144-element blocks, 11 ms in 524288-element ones (threads); the [C, k] row layout took 2.7–3.4 ms.
_SCAN_ELEMS = 262144


class SemanticIndex:
    def __init__(self, dim: int, capacity: int, sketch_dim: int, candidates: int, block_elems: int) -> None:
        if sketch_dim < 0:
            raise ValueError("Set the semantic sketch size to 0 (exact search) or a positive number of dimensions.")
        if candidates < 1:
            raise ValueError("Set the semantic sketch candidates to at least 1: that many maps are re-ranked exactly.")
        self.dim = dim
        self.candidates = candidates
        self._block_elems = block_elems  # elements per BLAS call, see trajectory_index.BLOCK_ELEMS
        self.sketch_dim = sketch_dim if 0 < sketch_dim < dim else 0
        self._proj: np.ndarray | None = None
        if self.sketch_dim:
            rng = np.random.default_rng(SKETCH_SEED)
            # R stored transposed, [k, h]: projecting a query is then a row-blocked gemv like the scans (one
            # [h] @ [h, k] call goes multi-threaded and measured 7.7 ms CPU against 0.07 ms on a busy machine).
            self._proj = rng.standard_normal((self.sketch_dim, dim), dtype=np.float32)  # [k, h]
        self.alloc(capacity)

    @property
    def sketched(self) -> bool:
        return self._proj is not None

    def alloc(self, capacity: int) -> None:
        """Fresh, empty arrays for `capacity` slots (the projection is kept)."""
        self._emb = np.zeros((capacity, self.dim), np.float32)  # [C, h]
        self._norm = np.zeros(capacity, np.float32)  # [C]
        self._has = np.zeros(capacity, bool)  # [C]
        # Maps innermost, as in the trajectory arrays: a scan is one gemv per block of maps.
        self._sketch = np.zeros((self.sketch_dim, capacity), np.float32)  # [k, C] unit columns (0: no embedding)
        self._pending: list[int] = []  # slots whose sketch row is stale

    # --- writing ---------------------------------------------------------------------------------------------
    def write(self, slot: int, semantic: np.ndarray | None) -> None:
        if semantic is None:
            self._emb[slot] = 0.0
            self._norm[slot] = 0.0
            self._sketch[:, slot] = 0.0
        else:
            self._emb[slot] = semantic
            self._norm[slot] = np.linalg.norm(semantic)
            if self.sketched:
                self._pending.append(slot)
        self._has[slot] = semantic is not None

    def flush(self) -> None:
        """Project the embeddings written since the last call (batched: one product per `_FLUSH_ROWS` rows)."""
        if not self._pending:
            return
        slots = np.unique(np.asarray(self._pending, np.int64))
        self._pending = []
        for a in range(0, slots.size, _FLUSH_ROWS):
            rows = slots[a : a + _FLUSH_ROWS]
            if rows.size < _GEMM_ROWS:  # a few new maps: blocked gemvs (one small gemm goes multi-threaded, slow)
                sk = np.stack([self._dots(self._proj, self._emb[r], self.sketch_dim) for r in rows])  # [r, k]
            else:
                sk = self._emb[rows] @ self._proj.T  # [r, k]
            norm = np.linalg.norm(sk, axis=1, keepdims=True)
            self._sketch[:, rows] = np.where(norm > 0, sk / np.maximum(norm, _EPS), 0.0).T

    # --- reading ---------------------------------------------------------------------------------------------
    def has(self, n: int) -> np.ndarray:
        """[n] which slots hold an embedding (a view)."""
        return self._has[:n]

    def get(self, slot: int) -> np.ndarray | None:
        return self._emb[slot].copy() if self._has[slot] else None

    def cosines(self, q: np.ndarray, n: int) -> np.ndarray:
        """[n] cosine of q with every slot: the exact one without a sketch, the sketch estimate with one.
        Slots without an embedding get 0 (callers mask them with `has`)."""
        if not self.sketched:
            qn = float(np.linalg.norm(q))
            return self._dots(self._emb, q, n) / np.maximum(self._norm[:n] * qn, _EPS)
        self.flush()
        qs = self._dots(self._proj, q, self.sketch_dim)  # [k]
        qsn = float(np.linalg.norm(qs))
        if qsn == 0.0:
            return np.zeros(n, np.float32)
        qs /= qsn
        out = np.empty(n, np.float32)
        step = max(1, _SCAN_ELEMS // self.sketch_dim)
        for a in range(0, n, step):
            b = min(a + step, n)
            np.matmul(qs, self._sketch[:, a:b], out=out[a:b])
        return out

    def exact(self, q: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """[m] exact cosine of q with the given slots' full embeddings (0 for a slot without one)."""
        qn = float(np.linalg.norm(q))
        rows = self._emb[slots]  # [m, h] copy: m rows, not the store
        return self._dots(rows, q, rows.shape[0]) / np.maximum(self._norm[slots] * qn, _EPS)

    def shortlist(self, scores: np.ndarray) -> np.ndarray:
        """Slots of the `candidates` highest scores, in ascending slot order (so ties go to the lowest slot)."""
        n = scores.size
        if n <= self.candidates:
            return np.arange(n)
        top = np.argpartition(scores, n - self.candidates)[n - self.candidates :]
        top.sort()
        return top

    def search(self, q: np.ndarray, n: int) -> tuple[int, float, np.ndarray]:
        """(best slot, its exact cosine, the [n] `cosines` used to find it) over slots with an embedding.
        The caller makes sure q is non-zero and at least one of the n slots has an embedding."""
        cos = self.cosines(q, n)  # [n]
        scores = np.where(self._has[:n], cos, -np.inf)
        if not self.sketched:
            best = int(np.argmax(scores))
            return best, float(scores[best]), cos
        cand = self.shortlist(scores)  # [m]
        exact = np.where(self._has[cand], self.exact(q, cand), -np.inf)
        i = int(np.argmax(exact))
        return int(cand[i]), float(exact[i]), cos

    def _dots(self, rows: np.ndarray, q: np.ndarray, n: int) -> np.ndarray:
        """[n] rows[:n] @ q in row blocks of `_block_elems` elements."""
        out = np.empty(n, np.float32)
        step = max(1, self._block_elems // max(1, q.shape[0]))
        for a in range(0, n, step):
            b = min(a + step, n)
            np.matmul(rows[a:b], q, out=out[a:b])
        return out
