"""Expert maps in SQLite: fingerprints keep models apart, load/put/replace/clear, put never waits for disk, and
successor links survive a restart."""

from __future__ import annotations

import shutil
import sqlite3
import threading

import numpy as np
import pytest

from fmoe_local.config import RuntimeConfig
from fmoe_local.maps import ExpertMap, MapPersistence, MapStore
from fmoe_local.policies.base import ModelShape
from fmoe_local.policies.fmoe import FMoEPolicy
from store import open_store
from store.maps import SqliteMapPersistence, model_fingerprint

SHAPE = ModelShape(num_layers=4, num_experts=8, top_k=2, embed_dim=16)


def fake_model(
    root, config: str = '{"model_type": "mixtral", "num_local_experts": 8}', weights=(("model.safetensors", 100),)
):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(config)
    for name, size in weights:
        (root / name).write_bytes(b"\0" * size)
    return root


def random_map(
    rng: np.random.Generator, request_id: int, shape: ModelShape = SHAPE, semantic: bool = True
) -> ExpertMap:
    logits = rng.normal(size=(shape.num_layers, shape.num_experts))
    probs = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(np.float32)
    sem = rng.normal(size=shape.embed_dim).astype(np.float32) if semantic else None
    return ExpertMap(probs=probs, semantic=sem, request_id=request_id)


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "data")
    yield s
    s.close()


def assert_same_map(loaded: ExpertMap, original: ExpertMap) -> None:
    assert loaded.request_id == original.request_id
    assert loaded.probs.dtype == np.float32 and loaded.probs.shape == original.probs.shape
    # float16 on disk: ~3 significant digits
    np.testing.assert_allclose(loaded.probs, original.probs, rtol=1e-3, atol=1e-4)
    if original.semantic is None:
        assert loaded.semantic is None
    else:
        np.testing.assert_allclose(loaded.semantic, original.semantic, rtol=1e-3, atol=1e-3)


def test_fingerprint_follows_config_and_weights_not_location(tmp_path):
    a = fake_model(tmp_path / "a")
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(a, copy)
    assert model_fingerprint(a) == model_fingerprint(copy)
    other_config = fake_model(tmp_path / "b", config='{"model_type": "mixtral", "num_local_experts": 4}')
    other_weights = fake_model(tmp_path / "c", weights=(("model.safetensors", 101),))
    sharded = fake_model(
        tmp_path / "d", weights=(("model-00001-of-00002.safetensors", 50), ("model-00002-of-00002.safetensors", 50))
    )
    prints = {model_fingerprint(p) for p in (a, other_config, other_weights, sharded)}
    assert len(prints) == 4
    # Files that do not change routing (tokenizer, README) do not change the fingerprint.
    (a / "README.md").write_text("notes")
    assert model_fingerprint(a) == model_fingerprint(copy)


def test_fingerprint_of_a_folder_without_config_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        model_fingerprint(tmp_path)


