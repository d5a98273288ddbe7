"""MapStore with a sketched semantic side: exact answers where the best is clear, dedup, rebuilds, the h ≤ k path."""

from __future__ import annotations

import numpy as np
import pytest

from fmoe_local.config import RuntimeConfig
from fmoe_local.maps import ExpertMap, MapStore
from fmoe_local.policies.base import ModelShape
from tests.test_maps import FakePersistence, cosine

SHAPE = ModelShape(num_layers=4, num_experts=8, top_k=2, embed_dim=96)
K, M = 16, 4  # sketch 96 → 16 dimensions, 4 candidates re-ranked


def sketched(capacity: int = 512, **kw) -> MapStore:
    return MapStore(SHAPE, capacity, 1, sketch_dim=K, sketch_candidates=M, **kw)


def clustered_maps(rng: np.random.Generator, count: int, clusters: int = 24) -> list[ExpertMap]:
    """Embeddings around a few topic centres with a shared offset (like mean-pooled token embeddings: all cosines
    well above 0), routing drawn per map."""
    centres = rng.standard_normal((clusters, SHAPE.embed_dim)) + 2.0
    topic = rng.integers(0, clusters, count)
    sem = centres[topic] + 0.3 * rng.standard_normal((count, SHAPE.embed_dim))
    probs = rng.dirichlet(np.ones(SHAPE.num_experts), size=(count, SHAPE.num_layers))
    return [ExpertMap(probs[i].astype(np.float32), sem[i].astype(np.float32), i) for i in range(count)]


def fill(store: MapStore, maps: list[ExpertMap]) -> None:
    store.load_from(FakePersistence(list(enumerate(maps))))


def exact_best(maps: list[ExpertMap], sem: np.ndarray) -> tuple[int, float]:
    scores = [cosine(m.semantic, sem) for m in maps]
    return int(np.argmax(scores)), max(scores)


def test_sketch_search_returns_the_exact_best_when_it_is_clear():
    rng = np.random.default_rng(0)
    maps = clustered_maps(rng, 400)
    store = sketched()
    fill(store, maps)
    for i in rng.choice(len(maps), 40, replace=False):  # a stored prompt seen again, slightly changed
        query = maps[i].semantic + 0.02 * rng.standard_normal(SHAPE.embed_dim).astype(np.float32)
        slot, score = store.match_semantic(query)
        best, best_score = exact_best(maps, query)
        assert (slot, best) == (i, i)
        assert score == pytest.approx(best_score, abs=1e-5)  # the reported score is the exact cosine


def test_sketch_alone_can_miss_and_the_exact_rerank_is_what_recovers():
    # Unrelated random embeddings (every cosine near 0) are the sketch's worst case. With a single candidate the
    # sketch's own top-1 must sometimes differ from the exact one (so the sketch is really in use); the score it
    # reports is still the exact cosine of what it picked.
    rng = np.random.default_rng(1)
    maps = [
        ExpertMap(m.probs, rng.standard_normal(SHAPE.embed_dim).astype(np.float32), 0) for m in clustered_maps(rng, 300)
    ]
    one = MapStore(SHAPE, 512, 1, sketch_dim=K, sketch_candidates=1)
    everyone = MapStore(SHAPE, 512, 1, sketch_dim=K, sketch_candidates=300)  # re-ranks every map: exact
    fill(one, maps), fill(everyone, maps)
    misses = 0
    for _ in range(30):
        q = rng.standard_normal(SHAPE.embed_dim).astype(np.float32)
        best, best_score = exact_best(maps, q)
        slot, score = one.match_semantic(q)
        assert score == pytest.approx(cosine(maps[slot].semantic, q), abs=1e-5)
        misses += slot != best
        assert everyone.match_semantic(q) == (best, pytest.approx(best_score, abs=1e-5))
    assert misses > 0


def test_most_redundant_is_the_exact_argmax_on_clustered_maps():
    rng = np.random.default_rng(2)
    maps = clustered_maps(rng, 300)
    store, exact = sketched(), MapStore(SHAPE, 512, 1, sketch_dim=0)
    fill(store, maps), fill(exact, maps)
    for i in rng.choice(len(maps), 30, replace=False):
        q = ExpertMap(maps[i].probs * 0.9 + 0.1 / SHAPE.num_experts, maps[i].semantic + 0.05, 0)
        slot, rdy = store.most_redundant(q.probs, q.semantic)
        full = exact.redundancy(q.probs, q.semantic)
        assert slot == int(np.argmax(full)) == i
        assert rdy == pytest.approx(float(full.max()), abs=1e-5)


def test_dedup_fires_on_a_near_identical_map_in_a_sketched_store():
    rng = np.random.default_rng(3)
    maps = clustered_maps(rng, 200)
    store = sketched()
    fill(store, maps)
    again = ExpertMap(maps[77].probs.copy(), maps[77].semantic * 1.0001, request_id=999)
    assert store.add(again) == 77 and len(store) == 200
    assert store.get(77).request_id == 999
    other = ExpertMap(np.roll(maps[77].probs, 1, axis=1), maps[77].semantic, request_id=5)  # new routing
    assert store.add(other) == 200 and len(store) == 201


