"""The map store's trajectory side: every stored map's [L, J] probabilities, laid out for prefix cosine searches.

Scope: `TrajectoryIndex` keeps the maps' probabilities layer-major with maps innermost ([L, J, C]) and each map's
prefix norms, and answers dot products of a query layer with every stored map's same layer (`layer_dots`). It does
NOT lock (the owning `MapStore` holds its lock around every call), cache queries, mix in semantic scores (RDY is
maps.py's) or persist.

Array legend: C capacity, n slots in use (0..n-1), L MoE layers, J experts.
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-12
# Elements per BLAS call. A small gemv stays on one thread: on a busy 2-core machine one [64, 32768] gemv measured
# 7 ms with 2 BLAS threads against 0.5 ms cut in 2048-column blocks (and a [1300, 1664] one 9.4 ms against 1.6 ms).
BLOCK_ELEMS = 131072


class TrajectoryIndex:
    def __init__(self, num_layers: int, num_experts: int, capacity: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.alloc(capacity)

    def alloc(self, capacity: int) -> None:
        """Empty arrays for `capacity` maps (what was stored is dropped: the owner rewrites what it keeps)."""
        L, J = self.num_layers, self.num_experts
        # Layer-major with maps innermost: one layer's [J, n] block is contiguous, so a trajectory search is one
        # gemv per new layer, and a sparse query reads only its non-zero experts' rows.
        self._traj = np.zeros((L, J, capacity), np.float32)  # [L, J, C]
        # cumsq[l, c]: squared norm of map c's first l layers, so any prefix norm is O(1) per map.
        self._cumsq = np.zeros((L + 1, capacity), np.float64)  # [L+1, C]
        # 1/sqrt(cumsq) (0 for an all-zero prefix): a search is then one gemv, one multiply and one argmax.
        self._inv_norm = np.zeros((L + 1, capacity), np.float32)  # [L+1, C]

    def write(self, slot: int, probs: np.ndarray) -> None:
        """Store map `probs` [L, J] (already validated) in `slot`."""
        self._traj[:, :, slot] = probs
        self._cumsq[0, slot] = 0.0
        self._cumsq[1:, slot] = np.cumsum(np.square(probs, dtype=np.float64).sum(axis=1))
        cs = self._cumsq[:, slot]
        self._inv_norm[:, slot] = np.where(cs > 0, 1.0 / np.sqrt(np.maximum(cs, _EPS)), 0.0)

    def probs(self, slot: int) -> np.ndarray:
        """A copy of the map in `slot` [L, J]."""
        return np.ascontiguousarray(self._traj[:, :, slot])

    def inv_norms(self, depth: int, n: int) -> np.ndarray:
        """[n] 1 / ‖first `depth` layers‖ of each stored map (0 where that prefix is all zero)."""
        return self._inv_norm[depth, :n]

    def layer_dots(self, layer: int, q: np.ndarray, n: int) -> np.ndarray:
        """[n] dot products of one layer's query row `q` [J] with every stored map's same layer."""
        nz = q.nonzero()[0]
        if nz.size * 4 <= q.size:  # top-k-only maps: read just the rows that can contribute
            qv, rows = q[nz], self._traj[layer, nz, :n]
        else:
            qv, rows = q, self._traj[layer, :, :n]
        out = np.empty(n, np.float32)
        step = max(1, BLOCK_ELEMS // max(1, rows.shape[0]))
        for a in range(0, n, step):
            np.matmul(qv, rows[:, a : a + step], out=out[a : a + step])
        return out
