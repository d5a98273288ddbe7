"""MapStore: searches against brute-force cosines, RDY replacement and dedup, persistence callbacks, threads."""

from __future__ import annotations

import numpy as np
import pytest

from fmoe_local.maps import ExpertMap, MapPersistence, MapStore
from fmoe_local.policies.base import ModelShape
from fmoe_local.semantic_index import SemanticIndex
from tests.threads import run_in_threads

SHAPE = ModelShape(num_layers=4, num_experts=8, top_k=2, embed_dim=3)


class FakePersistence(MapPersistence):
    def __init__(self, initial: list[tuple[int, ExpertMap]] | None = None) -> None:
        self.rows: dict[int, ExpertMap] = dict(initial or [])
        self.calls: list[tuple] = []

    def load(self) -> list[tuple[int, ExpertMap]]:
        return list(self.rows.items())

    def put(self, slot: int, expert_map: ExpertMap) -> None:
        self.calls.append(("put", slot))
        self.rows[slot] = expert_map

    def clear(self) -> None:
        self.calls.append(("clear",))
        self.rows.clear()


class LinkedPersistence(FakePersistence):
    """A persistence that keeps successor links too: load() gives (slot, map, next_slot)."""

    def __init__(self, initial: list[tuple[int, ExpertMap, int]] | None = None) -> None:
        super().__init__([(s, m) for s, m, _ in initial or []])
        self.links: dict[int, int] = {s: n for s, _, n in initial or [] if n >= 0}

    def load(self) -> list[tuple[int, ExpertMap, int]]:
        return [(s, m, self.links.get(s, -1)) for s, m in self.rows.items()]

    def put_link(self, slot: int, next_slot: int) -> None:
        self.calls.append(("link", slot, next_slot))
        self.links[slot] = next_slot

    def clear(self) -> None:
        super().clear()
        self.links.clear()


def one_hot_map(experts: list[int], sem: list[float] | None = None, request_id: int = 0) -> ExpertMap:
    p = np.zeros((SHAPE.num_layers, SHAPE.num_experts), np.float32)
    for layer, e in enumerate(experts):
        p[layer, e] = 1.0
    return ExpertMap(p, None if sem is None else np.asarray(sem, np.float32), request_id)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def random_maps(rng: np.random.Generator, count: int, shape: ModelShape = SHAPE) -> list[ExpertMap]:
    logits = rng.standard_normal((count, shape.num_layers, shape.num_experts)) * 2
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    sem = rng.standard_normal((count, shape.embed_dim))
    return [ExpertMap(p[i].astype(np.float32), sem[i].astype(np.float32), i) for i in range(count)]


def test_empty_store_matches_nothing():
    store = MapStore(SHAPE, capacity=4, prefetch_distance=1)
    assert len(store) == 0
    assert store.match_semantic(np.ones(3, np.float32)) == (-1, 0.0)
    assert store.match_trajectory(np.ones((2, 8), np.float32)) == (-1, 0.0)


def test_trajectory_match_hand_computed():
    store = MapStore(SHAPE, capacity=4, prefetch_distance=1)
    a = store.add(one_hot_map([0, 1, 2, 3]))
    b = store.add(one_hot_map([0, 5, 2, 3]))
    assert (a, b) == (0, 1)
    # First layer: both maps agree with the query → tie, first slot, cosine 1.
    assert store.match_trajectory(one_hot_map([0, 5, 0, 0]).probs[:1]) == (0, pytest.approx(1.0))
    # Two layers [e0, e5]: map b matches exactly; map a shares one of two unit entries → 0.5.
    slot, score = store.match_trajectory(one_hot_map([0, 5, 0, 0]).probs[:2])
    assert (slot, score) == (1, pytest.approx(1.0))
    # Query [e0, e1, e6]: a shares 2 of 3 → 2/3, b shares 1 → 1/3.
    slot, score = store.match_trajectory(one_hot_map([0, 1, 6, 0]).probs[:3])
    assert (slot, score) == (0, pytest.approx(2 / 3))


