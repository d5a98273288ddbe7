"""fMoE policy: hand-computed δ sets, priorities, the semantic → trajectory switch, eviction order (predicted
next-use time along the successor chain), map feeding."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from fmoe_local.config import RuntimeConfig
from fmoe_local.maps import ExpertMap, MapStore
from fmoe_local.policies._common import prefetch_set
from fmoe_local.policies.base import ModelShape
from fmoe_local.policies.fmoe import FMoEPolicy
from tests.threads import run_in_threads

SHAPE = ModelShape(num_layers=4, num_experts=8, top_k=2, embed_dim=3)


def row(*values: float) -> np.ndarray:
    r = np.zeros(8, np.float32)
    r[: len(values)] = values
    return r


def perm(r: np.ndarray, order: list[int]) -> np.ndarray:
    """Row r with its first len(order) entries moved to experts `order`."""
    out = np.zeros(8, np.float32)
    out[order] = r[: len(order)]
    return out


# Map A: layer l's mass sits on experts (2l, 2l+1, ...); Map B: on the reverse experts.
P = row(0.6, 0.3, 0.1)
MAP_A = np.stack([perm(P, [0, 1, 2]), perm(P, [2, 3, 4]), perm(P, [4, 5, 6]), perm(P, [6, 7, 0])])
MAP_B = np.stack([perm(P, [7, 6, 5]), perm(P, [5, 4, 3]), perm(P, [3, 2, 1]), perm(P, [1, 0, 7])])


def make(d: int = 2, shape: ModelShape = SHAPE, maps: list[ExpertMap] | None = None) -> FMoEPolicy:
    store = MapStore(shape, capacity=16, prefetch_distance=d)
    for m in maps or []:
        store.add(m)
    policy = FMoEPolicy(shape, RuntimeConfig(prefetch_distance=d), store)
    policy.begin_request(1)
    return policy


def as_tuples(prefetches) -> list[tuple[int, int, float]]:
    return [(p.layer, p.expert, pytest.approx(p.priority)) for p in prefetches]


@pytest.mark.parametrize(
    ("delta", "expected"),
    [(0.1, [0, 1]), (0.7, [0, 1]), (0.8, [0, 1, 2]), (0.95, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3, 4])],
)
def test_prefetch_set_is_fewest_reaching_delta_and_at_least_k(delta, expected):
    probs = np.array([0.5, 0.2, 0.15, 0.1, 0.05, 0, 0, 0], np.float32)
    assert prefetch_set(probs, delta, k=2).tolist() == expected


def test_prefetch_set_takes_all_nonzero_when_mass_is_short_and_respects_k():
    probs = np.array([0, 0.3, 0, 0.2, 0, 0, 0, 0], np.float32)  # top-k-only map summing to 0.5
    assert prefetch_set(probs, 0.9, k=1).tolist() == [1, 3]
    assert prefetch_set(probs, 0.0, k=4).tolist() == [1, 3, 0, 2]  # ≥ K even when the rest is zero


def test_semantic_match_prefetches_first_d_layers_with_delta_and_priority():
    policy = make(d=2, maps=[ExpertMap(MAP_A, np.array([1, 0, 0], np.float32), 0)])
    # cos([1,1,0], [1,0,0]) = 0.7071 → δ = 0.2929: the top expert (0.6) alone reaches it, but K = 2.
    out = policy.begin_iteration(np.array([1, 1, 0], np.float32))
    # Priority layer + 0.5·p/(l − l_now) with l_now = −1: layer 0 divides by 1, layer 1 by 2.
    assert as_tuples(out) == [(0, 0, 0.3), (0, 1, 0.15), (1, 2, 1.15), (1, 3, 1.075)]
    # A weak match (cos 0) → δ = 1 → every expert with mass.
    out = policy.begin_iteration(np.array([0, 0, 1], np.float32))
    assert [(p.layer, p.expert) for p in out] == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 3), (1, 4)]


def test_switch_from_semantic_to_trajectory_at_layer_d():
    sem_a = np.array([1, 0, 0], np.float32)
    policy = make(d=2, maps=[ExpertMap(MAP_A, sem_a, 0), ExpertMap(MAP_B, np.array([0, 1, 0], np.float32), 0)])
    first = policy.begin_iteration(sem_a)  # semantic picks A for layers 0 and 1 only
    assert {p.layer for p in first} == {0, 1}
    assert {p.expert for p in first if p.layer == 0} == {0, 1}
    # The routing follows B: the trajectory (layer 0 = B's) predicts layer 2 = 0 + d from B, priority 2 + 0.5·p/d.
    out = policy.observe_layer(0, MAP_B[0])
    assert as_tuples(out) == [(2, 3, 2.15), (2, 2, 2.075)]
    out = policy.observe_layer(1, MAP_B[1])
    assert [(p.layer, p.expert) for p in out] == [(3, 1), (3, 0)]
    assert policy.observe_layer(2, MAP_B[2]) == []  # layer 4 does not exist
    assert policy.observe_layer(3, MAP_B[3]) == []


def test_trajectory_score_sets_delta():
    shape = ModelShape(num_layers=4, num_experts=8, top_k=1, embed_dim=3)  # K = 1 so δ alone sizes the sets
    policy = make(d=1, shape=shape, maps=[ExpertMap(MAP_A, None, 0)])
    policy.begin_iteration(None)
    # Layer 0 = 0.6/0.3/0.1 on experts 0/2/4 against A's 0/1/2: cos = (0.36 + 0.03) / 0.46 = 0.848 → δ = 0.152.
    out = policy.observe_layer(0, perm(P, [0, 2, 4]))
    assert as_tuples(out) == [(1, 2, 1.3)]  # 0.6 ≥ δ: one expert, priority 1 + 0.5·p/(1 − 0)
    # Add a unit vector on expert 7 (A has nothing there): cos = 0.39 / sqrt(1.46 · 0.92) = 0.337 → δ = 0.663.
    out = policy.observe_layer(1, row(0, 0, 0, 0, 0, 0, 0, 1.0))
    assert as_tuples(out) == [(2, 4, 2.3), (2, 5, 2.15)]  # 0.6 < δ ≤ 0.9: two experts


def eviction_order(policy: FMoEPolicy, candidates: list[tuple[int, int]], current_layer: int) -> list:
    """Victims one at a time until none is left (the Policy contract: equal to asking for all at once)."""
    candidates, order = list(candidates), []
    while candidates:
        victim = policy.choose_victims(candidates, current_layer=current_layer)[0]
        order.append(victim)
        candidates.remove(victim)
    assert policy.choose_victims(order[::-1], current_layer, count=len(order)) == order
    return order


def test_eviction_key_is_the_predicted_next_use_time():
    policy = make(d=1)  # L = 4, K = 2, empty store: no successor chain, the use rate covers every later run
    policy.begin_iteration(None)
    policy.record_access(0, [0, 2], [False, False])
    policy.begin_iteration(None)
    policy.observe_layer(0, row(0.6, 0.3, 0.1))
    policy.record_access(0, [0, 1], [False, False])
    policy.record_access(0, [0], [True])  # a second chunk of the same run: freq grows, runs do not
    # Layer 0 ran (current_layer 0): its next run is L + 0 = 4 steps on. Predicted there (top-K of the observed
    # row: experts 0, 1) → 4. Otherwise the expected wait at the use rate (runs + 2)/(freq + 1) runs, 2 runs so
    # far: (0,2) used once → 4 + 4·(4/2) = 12; (0,5) never → 4 + 4·(4/1) = 20. Layers 2 and 3 are still to run
    # (2 and 3 steps on) and, knowing nothing yet (uniform p), predicted: 2 and 3.
    order = eviction_order(policy, [(0, 0), (0, 1), (0, 2), (0, 5), (2, 1), (3, 0)], current_layer=0)
    assert order == [(0, 5), (0, 2), (0, 0), (0, 1), (3, 0), (2, 1)]


def chain_maps() -> list[np.ndarray]:
    """Four maps whose every layer uses experts (2i, 2i+1) with probabilities 0.6, 0.4 in map i."""
    return [np.tile(perm(row(0.6, 0.4), [2 * i, 2 * i + 1]), (4, 1)) for i in range(4)]


def test_eviction_looks_ahead_along_the_successor_chain():
    policy = make(d=1)
    for m in chain_maps():  # request 1 stores maps 0, 1, 2, 3, linked 0 → 1 → 2 → 3
        policy.begin_iteration(None)
        for layer in range(4):
            policy.observe_layer(layer, m[layer])
        policy.end_iteration()
    policy.begin_request(2)
    policy.begin_iteration(None)
    policy.observe_layer(0, chain_maps()[0][0])  # matches map 0: the chain is maps 0, 1, 2, 3
    # Layer 0 ran: next run (step 4) is map 1's, then map 2's (8), map 3's (12); expert 0 (map 0 only) is
    # predicted by none of them: past the chain's 2 later runs, the wait at the use rate (0 + 2)/(0 + 1) = 2
    # → 4 + 4·(2 + 2) = 20.
    assert eviction_order(policy, [(0, 2), (0, 4), (0, 6), (0, 0)], current_layer=0) == [(0, 0), (0, 6), (0, 4), (0, 2)]
    # Layer 2 is still to run: this iteration (map 0, step 2), then maps 1, 2, 3 at 6, 10, 14.
    assert eviction_order(policy, [(2, 0), (2, 2), (2, 4), (2, 6)], current_layer=0) == [(2, 6), (2, 4), (2, 2), (2, 0)]
    # Across layers: (2, 2) is next used at step 6, after (0, 2) at step 4, so it goes first.
    assert policy.choose_victims([(0, 2), (2, 2)], current_layer=0) == [(2, 2)]
    # The next iteration moves along the chain: layer 2's next run is now map 1's, then maps 2, 3.
    for layer in range(1, 4):
        policy.observe_layer(layer, chain_maps()[0][layer])
    policy.end_iteration()
    policy.begin_iteration(None)
    assert eviction_order(policy, [(2, 2), (2, 4), (2, 6)], current_layer=-1) == [(2, 6), (2, 4), (2, 2)]


def test_a_few_expert_model_reads_the_chain_only_as_far_as_its_horizon():
    # 4 experts, top-2: the chain is read ⌈1.5 · 4 / 2⌉ = 3 runs ahead (successor_chain.py). Request 1 stores six
    # linked maps whose layer 0 uses experts {0, 1}, except map 4's: {1, 2} (layer 1 differs in each, so none is a
    # near-duplicate of another); expert 3 is in no map but runs every time. Expert 2 is predicted only 4 maps down
    # the chain, past the horizon: it counts as unpredicted, and the rarer of the two unpredicted experts (2, never
    # used) goes first. Read 16 runs ahead, map 4 would still vouch for expert 2 and expert 3 would go first.
    shape = ModelShape(num_layers=2, num_experts=4, top_k=2, embed_dim=3)
    policy = make(d=1, shape=shape)
    first_two = np.array([0.6, 0.4, 0, 0], np.float32)
    layer0 = [first_two] * 4 + [np.array([0, 0.6, 0.4, 0], np.float32), first_two]
    layer1 = [np.roll(np.array([0.9, 0.1, 0, 0], np.float32), i) for i in range(6)]
    for rows in zip(layer0, layer1, strict=True):
        policy.begin_iteration(None)
        for layer in range(2):
            policy.observe_layer(layer, rows[layer])
            policy.record_access(layer, [3], [False])
        policy.end_iteration()
    policy.begin_request(2)
    policy.begin_iteration(None)
    policy.observe_layer(0, first_two)  # matches map 0, the first of its equals at layer 0: the chain is maps 0–3
    assert eviction_order(policy, [(0, 3), (0, 2)], current_layer=0) == [(0, 2), (0, 3)]


def test_prefetched_but_unused_experts_are_ranked_by_next_use_like_any_other():
    sem = np.array([1, 0, 0], np.float32)
    policy = make(d=1, maps=[ExpertMap(MAP_A, sem, 0)])
    policy.begin_iteration(sem)  # prefetches layer 0: experts 0, 1
    candidates = [(0, 1), (3, 5)]
    # Before layer 0 runs, (0,1) is predicted for it (step 0); (3,5), knowing nothing of layer 3, at step 3.
    assert policy.choose_victims(candidates, current_layer=-1)[0] == (3, 5)
    policy.observe_layer(0, row(0.5, 0.3, 0.2))  # matches A: layer 3 = experts 6, 7, so (3,5) → 3 + 4·2 = 11
    policy.record_access(0, [0, 2], [True, False])  # expert 1 was prefetched and not used
    # No mis-prefetched-first rule (the paper's): layer 0's observed top-K still holds expert 1, next run → 4 < 11.
    assert policy.choose_victims(candidates, current_layer=0)[0] == (3, 5)
    # Once nothing predicts it any more, it waits at its use rate: layer 0 ran once, expert 1 never used
    # → 4 + 4·(1 + 2)/(0 + 1) = 16 > 11.
    policy.observe_layer(0, row(0.5, 0.0, 0.5))
    assert policy.choose_victims(candidates, current_layer=0)[0] == (0, 1)


def test_end_iteration_feeds_complete_maps_only_and_end_request_drops_trajectory():
    policy = make(d=1)
    sem = np.array([0, 0, 1], np.float32)
    policy.begin_iteration(sem)
    for layer in range(4):
        policy.observe_layer(layer, MAP_A[layer])
    policy.end_iteration()
    assert len(policy.store) == 1
    stored = policy.store.get(0)
    np.testing.assert_array_equal(stored.probs, MAP_A)
    np.testing.assert_array_equal(stored.semantic, sem)
    assert stored.request_id == 1
    policy.begin_iteration(sem)
    policy.observe_layer(0, MAP_B[0])
    policy.end_request()
    policy.end_iteration()  # nothing left of the stopped iteration
    policy.begin_iteration(sem)
    policy.observe_layer(0, MAP_B[0])
    policy.end_iteration()  # incomplete
    assert len(policy.store) == 1


def test_without_store_or_semantic_falls_back_to_last_observed_top_k():
    shape = ModelShape(num_layers=4, num_experts=8, top_k=2, embed_dim=0)
    policy = make(d=2, shape=shape)
    assert policy.begin_iteration(None) == []  # nothing seen yet: misses load on demand
    assert policy.observe_layer(0, MAP_A[0]) == []  # empty store, layer 2 never seen
    for layer in range(1, 4):
        policy.observe_layer(layer, MAP_A[layer])
    # No semantic embedding: the previous iteration's routing of layers 0, 1, top-K, priority l + 0.5·p/(l+1).
    out = policy.begin_iteration(None)
    assert as_tuples(out) == [(0, 0, 0.3), (0, 1, 0.15), (1, 2, 1.15), (1, 3, 1.075)]


def test_reconfigure_changes_distance_and_store_capacity():
    policy = make(d=1, maps=[ExpertMap(MAP_A, None, 0)])
    policy.reconfigure(prefetch_distance=3, store_capacity=4)
    assert policy.store.prefetch_distance == 3 and policy.store.capacity == 4
    policy.begin_iteration(None)
    assert {p.layer for p in policy.observe_layer(0, MAP_A[0])} == {3}
    with pytest.raises(ValueError):
        policy.reconfigure(prefetch_distance=0)


def test_matcher_and_forward_threads_together():
    policy = make(d=1, maps=[ExpertMap(MAP_A, np.array([1, 0, 0], np.float32), 0)])
    rng = np.random.default_rng(0)
    done = threading.Event()

    def matcher() -> None:
        try:
            for _ in range(50):
                policy.begin_iteration(rng.standard_normal(3).astype(np.float32))
                for layer in range(4):
                    policy.observe_layer(layer, rng.dirichlet(np.ones(8)).astype(np.float32))
                policy.end_iteration()
        finally:
            done.set()

    def forward() -> None:
        while not done.is_set():
            for layer in range(4):
                policy.record_access(layer, [layer, 7 - layer], [True, False])
                victim = policy.choose_victims([(0, 0), (1, 1), (2, 5), (3, 3)], current_layer=layer)[0]
                assert victim in [(0, 0), (1, 1), (2, 5), (3, 3)]

    assert run_in_threads(matcher, forward) == []
    assert 1 <= len(policy.store) <= 16


def test_frequency_counts_carry_across_requests():
    policy = make(d=1)
    for _ in range(3):
        policy.record_access(0, [0], [True])  # one run of layer 0, expert 0 three times (chunks)
    policy.end_request()
    policy.begin_request(2)
    policy.begin_iteration(None)
    policy.observe_layer(0, row(0, 0, 0.5, 0.5))  # predicts experts 2, 3: neither candidate
    # Waits (runs + 2)/(freq + 1) at least 1: (0,0) used 3 times in the previous request → 1, (0,1) → 3.
    assert policy.choose_victims([(0, 0), (0, 1)], current_layer=0)[0] == (0, 1)


def test_prefetch_priority_puts_the_farther_target_layer_first():
    policy = make(d=2, maps=[ExpertMap(MAP_A, np.array([1, 0, 0], np.float32), 0)])
    out = policy.begin_iteration(np.array([1, 0, 0], np.float32))
    # Layer 1's weakest pick (p = 0.3) outranks layer 0's strongest (p = 0.6): a copy for the nearer layer is the
    # one that lands late when the link is the bottleneck. Within a layer, larger p first.
    ranked = [(p.layer, p.expert) for p in sorted(out, key=lambda p: -p.priority)]
    assert ranked == [(1, 2), (1, 3), (0, 0), (0, 1)]


def test_eviction_ranks_every_remaining_layer_by_the_current_match():
    policy = make(d=1, maps=[ExpertMap(MAP_A, None, 0), ExpertMap(MAP_B, None, 0)])
    policy.begin_iteration(None)
    # Nothing predicted for layer 3 yet: uniform p, every expert in its top-K → the tie goes to the smaller key.
    assert policy.choose_victims([(3, 0), (3, 6)], current_layer=0)[0] == (3, 0)
    policy.observe_layer(0, MAP_A[0])  # matches A, which predicts layer 1 (the prefetch target) and 2, 3 too
    # A's layer 3: top-K experts 6, 7 (expert 0's 0.1 is third) → (3,0) goes; layer 2: 4 and 5, not 3.
    assert policy.choose_victims([(3, 6), (3, 0)], current_layer=0)[0] == (3, 0)
    assert policy.choose_victims([(2, 3), (2, 4)], current_layer=0)[0] == (2, 3)


def test_successor_link_predicts_the_next_iteration():
    sem = np.array([1, 0, 0], np.float32)
    policy = make(d=2)
    # Request 1 routes A, then B: the store holds A (slot 0) and B (slot 1), linked 0 → 1.
    for expert_map in (MAP_A, MAP_B):
        policy.begin_iteration(sem)
        for layer in range(4):
            policy.observe_layer(layer, expert_map[layer])
        policy.end_iteration()
    assert len(policy.store) == 2
    # Request 2 routes A again. After layer 0 the match is A, whose successor is B: layer 0's next use (the next
    # iteration) is predicted by B's layer 0 (expert 7: 0.6, expert 0: nothing), not by what layer 0 just used.
    policy.begin_request(2)
    policy.begin_iteration(sem)
    policy.observe_layer(0, MAP_A[0])
    assert policy.choose_victims([(0, 0), (0, 7)], current_layer=0)[0] == (0, 0)
    for layer in range(1, 4):
        policy.observe_layer(layer, MAP_A[layer])
    policy.end_iteration()
    # The next iteration's first d layers come from B (the successor of the all-layer match, score 1 → δ = 0,
    # top-K), although the semantic embedding matches A's.
    out = policy.begin_iteration(sem)
    assert as_tuples(out) == [(0, 7, 0.3), (0, 6, 0.15), (1, 5, 1.15), (1, 4, 1.075)]
    # A stopped iteration leaves no link to follow: the semantic match (A) predicts again.
    policy.observe_layer(0, MAP_A[0])
    policy.end_iteration()
    out = policy.begin_iteration(sem)
    assert {(p.layer, p.expert) for p in out} == {(0, 0), (0, 1), (1, 2), (1, 3)}


def test_layer_runs_are_counted_on_the_forward_thread_whatever_the_prefetcher_lag():
    # The forward thread reports layers in order; the prefetcher thread starts each iteration late by a varying
    # number of layers. Every pass must count one run of every layer (the use rate's denominator), and a layer
    # reported in consecutive prefill chunks only one.
    policy = make(d=1)
    lags = [0, 3, 1, 4, 2, 0, 4]
    for i, lag in enumerate(lags):
        for layer in range(SHAPE.num_layers):
            if layer == min(lag, SHAPE.num_layers - 1):
                policy.begin_iteration(None)  # arrives after `lag` layers of this pass were already reported
            chunks = 2 if i == 0 else 1  # the first pass is a chunked prefill
            for _ in range(chunks):
                policy.record_access(layer, [layer], [False])
    np.testing.assert_array_equal(policy._runs, np.full(SHAPE.num_layers, len(lags)))


def test_recent_routing_outweighs_a_map_once_it_has_predicted_better():
    # The store holds only map A while the request routes like B, iteration after iteration, and learns nothing
    # (no end_iteration): A's rows keep predicting wrong, B's last routing right (blend.py, MixChoice).
    policy = make(d=1, maps=[ExpertMap(MAP_A, None, 0)])
    policy.begin_iteration(None)
    first = policy.observe_layer(1, MAP_B[1])  # layer 1 has no last routing yet: A predicts layer 2 alone
    assert first[0].expert == 4 and first[0].priority == max(p.priority for p in first)  # A's top at layer 2
    for layer in (0, 2, 3):
        policy.observe_layer(layer, MAP_B[layer])
    policy.begin_iteration(None)
    policy.observe_layer(0, MAP_B[0])
    # At layer 1 A had predicted {2, 3} and the layer ran B's {5, 4}, as last time: recency is ahead, so layer 2's
    # plan mixes mostly B's last routing.
    out = policy.observe_layer(1, MAP_B[1])
    best = max(out, key=lambda p: p.priority)
    assert (best.layer, best.expert) == (2, 3)  # B's top expert of layer 2, not A's 4


def test_a_slot_rewritten_since_the_policy_last_read_it_is_read_again():
    # The policy keeps each slot's map between chain rebuilds (a rebuild per change of match); a rewrite of the slot
    # (here the store cleared and refilled with another map) must reach its predictions.
    policy = make(d=1, maps=[ExpertMap(MAP_A, None, 0)])
    policy.begin_iteration(None)
    assert {p.expert for p in policy.observe_layer(0, MAP_A[0])} == {2, 3}  # slot 0 = A: layer 1 on experts 2, 3
    policy.end_iteration()  # one layer observed: nothing stored
    policy.store.clear()
    policy.store.add(ExpertMap(MAP_B, None, 0))  # slot 0 = B now
    policy.begin_iteration(None)
    assert {p.expert for p in policy.observe_layer(0, MAP_B[0])} == {5, 4}  # B's layer 1


class _Recomputing(FMoEPolicy):
    """The policy with every layer's eviction estimate computed from scratch (no reuse of the previous layer's)."""

    def _estimate_next_use(self, layer, matched, successor):
        with self._lock:
            self._estimated = None
        super()._estimate_next_use(layer, matched, successor)


def test_reusing_the_previous_layers_estimate_decides_as_recomputing_it():
    # Random routing over several linked requests, the mix weight moving as layers are scored: after every layer
    # the prefetches and the whole eviction order are those of a policy that re-estimates every row.
    shape = ModelShape(num_layers=6, num_experts=16, top_k=2, embed_dim=3)
    rng = np.random.default_rng(7)
    a, b = (
        cls(shape, RuntimeConfig(prefetch_distance=2), MapStore(shape, 64, 2)) for cls in (FMoEPolicy, _Recomputing)
    )
    every = [(layer, e) for layer in range(6) for e in range(16)]
    base = rng.dirichlet(np.full(16, 0.3), size=6).astype(np.float32)
    for request in range(4):
        for policy in (a, b):
            policy.begin_request(request)
        for _ in range(5):
            sem = rng.standard_normal(3).astype(np.float32)
            assert a.begin_iteration(sem) == b.begin_iteration(sem)
            for layer in range(6):
                noisy = base[layer] + rng.dirichlet(np.full(16, 0.3)).astype(np.float32) * rng.uniform(0, 2)
                p = (noisy / noisy.sum()).astype(np.float32)
                assert list(a.observe_layer(layer, p)) == list(b.observe_layer(layer, p))
                used = np.argsort(-p)[:2].tolist()
                for policy in (a, b):
                    policy.record_access(layer, used, [False, False])
                assert a.choose_victims(every, layer, count=len(every)) == b.choose_victims(
                    every, layer, count=len(every)
                )
            for policy in (a, b):
                policy.end_iteration()
    assert a._mix.weight == b._mix.weight


def test_a_store_cleared_between_iterations_leaves_no_successor_to_follow():
    # The previous iteration's final match is slot 1 (map B), which the cleared store no longer holds: the next
    # iteration predicts as without a match, from each layer's last routing, and raises nothing.
    policy = make(d=1, maps=[ExpertMap(MAP_A, None, 0), ExpertMap(MAP_B, None, 0)])
    policy.begin_iteration(None)
    for layer in range(4):
        policy.observe_layer(layer, MAP_B[layer])
    policy.store.clear()
    policy.end_iteration()  # this iteration's map goes to slot 0: one map stored
    assert len(policy.store) == 1
    assert {p.expert for p in policy.begin_iteration(None)} == {7, 6}  # layer 0's last routing, top-2
