import numpy as np

from fmoe_local.trajectory_index import BLOCK_ELEMS, TrajectoryIndex

L, J = 3, 64


def _maps(rng: np.random.Generator, n: int, top: int) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        m = np.zeros((L, J), np.float32)
        for layer in range(L):
            ids = rng.choice(J, top, replace=False)
            m[layer, ids] = rng.random(top, dtype=np.float32)
        out.append(m)
    return out


def test_layer_dots_and_prefix_norms_match_a_dense_computation() -> None:
    rng = np.random.default_rng(0)
    n = BLOCK_ELEMS // 6 + 50  # more maps than one BLAS block, for a sparse (6 rows) query
    index = TrajectoryIndex(L, J, capacity=n + 10)
    maps = _maps(rng, n, top=6)
    maps[3][0] = 0.0  # a map whose first layer is all zero
    for slot, m in enumerate(maps):
        index.write(slot, m)
    stacked = np.stack(maps)  # [n, L, J]
    sparse, dense = maps[7][1], rng.random(J, dtype=np.float32)  # top-k-only rows vs a full distribution
    for q in (sparse, dense):
        np.testing.assert_allclose(index.layer_dots(1, q, n), stacked[:, 1] @ q, rtol=1e-5)
    norms = np.sqrt(np.square(stacked[:, :2].astype(np.float64)).sum(axis=(1, 2)))
    np.testing.assert_allclose(index.inv_norms(2, n), 1.0 / norms, rtol=1e-5)
    assert index.inv_norms(1, n)[3] == 0.0  # an all-zero prefix scores 0, never inf
    np.testing.assert_array_equal(index.probs(5), maps[5])


def test_alloc_starts_empty() -> None:
    index = TrajectoryIndex(L, J, capacity=4)
    index.write(0, np.ones((L, J), np.float32))
    index.alloc(8)
    assert not index.probs(0).any() and index.inv_norms(L, 8).tolist() == [0.0] * 8