@pytest.mark.parametrize("sparse", [False, True])
def test_trajectory_search_equals_brute_force_in_any_call_order(sparse):
    rng = np.random.default_rng(1)
    maps = random_maps(rng, 20)
    if sparse:  # top-2 only, as recordings from other tools are rebuilt
        for m in maps:
            cut = np.argsort(m.probs, axis=1)[:, :-2]
            np.put_along_axis(m.probs, cut, 0.0, axis=1)
    store = MapStore(SHAPE, capacity=32, prefetch_distance=2, dedup_threshold=1.1)
    for m in maps[:15]:
        store.add(m)
    stored = np.stack([store.probs(s) for s in range(len(store))])
    for q in maps[15:]:
        for depth in [1, 2, 3, 4, 2, 4]:  # extending, then restarting: the incremental cache must not leak
            scores = [cosine(q.probs[:depth], s[:depth]) for s in stored]
            slot, score = store.match_trajectory(q.probs[:depth])
            assert slot == int(np.argmax(scores))
            assert score == pytest.approx(max(scores), rel=1e-5)
    # A write between two calls of one iteration invalidates the running dot products.
    store.match_trajectory(maps[15].probs[:2])
    store.add(maps[15])
    assert store.match_trajectory(maps[15].probs[:3]) == (len(store) - 1, pytest.approx(1.0))


def test_semantic_match_skips_maps_without_embedding():
    store = MapStore(SHAPE, capacity=4, prefetch_distance=1)
    store.add(one_hot_map([0, 0, 0, 0], sem=None))
    assert store.match_semantic(np.array([1, 0, 0], np.float32)) == (-1, 0.0)
    store.add(one_hot_map([1, 1, 1, 1], sem=[0.0, 1.0, 0.0]))
    store.add(one_hot_map([2, 2, 2, 2], sem=[1.0, 1.0, 0.0]))
    slot, score = store.match_semantic(np.array([1, 0, 0], np.float32))
    assert (slot, score) == (2, pytest.approx(1 / np.sqrt(2)))
    assert store.match_semantic(None) == (-1, 0.0)


def test_full_store_replaces_most_redundant_by_rdy_weights():
    # Old A: same routing as the new map, orthogonal prompt. Old B: same prompt, routing cosine 0.5. C and D, newer
    # and unlike the new map, are the newer half: never replaced here.
    new = one_hot_map([0, 1, 2, 3], sem=[1, 0, 0])
    a = one_hot_map([0, 1, 2, 3], sem=[0, 1, 0])
    b = one_hot_map([0, 1, 6, 7], sem=[1, 0, 0])
    c, d = one_hot_map([4, 5, 6, 7], sem=[0, 0, 1]), one_hot_map([5, 4, 7, 6], sem=[0, 0, 1])
    # d=1, L=4: RDY_A = 1/4·0 + 3/4·1 = 0.75; RDY_B = 1/4·1 + 3/4·0.5 = 0.625 → A goes.
    store = MapStore(SHAPE, capacity=4, prefetch_distance=1)
    store.add(a), store.add(b), store.add(c), store.add(d)
    np.testing.assert_allclose(store.redundancy(new.probs, new.semantic)[:2], [0.75, 0.625], rtol=1e-6)
    assert store.add(new) == 0 and len(store) == 4
    # d=3: RDY_A = 3/4·0 + 1/4·1 = 0.25; RDY_B = 3/4·1 + 1/4·0.5 = 0.875 → B goes.
    store = MapStore(SHAPE, capacity=4, prefetch_distance=3)
    store.add(a), store.add(b), store.add(c), store.add(d)
    assert store.add(new) == 1
    np.testing.assert_array_equal(store.probs(1), new.probs)


def test_full_store_gives_up_only_its_older_half():
    # A new topic arrives in a store full of an old one: its maps are the most redundant with each other, yet they
    # must not replace each other while older maps remain, or the store never learns the new topic.
    store = MapStore(SHAPE, capacity=4, prefetch_distance=1)
    old = [one_hot_map([e, e, e, e], sem=[0, 1, 0]) for e in range(4)]
    for m in old:
        store.add(m)
    new = [one_hot_map([4, 5, 6, e], sem=[1, 0, 0]) for e in (7, 6, 5, 4)]
    slots = [store.add(new[0]), store.add(new[1]), store.add(new[2])]
    # Each newcomer is most redundant with the one before it (RDY 0.8125 against 0), yet they all stay: the oldest
    # half of the store is three old-topic maps, then two, then the older of {old map, new[0]}.
    assert len(set(slots)) == 3 and len(store) == 4
    for m in new[:3]:
        assert any(np.array_equal(store.probs(s), m.probs) for s in range(4))
    # Now new[0] is among the older half, and the most redundant there: it goes.
    slots.append(store.add(new[3]))
    assert slots[3] == slots[0]
    # A store of one map replaces it.
    one = MapStore(SHAPE, capacity=1, prefetch_distance=1)
    assert one.add(old[0]) == 0 and one.add(new[0]) == 0 and np.array_equal(one.probs(0), new[0].probs)
    # Near-identical maps are still merged wherever they sit, newest included.
    again = one_hot_map([4, 5, 6, 4], sem=[1, 0, 0.0001])
    assert store.add(again) == slots[3] and len(store) == 4