def test_put_load_round_trip_with_and_without_semantic(store, tmp_path):
    rng = np.random.default_rng(0)
    p = store.map_persistence(fake_model(tmp_path / "m"), SHAPE)
    maps = {slot: random_map(rng, request_id=slot // 2, semantic=slot % 3 != 0) for slot in range(10)}
    for slot, m in maps.items():
        p.put(slot, m)
    loaded = p.load()
    assert [(slot, link) for slot, _, link in loaded] == [(s, -1) for s in range(10)]
    for slot, m, _ in loaded:
        assert_same_map(m, maps[slot])
    assert p.count() == 10


def test_replaced_slot_is_replaced_on_disk_and_survives_reopen(tmp_path):
    rng = np.random.default_rng(1)
    model = fake_model(tmp_path / "m")
    first, second, third = (random_map(rng, i) for i in range(3))
    with open_store(tmp_path / "data") as s:
        p = s.map_persistence(model, SHAPE)
        p.put(0, first)
        p.put(1, second)
        p.flush()
        p.put(0, third)  # MapStore evicted the redundant map of slot 0
    with open_store(tmp_path / "data") as s:
        loaded = {slot: m for slot, m, _ in s.map_persistence(model, SHAPE).load()}
    assert sorted(loaded) == [0, 1]
    assert_same_map(loaded[0], third)
    assert_same_map(loaded[1], second)


def test_maps_of_one_model_are_never_served_to_another(store, tmp_path):
    rng = np.random.default_rng(2)
    a = store.map_persistence(fake_model(tmp_path / "a"), SHAPE)
    b_dir = fake_model(tmp_path / "b", config='{"model_type": "mixtral", "num_local_experts": 8, "seed": 1}')
    b = store.map_persistence(b_dir, SHAPE)
    a.put(0, random_map(rng, 1))
    a.put(1, random_map(rng, 2))
    b.put(0, random_map(rng, 3))
    assert [m.request_id for _, m, _ in a.load()] == [1, 2]
    assert [m.request_id for _, m, _ in b.load()] == [3]
    a.clear()
    assert a.load() == []
    assert [m.request_id for _, m, _ in b.load()] == [3]
    assert {row["maps"] for row in store.models_with_maps()} == {0, 1}


def test_clear_keeps_order_with_puts_around_it(store, tmp_path):
    rng = np.random.default_rng(3)
    p = store.map_persistence(fake_model(tmp_path / "m"), SHAPE)
    for slot in range(5):
        p.put(slot, random_map(rng, slot))
    p.clear()  # must also drop the puts still queued before it
    p.put(7, random_map(rng, 70))
    assert [(slot, m.request_id) for slot, m, _ in p.load()] == [(7, 70)]


def test_a_model_with_a_new_shape_does_not_decode_old_blobs(store, tmp_path):
    rng = np.random.default_rng(4)
    model = fake_model(tmp_path / "m")
    p = store.map_persistence(model, SHAPE)
    p.put(0, random_map(rng, 0))
    p.close()
    wider = ModelShape(num_layers=4, num_experts=8, top_k=2, embed_dim=32)
    assert store.map_persistence(model, wider).load() == []


def test_put_never_waits_for_the_disk(store, tmp_path):
    """Another connection holds the write lock; puts still return at once and land once it lets go."""
    rng = np.random.default_rng(5)
    p = store.map_persistence(fake_model(tmp_path / "m"), SHAPE)
    blocker = sqlite3.connect(store.path, timeout=0)
    blocker.execute("BEGIN IMMEDIATE")  # the writer thread's commits now wait on the busy timeout
    maps = [random_map(rng, i) for i in range(300)]
    done = threading.Event()

    def producer() -> None:
        for slot, m in enumerate(maps):
            p.put(slot, m)
        done.set()

    threading.Thread(target=producer, daemon=True).start()
    assert done.wait(timeout=30), "put() blocked while the database was locked"
    status = p.status()
    assert status.pending > 0 and status.written == 0
    blocker.rollback()
    blocker.close()
    assert p.flush(timeout=60)
    assert p.status().pending == 0 and p.status().failed == 0
    assert len(p.load()) == 300


def test_close_drains_the_queue_and_refuses_later_puts(tmp_path):
    rng = np.random.default_rng(6)
    model = fake_model(tmp_path / "m")
    with open_store(tmp_path / "data") as s:
        p = s.map_persistence(model, SHAPE)
        for slot in range(50):
            p.put(slot, random_map(rng, slot))
        p.close()
        assert p.count() == 50
        with pytest.raises(RuntimeError, match="closed"):
            p.put(0, random_map(rng, 0))
        p.close()  # twice is fine


def test_writer_batches_commits(store, tmp_path):
    rng = np.random.default_rng(7)
    p = SqliteMapPersistence(store.db, model_fingerprint(fake_model(tmp_path / "m")), SHAPE, linger_s=5.0)
    assert isinstance(p, MapPersistence)  # every member the map store calls, put_link and replace_all included
    maps = [random_map(rng, i) for i in range(200)]
    for slot, m in enumerate(maps):
        p.put(slot, m)
    assert p.flush(timeout=30)
    status = p.status()
    assert status.written == 200
    assert status.batches < 10  # 200 puts, a handful of transactions
    p.close()


def test_runtime_map_store_comes_back_from_disk_with_capacity_replacements(tmp_path):
    """The runtime's MapStore over this persistence: a full store replaces slots, and the disk follows."""
    from fmoe_local.maps import MapStore

    rng = np.random.default_rng(8)
    model = fake_model(tmp_path / "m")
    with open_store(tmp_path / "data") as s:
        live = MapStore(SHAPE, capacity=6, prefetch_distance=1, persistence=s.map_persistence(model, SHAPE))
        for i in range(20):  # more than the capacity: later maps replace the most redundant ones
            live.add(random_map(rng, i))
        expected = {slot: live.get(slot) for slot in range(len(live))}
        assert max(m.request_id for m in expected.values()) >= 6  # replacements happened
    with open_store(tmp_path / "data") as s:
        restored = MapStore(SHAPE, capacity=6, prefetch_distance=1)
        assert restored.load_from(s.map_persistence(model, SHAPE)) == 6
        for slot, m in expected.items():
            assert_same_map(restored.get(slot), m)


def test_a_failing_disk_write_is_counted_and_the_writer_keeps_going(store, tmp_path):
    rng = np.random.default_rng(9)
    p = store.map_persistence(fake_model(tmp_path / "m"), SHAPE)
    with store.db.lock:
        store.db.db.execute("ALTER TABLE maps RENAME TO maps_gone")  # every insert now fails
    for slot in range(3):
        p.put(slot, random_map(rng, slot))
    assert p.flush(timeout=30)  # returns: failed writes are done writes
    status = p.status()
    assert (status.failed, status.written, status.pending) == (3, 0, 0)
    assert "no such table" in status.last_error
    with store.db.lock:
        store.db.db.execute("ALTER TABLE maps_gone RENAME TO maps")
    p.put(0, random_map(rng, 42))
    assert [(slot, m.request_id) for slot, m, _ in p.load()] == [(0, 42)]


def test_links_round_trip_and_a_replaced_map_keeps_its_link(tmp_path):
    rng = np.random.default_rng(7)
    model = fake_model(tmp_path / "m")
    maps = [random_map(rng, i) for i in range(4)]
    with open_store(tmp_path / "data") as s:
        p = s.map_persistence(model, SHAPE)
        for slot in range(3):
            p.put(slot, maps[slot])
        p.put_link(0, 1)
        p.put_link(1, 2)
        p.put_link(1, 0)  # a later link of the same slot wins, in one batch or across batches
        p.flush()
        p.put(0, maps[3])  # MapStore replaced slot 0: its link stays until a new one is recorded
    with open_store(tmp_path / "data") as s:
        p = s.map_persistence(model, SHAPE)
        loaded = p.load()
        assert [(slot, link) for slot, _, link in loaded] == [(0, 1), (1, 0), (2, -1)]
        assert_same_map(loaded[0][1], maps[3])
        p.put_link(2, 1)
        p.clear()  # drops the link queued before it; maps put after it start without links
        p.put(0, maps[0])
        assert [(slot, link) for slot, _, link in p.load()] == [(0, -1)]


def f16_exact(m: ExpertMap) -> ExpertMap:
    """The map as the disk returns it (float16 values), so a reloaded store holds exactly what was recorded."""
    sem = None if m.semantic is None else m.semantic.astype(np.float16).astype(np.float32)
    return ExpertMap(m.probs.astype(np.float16).astype(np.float32), sem, m.request_id)


def predictions(policy: FMoEPolicy, expert_maps: list[ExpertMap], request_id: int) -> list:
    """Feed one request; return everything the policy predicted: prefetches, and the eviction order after each layer."""
    every = [(layer, e) for layer in range(SHAPE.num_layers) for e in range(SHAPE.num_experts)]
    seen: list = []
    policy.begin_request(request_id)
    for m in expert_maps:
        seen.append([(p.layer, p.expert, p.priority) for p in policy.begin_iteration(m.semantic)])
        for layer in range(SHAPE.num_layers):
            seen.append([(p.layer, p.expert, p.priority) for p in policy.observe_layer(layer, m.probs[layer])])
            seen.append(policy.choose_victims(every, current_layer=layer, count=len(every)))
        policy.end_iteration()
    return seen


def test_a_policy_on_maps_reloaded_from_disk_predicts_from_successors_as_on_the_recording_store(tmp_path):
    config = RuntimeConfig(prefetch_distance=2, store_capacity=16)
    rng = np.random.default_rng(8)
    model = fake_model(tmp_path / "m")
    recorded = [[f16_exact(random_map(rng, r)) for _ in range(3)] for r in (1, 2)]  # two requests, 3 iterations
    with open_store(tmp_path / "data") as s:
        store = MapStore.for_config(SHAPE, config, s.map_persistence(model, SHAPE))
        recorder = FMoEPolicy(SHAPE, config, store)
        for r, expert_maps in enumerate(recorded):
            predictions(recorder, expert_maps, r)
        assert [store.successor(slot) for slot in range(6)] == [1, 2, -1, 4, 5, -1]
        # In-memory copies of the recording store (its persistence closes with the file), with and without links.
        linked, unlinked = MapStore.for_config(SHAPE, config), MapStore.for_config(SHAPE, config)
        for slot in range(6):
            linked.add(store.get(slot), after=slot - 1 if slot and store.successor(slot - 1) == slot else -1)
            unlinked.add(store.get(slot))  # what a restart used to give
        assert [linked.successor(slot) for slot in range(6)] == [1, 2, -1, 4, 5, -1]
    with open_store(tmp_path / "data") as s:  # restart
        reloaded = MapStore.for_config(SHAPE, config)
        assert reloaded.load_from(s.map_persistence(model, SHAPE)) == 6
        # A new request routed like request 1 (its own embeddings): predicted along the links a0 → a1 → a2.
        request = [ExpertMap(m.probs, f16_exact(random_map(rng, 3)).semantic, 3) for m in recorded[0]]
        after_restart = predictions(FMoEPolicy(SHAPE, config, reloaded), request, 3)
    expected = predictions(FMoEPolicy(SHAPE, config, linked), request, 3)
    assert after_restart == expected
    assert predictions(FMoEPolicy(SHAPE, config, unlinked), request, 3) != expected  # the links are what count