def test_reload_and_reconfigure_rebuild_the_same_sketch():
    rng = np.random.default_rng(4)
    maps = clustered_maps(rng, 120)
    disk = FakePersistence()
    store = sketched(capacity=128, persistence=disk, dedup_threshold=1.1)
    for m in maps:
        store.add(m)  # sketch rows written one map at a time
    queries = [(q.probs, q.semantic) for q in clustered_maps(rng, 10)]

    def answers(s: MapStore) -> list:
        return [(s.match_semantic(e), s.redundancy(p, e)) for p, e in queries]

    before = answers(store)
    reloaded = sketched(capacity=128)
    assert reloaded.load_from(disk) == 120  # sketch rebuilt in one batch from the embeddings
    store.reconfigure(capacity=256)
    for other in (reloaded, store):
        for (hit, rdy), (hit0, rdy0) in zip(answers(other), before, strict=True):
            assert hit[0] == hit0[0] and hit[1] == pytest.approx(hit0[1], abs=1e-6)
            np.testing.assert_allclose(rdy, rdy0, atol=1e-5)  # sketch estimates included
    store.reconfigure(capacity=50)  # keeps the newest 50, renumbered: their sketches move with them
    kept = maps[70:]
    for i in (0, 17, 49):
        assert store.match_semantic(kept[i].semantic) == (i, pytest.approx(1.0, abs=1e-6))
    store.clear()
    assert store.match_semantic(kept[0].semantic) == (-1, 0.0)
    assert store.add(kept[0]) == 0 and store.match_semantic(kept[0].semantic) == (0, pytest.approx(1.0, abs=1e-6))


@pytest.mark.parametrize("sketch_dim", [SHAPE.embed_dim, SHAPE.embed_dim + 1, 1000])
def test_no_sketch_when_h_is_at_most_k_gives_the_exact_answers(sketch_dim):
    rng = np.random.default_rng(5)
    maps = clustered_maps(rng, 150)
    a = MapStore(SHAPE, 100, 1, sketch_dim=sketch_dim, sketch_candidates=1)
    b = MapStore(SHAPE, 100, 1, sketch_dim=0)
    for m in maps:  # fills past capacity: RDY replacement decides every slot from 100 on
        assert a.add(m) == b.add(m)
    for q in clustered_maps(rng, 20):
        assert a.match_semantic(q.semantic) == b.match_semantic(q.semantic)
        np.testing.assert_array_equal(a.redundancy(q.probs, q.semantic), b.redundancy(q.probs, q.semantic))


def test_maps_without_embedding_never_win_the_semantic_search():
    rng = np.random.default_rng(6)
    maps = clustered_maps(rng, 40)
    store = sketched()
    for i, m in enumerate(maps):
        store.add(ExpertMap(m.probs, m.semantic if i == 39 else None, i))
    assert store.match_semantic(-maps[0].semantic) == (
        39,
        pytest.approx(cosine(maps[39].semantic, -maps[0].semantic), abs=1e-5),
    )


def test_config_rejects_impossible_sketch_settings():
    with pytest.raises(ValueError, match="sketch size"):
        RuntimeConfig(sketch_dim=-1).validate()
    with pytest.raises(ValueError, match="candidates to at least 1"):
        RuntimeConfig(sketch_candidates=0).validate()
    with pytest.raises(ValueError, match="candidates to at least 1"):
        MapStore(SHAPE, 4, 1, sketch_candidates=0)


def test_bench_agreement_counts_every_choice_and_agrees_when_every_map_is_reranked(tmp_path):
    from fmoe_bench.matcher import trace_agreement
    from fmoe_local.traces import save_trace
    from tests.test_oracle import synthetic_trace

    path = tmp_path / "t.npz"
    save_trace(synthetic_trace(0, requests=6, length=15), path)  # 90 passes; h = L·J = 24 (request-map-mean)
    # Re-ranking as many maps as the store holds makes the sketched store exact: the bench's own brute force (its
    # mirror of the store, its RDY formula) must then agree with every choice.
    a, h = trace_agreement(str(path), capacity=16, sketch_dim=4, candidates=16)
    assert h == 24
    # No semantic input on a request's first pass; the second pass of the first request finds no stored map with an
    # embedding yet (the first was stored without); the very first add has nothing to compare with.
    assert (a.searches, a.adds) == (90 - 6 - 1, 90 - 1)
    assert (a.same_top1, a.same_rdy) == (a.searches, a.adds)
    assert a.top1_loss == pytest.approx(0.0, abs=1e-5) and a.rdy_loss == pytest.approx(0.0, abs=1e-5)


def test_for_config_builds_the_store_the_settings_describe():
    shape = ModelShape(num_layers=3, num_experts=8, top_k=2, embed_dim=512)
    config = RuntimeConfig(store_capacity=17, prefetch_distance=2, sketch_dim=64, sketch_candidates=5)
    store = MapStore.for_config(shape, config)
    assert (store.capacity, store.prefetch_distance) == (17, 2)
    assert store._semantic.sketch_dim == 64 and store._semantic.candidates == 5
    assert not MapStore.for_config(shape, config.with_changes(sketch_dim=0))._semantic.sketched