def test_near_identical_map_replaces_instead_of_adding():
    store = MapStore(SHAPE, capacity=8, prefetch_distance=1)
    first = one_hot_map([0, 1, 2, 3], sem=[1, 0, 0], request_id=1)
    assert store.add(first) == 0
    assert store.add(one_hot_map([0, 1, 2, 4], sem=[1, 0, 0])) == 1  # different routing: a new slot
    assert store.add(one_hot_map([0, 1, 2, 3], sem=[1, 0, 0.001], request_id=9)) == 0
    assert len(store) == 2 and store.get(0).request_id == 9


def test_persistence_sees_every_slot_write_and_clear():
    fake = FakePersistence()
    store = MapStore(SHAPE, capacity=2, prefetch_distance=1, persistence=fake)
    store.add(one_hot_map([0, 1, 2, 3], sem=[1, 0, 0]))
    store.add(one_hot_map([4, 5, 6, 7], sem=[0, 1, 0]))
    store.add(one_hot_map([4, 5, 6, 6], sem=[0, 1, 0]))  # full: replaces the older slot 0, on disk too
    assert fake.calls == [("put", 0), ("put", 1), ("put", 0)]
    np.testing.assert_array_equal(fake.rows[0].probs, store.probs(0))
    store.clear()
    assert len(store) == 0 and fake.rows == {}


def test_load_from_restores_and_compacts_gaps():
    maps = random_maps(np.random.default_rng(2), 3)
    wrong = ExpertMap(np.zeros((2, 8), np.float32), None, 0)
    fake = FakePersistence([(0, maps[0]), (5, maps[1]), (7, maps[2]), (9, wrong)])
    store = MapStore(SHAPE, capacity=8, prefetch_distance=1)
    assert store.load_from(fake) == 3
    for i in range(3):
        np.testing.assert_array_equal(store.probs(i), maps[i].probs)
    assert sorted(fake.rows) == [0, 1, 2]  # rewritten so slot numbers stay the identity on disk
    assert store.match_semantic(maps[2].semantic)[0] == 2
    fake.calls.clear()
    assert MapStore(SHAPE, capacity=8, prefetch_distance=1).load_from(fake) == 3
    assert fake.calls == []  # already contiguous: nothing rewritten


def test_reconfigure_grows_in_place_and_shrinks_to_newest():
    fake = FakePersistence()
    store = MapStore(SHAPE, capacity=4, prefetch_distance=1, persistence=fake, dedup_threshold=1.1)
    maps = random_maps(np.random.default_rng(3), 4)
    for m in maps:
        store.add(m)
    store.reconfigure(capacity=6, prefetch_distance=2)
    assert (store.capacity, store.prefetch_distance, len(store)) == (6, 2, 4)
    np.testing.assert_array_equal(store.probs(3), maps[3].probs)
    store.reconfigure(capacity=2)
    assert len(store) == 2
    assert [store.get(s).request_id for s in range(2)] == [2, 3]
    assert sorted(fake.rows) == [0, 1] and fake.rows[0].request_id == 2


def test_rejects_maps_of_another_shape():
    store = MapStore(SHAPE, capacity=2, prefetch_distance=1)
    with pytest.raises(ValueError, match=r"\[4, 8\]"):
        store.add(ExpertMap(np.zeros((3, 8), np.float32), None, 0))
    with pytest.raises(ValueError):
        store.match_trajectory(np.zeros((5, 8), np.float32))


def test_concurrent_adds_and_searches():
    shape = ModelShape(num_layers=4, num_experts=8, top_k=2, embed_dim=3)
    store = MapStore(shape, capacity=64, prefetch_distance=2)
    maps = random_maps(np.random.default_rng(4), 200)

    def writer() -> None:
        for m in maps:
            store.add(m)

    def reader() -> None:
        for m in maps:
            for depth in range(1, 5):
                slot, score = store.match_trajectory(m.probs[:depth])
                assert slot < 64 and score <= 1.0 + 1e-5
            store.match_semantic(m.semantic)

    assert run_in_threads(writer, reader) == []
    assert len(store) == 64
    last = maps[-1]
    assert store.match_trajectory(last.probs)[1] == pytest.approx(1.0)


def test_probs_is_a_copy_of_the_stored_map() -> None:
    shape = ModelShape(num_layers=3, num_experts=4, top_k=1)
    store = MapStore(shape, capacity=4, prefetch_distance=1)
    probs = np.arange(12, dtype=np.float32).reshape(3, 4) / 12
    slot = store.add(ExpertMap(probs, None, 0))
    got = store.probs(slot)
    np.testing.assert_array_equal(got, probs)
    got[:] = 0  # the caller's copy, not the store's arrays
    np.testing.assert_array_equal(store.probs(slot), probs)
    with pytest.raises(IndexError):
        store.probs(slot + 1)


def test_redundancy_reuses_the_iterations_own_searches_only_when_they_fit() -> None:
    rng = np.random.default_rng(3)
    shape = ModelShape(num_layers=4, num_experts=6, top_k=2, embed_dim=5)
    store = MapStore(shape, capacity=16, prefetch_distance=2)
    for i in range(10):
        store.add(ExpertMap(rng.dirichlet(np.ones(6), size=4).astype(np.float32), rng.standard_normal(5), i))
    q = rng.dirichlet(np.ones(6), size=4).astype(np.float32)
    sem = rng.standard_normal(5).astype(np.float32)
    fresh = store.redundancy(q, sem)
    store.match_semantic(sem)
    for depth in range(1, 5):
        store.match_trajectory(q[:depth])
    np.testing.assert_array_equal(store.redundancy(q, sem), fresh)
    other, other_sem = q[::-1].copy(), -sem  # a different map: the cached dots must not be used
    expected = MapStore(shape, capacity=16, prefetch_distance=2)
    for slot in range(len(store)):
        expected.add(store.get(slot))
    np.testing.assert_allclose(store.redundancy(other, other_sem), expected.redundancy(other, other_sem), rtol=1e-6)


# Four maps that share no expert in any layer: a copy of one is redundant with that one only.
CHAIN = [[0, 1, 2, 3], [4, 5, 6, 7], [1, 2, 3, 4], [5, 6, 7, 0]]


def linked_store(capacity: int, persistence: LinkedPersistence) -> MapStore:
    """CHAIN stored as one request (links 0 → 1 → 2 → 3), then a copy of map 0 after map 3: slot 0 is replaced."""
    store = MapStore(SHAPE, capacity=capacity, prefetch_distance=1, persistence=persistence, dedup_threshold=1.1)
    prev = -1
    for experts in [*CHAIN, CHAIN[0]]:
        prev = store.add(one_hot_map(experts), after=prev)
    return store


def test_links_follow_a_request_and_survive_replacing_either_end():
    fake = LinkedPersistence()
    store = linked_store(4, fake)
    # The copy replaced slot 0 and was linked from slot 3; slot 0 keeps its own link to 1 until a new one is made.
    assert [store.successor(s) for s in range(4)] == [1, 2, 3, 0]
    assert fake.calls == [
        ("put", 0), ("put", 1), ("link", 0, 1), ("put", 2), ("link", 1, 2),
        ("put", 3), ("link", 2, 3), ("put", 0), ("link", 3, 0),
    ]  # fmt: skip
    assert store.add(one_hot_map(CHAIN[2]), after=-1) == 2  # a new request's first map replaces slot 2
    assert [store.successor(s) for s in range(4)] == [1, 2, 3, 0]  # 1 → 2 still points at the similar map
    assert store.successor(-1) == store.successor(4) == -1
    store.clear()
    assert fake.links == {} and store.successor(0) == -1
    store.add(one_hot_map(CHAIN[0]))
    assert store.add(one_hot_map(CHAIN[1])) == 1
    assert store.successor(0) == -1  # the cleared link does not come back with the slot


def test_reconfigure_keeps_links_when_growing_and_renumbers_them_when_shrinking():
    fake = LinkedPersistence()
    store = linked_store(4, fake)
    store.reconfigure(capacity=6)
    assert [store.successor(s) for s in range(4)] == [1, 2, 3, 0]
    # Shrinking keeps the two newest maps, slots 0 (the copy) and 3, as slots 0 and 1: 3 → 0 becomes 1 → 0, and
    # 0 → 1 goes with map 1.
    store.reconfigure(capacity=2)
    assert [store.successor(s) for s in range(2)] == [-1, 0]
    assert fake.links == {1: 0} and sorted(fake.rows) == [0, 1]
    prev = store.add(one_hot_map(CHAIN[1]), after=0)
    assert store.successor(0) == prev


def test_load_from_restores_links_renumbered_and_drops_dangling_ones():
    maps = random_maps(np.random.default_rng(4), 3)
    fake = LinkedPersistence([(0, maps[0], 5), (5, maps[1], 7), (7, maps[2], 3)])  # slot 3 is not on disk
    store = MapStore(SHAPE, capacity=8, prefetch_distance=1)
    assert store.load_from(fake) == 3
    assert [store.successor(s) for s in range(3)] == [1, 2, -1]
    assert fake.links == {0: 1, 1: 2} and sorted(fake.rows) == [0, 1, 2]  # rewritten, links included
    fake.calls.clear()
    again = MapStore(SHAPE, capacity=8, prefetch_distance=1)
    assert again.load_from(fake) == 3 and fake.calls == []  # in order already: nothing rewritten
    assert [again.successor(s) for s in range(3)] == [1, 2, -1]
    # A persistence without links loads with none, and is never asked to keep one.
    plain = FakePersistence([(0, maps[0]), (1, maps[1])])
    store = MapStore(SHAPE, capacity=8, prefetch_distance=1)
    store.load_from(plain)
    assert store.add(maps[2], after=1) == 2 and store.successor(1) == 2
    assert [c[0] for c in plain.calls] == ["put"]


def test_a_capacity_memory_cannot_hold_leaves_the_store_as_it_was(monkeypatch):
    # Apply of 10**12 maps: the allocator's MemoryError came after the store already claimed that capacity with its
    # old arrays, and every later reply failed on an out-of-bounds slot.
    store = MapStore(SHAPE, capacity=3, prefetch_distance=1, dedup_threshold=1.1)
    maps = random_maps(np.random.default_rng(5), 5)
    for m in maps[:3]:
        store.add(m)

    def no_memory(self, capacity):
        raise MemoryError(f"Unable to allocate arrays for {capacity} maps")

    monkeypatch.setattr(SemanticIndex, "alloc", no_memory)  # after the trajectory arrays were made
    with pytest.raises(MemoryError):
        store.reconfigure(capacity=10**6)
    monkeypatch.undo()
    assert (store.capacity, len(store)) == (3, 3)
    np.testing.assert_array_equal(store.probs(2), maps[2].probs)
    store.add(maps[3], after=2)  # full: replaces a map, within the arrays it has
    assert len(store) == 3 and store.match_semantic(maps[4].semantic)[0] in range(3)
    assert store.match_trajectory(maps[4].probs)[0] in range(3)


def test_a_slots_revision_changes_whenever_the_slot_is_written_and_never_repeats():
    store = MapStore(SHAPE, capacity=8, prefetch_distance=1)
    store.add(one_hot_map([0, 1, 2, 3], sem=[1, 0, 0]))
    store.add(one_hot_map([0, 1, 2, 4], sem=[1, 0, 0]), after=0)
    first = [store.revision(s) for s in range(2)]
    assert first[0] != first[1] and [store.revision(s) for s in range(2)] == first  # reading changes nothing
    assert store.add(one_hot_map([0, 1, 2, 3], sem=[1, 0, 0.001])) == 0  # a near-duplicate rewrites slot 0
    assert store.revision(0) not in first and store.revision(1) == first[1]
    seen = {*first, store.revision(0)}
    store.reconfigure(capacity=16)  # every map rewritten into new arrays
    assert not {store.revision(0), store.revision(1)} & seen
    seen |= {store.revision(0), store.revision(1)}
    store.clear()
    store.add(one_hot_map([0, 1, 2, 3]))
    assert store.revision(0) not in seen
    with pytest.raises(IndexError):
        store.revision(1)


def test_chain_is_the_successor_walk_with_each_slots_revision():
    store = MapStore(SHAPE, capacity=8, prefetch_distance=1)
    prev = -1
    for experts in ([0, 1, 2, 3], [4, 5, 6, 7], [1, 2, 3, 4]):
        prev = store.add(one_hot_map(experts), after=prev)
    store.add(one_hot_map([7, 6, 5, 4]))  # a new request: not linked to slot 2
    rev = [store.revision(s) for s in range(4)]
    assert store.chain(0, 10) == [(0, rev[0]), (1, rev[1]), (2, rev[2])]
    assert store.chain(0, 2) == [(0, rev[0]), (1, rev[1])]
    assert store.chain(2, 5) == [(2, rev[2])] and store.chain(-1, 5) == store.chain(4, 5) == []  # 4: not stored
