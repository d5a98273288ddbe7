from collections.abc import Sequence

import numpy as np
import pytest

from fmoe_bench.presets import CostModel
from fmoe_bench.replay import build_schedule, capacity_for, replay
from fmoe_bench.replay_pool import replay_all
from fmoe_local.policies.base import ExpertKey, ModelShape, Policy, Prefetch
from fmoe_local.traces import DECODE, PREFILL, Trace


def make_trace(steps: list[list[list[int]]], seq_of: list[int], num_experts: int = 4, phases=None) -> Trace:
    """steps[i][l] = experts row i selects at layer l; one row per iteration unless phases say prefill."""
    ids = np.array(steps, np.int16)  # [T, L, K]
    t, lay, k = ids.shape
    probs = np.full(ids.shape, 1.0 / k, np.float32)
    phase = np.array(phases if phases is not None else [DECODE] * t, np.int8)
    # consecutive prefill rows of one request form one forward pass
    iter_ids, cur = [], -1
    for r in range(t):
        if r == 0 or phase[r] == DECODE or phase[r - 1] == DECODE or seq_of[r] != seq_of[r - 1]:
            cur += 1
        iter_ids.append(cur)
    return Trace(
        "synthetic", lay, num_experts, k, np.array(seq_of, np.int32), np.array(iter_ids, np.int32), phase, ids, probs
    )


class LRU(Policy):
    """Test-local policy: no prefetch, least recently accessed expert evicted (Policy's defaults for the extras)."""

    name = "test-lru"
    needs_lookahead = False

    def __init__(self) -> None:
        self.clock, self.last = 0, {}

    def begin_request(self, request_id: int) -> None: ...

    def begin_iteration(self, semantic):
        return []

    def observe_layer(self, layer, probs, lookahead=None):
        return []

    def record_access(self, layer: int, experts: Sequence[int], hits: Sequence[bool]) -> None:
        for e in experts:
            self.clock += 1
            self.last[(layer, e)] = self.clock

    def choose_victims(self, candidates: Sequence[ExpertKey], current_layer: int, count: int = 1) -> list[ExpertKey]:
        return sorted(candidates, key=lambda k: self.last.get(k, 0))[:count]

    def end_iteration(self) -> None: ...

    def end_request(self) -> None: ...


class Scripted(LRU):
    """Prefetches `plan[(iteration, layer)]` when `layer` is observed (begin_iteration: layer -1)."""

    def __init__(self, plan: dict[tuple[int, int], list[tuple[int, int]]]) -> None:
        super().__init__()
        self.plan, self.it = plan, -1

    def begin_iteration(self, semantic):
        self.it += 1
        return [Prefetch(layer, e, 1.0) for layer, e in self.plan.get((self.it, -1), [])]

    def observe_layer(self, layer, probs, lookahead=None):
        return [Prefetch(lay, e, 1.0) for lay, e in self.plan.get((self.it, layer), [])]


COST = CostModel(expert_bytes=100, bandwidth=1000.0, layer_time_s=0.01, token_flop_time_s=0.0)  # load = 0.1 s


def test_lru_hit_counts_by_hand() -> None:
    # L=2, K=1, two slots. it0: (0,0) (1,0) miss miss; it1: (0,0) hit, (1,1) miss evicts (1,0);
    # it2: (0,0) hit, (1,0) miss evicts (1,1).
    trace = make_trace([[[0], [0]], [[0], [1]], [[0], [0]]], [5, 5, 5])
    r = replay(build_schedule(trace), LRU(), capacity=2, cost=COST, mode="online")
    assert (r.hits, r.misses) == (2, 4)
    assert r.layer_hits == [2, 0] and r.layer_misses == [1, 3]
    assert r.stall_s == pytest.approx(0.4)
    assert r.tpot_s == pytest.approx((3 * 2 * 0.01 + 0.4) / 3)
    assert r.bytes_moved == 400 and r.prefetched == 0


def test_prefetch_lands_within_bandwidth() -> None:
    trace = make_trace([[[0], [2]], [[1], [3]]], [0, 0])
    plan = {(0, 0): [(1, 2)], (1, -1): [(0, 1)], (1, 0): [(1, 3), (1, 0)]}
    # one expert per window (1000 B/s × 0.1 s = 100 B)
    slow = CostModel(100, 1000.0, 0.1, 0.0)
    r = replay(build_schedule(trace), Scripted(plan), capacity=4, cost=slow, mode="online")
    # it0: (0,0) miss, (1,2) prefetched during layer 0 → hit; it1: (0,1) prefetched in the head window → hit,
    # (1,3) queued first (same priority, earlier) → hit; (1,0) never copied
    assert (r.hits, r.misses) == (3, 1)
    assert r.prefetched == 3 and r.prefetch_used == 3 and r.prefetch_wasted == 0
    assert r.stall_s == pytest.approx(0.1)


def test_half_arrived_prefetch_is_late_neither_hit_nor_miss_and_stalls_less() -> None:
    trace = make_trace([[[0], [2]]], [0])
    half = CostModel(100, 1000.0, 0.05, 0.0)  # 50 B per window: the prefetch is half done at layer 1
    seen = []

    class Spy(Scripted):
        def record_access(self, layer, experts, hits):
            seen.append(list(hits))

    r = replay(build_schedule(trace), Spy({(0, 0): [(1, 2)]}), capacity=4, cost=half, mode="online")
    assert (r.hits, r.misses, r.late) == (0, 1, 1) and r.prefetch_used == 1
    assert r.hit_rate == 0.0 and r.stalls == 2
    assert r.stall_s == pytest.approx(0.1 + 0.05)
    assert seen == [[False], [True]]  # the policy hears what the runtime's cache would say: it was there


def test_stale_and_wasted_prefetches() -> None:
    trace = make_trace([[[0], [1]], [[0], [1]]], [0, 1])
    # at layer 1 of it0, a prefetch for layer 0 is stale (already passed) and must not be copied;
    # the prefetch of (1,3) lands but is never used: wasted at request end
    plan = {(0, 1): [(0, 2)], (0, -1): [(1, 3)]}
    r = replay(build_schedule(trace), Scripted(plan), capacity=8, cost=COST, mode="online")
    assert r.prefetched == 1 and r.prefetch_wasted == 1
    assert (r.hits, r.misses) == (2, 2)


def test_offline_mode_measures_only_the_last_requests() -> None:
    # 4 requests of one iteration each: offline measures int(0.7*4)=2 → the last 2
    steps = [[[0], [0]], [[1], [1]], [[1], [1]], [[0], [0]]]
    trace = make_trace(steps, [0, 1, 2, 3])
    r = replay(build_schedule(trace), LRU(), capacity=4, cost=COST, mode="offline")
    assert r.requests_measured == 2 and r.iterations_measured == 2
    # The last warm-up request was served (its experts are resident), the first one only taught the policy.
    assert (r.hits, r.misses) == (2, 2)
    online = replay(build_schedule(trace), LRU(), capacity=4, cost=COST, mode="online")
    assert (online.hits, online.misses) == (4, 4)
    # Per measured request: online all four from the first, offline the last two (the third's experts were resident).
    assert (online.request_hits, online.request_accesses) == ([0, 0, 2, 2], [2, 2, 2, 2])
    assert (r.request_hits, r.request_accesses) == ([2, 0], [2, 2])


def test_prefill_needs_union_of_tokens_and_counts_no_tpot() -> None:
    steps = [[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[0, 1], [2, 3]]]
    trace = make_trace(steps, [0, 0, 0], phases=[PREFILL, PREFILL, DECODE])
    s = build_schedule(trace)
    assert s.needed[0] == [(0, 1, 2), (0, 2, 3)] and s.num_iterations == 2
    np.testing.assert_allclose(s.probs[0, 0], [0.25, 0.5, 0.25, 0.0])
    r = replay(s, LRU(), capacity=8, cost=COST, mode="online")
    assert (r.hits, r.misses) == (4, 6) and r.decode_tokens == 1
    assert r.tpot_s == pytest.approx(2 * 0.01)


def test_semantic_fallbacks_use_only_the_past() -> None:
    trace = make_trace([[[0], [1]], [[2], [3]], [[1], [1]], [[0], [0]]], [0, 0, 0, 1])
    prev = build_schedule(trace, fallback="prev_map")
    assert prev.semantics[0] is None and prev.semantics[3] is None  # first iteration of each request
    np.testing.assert_array_equal(prev.semantics[2], prev.probs[1].reshape(-1))
    mean = build_schedule(trace, fallback="request_map_mean")
    np.testing.assert_allclose(mean.semantics[2], prev.probs[:2].mean(0).reshape(-1))
    assert mean.shape.embed_dim == 2 * 4 and "request_map_mean" in mean.semantic_source
    assert build_schedule(trace, fallback="none").shape.embed_dim == 0


def test_embeddings_give_semantics() -> None:
    trace = make_trace([[[0], [1]], [[2], [3]], [[1], [1]]], [0, 0, 1])
    trace.embeddings = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]], np.float32)
    run = build_schedule(trace, semantic_mode="running_mean")
    np.testing.assert_allclose(run.semantics[1], [0.5, 0.5])
    np.testing.assert_allclose(run.semantics[2], [2.0, 2.0])
    tok = build_schedule(trace, semantic_mode="token")
    np.testing.assert_allclose(tok.semantics[1], [0.0, 1.0])
    assert run.shape.embed_dim == 2 and run.semantic_source.startswith("embeddings")


def _two_policies(name: str, schedule, capacity: int):
    """Module-level (picklable) factory: an LRU, or a policy that prefetches a fixed set every iteration."""
    if name == "test-lru":
        return LRU()
    return Scripted({(i, -1): [(1, 2), (1, 3)] for i in range(schedule.num_iterations)})


def test_replay_all_in_worker_processes_matches_one_process() -> None:
    rng = np.random.default_rng(3)
    steps = [[[int(e) for e in rng.choice(4, 2, replace=False)] for _ in range(2)] for _ in range(40)]
    schedule = build_schedule(make_trace(steps, [i // 8 for i in range(40)]))
    names = ["scripted", "test-lru", "speculative"]
    one = replay_all(schedule, names, _two_policies, 3, COST, "online", jobs=1)
    two = replay_all(schedule, names, _two_policies, 3, COST, "online", jobs=2)
    assert [r.policy for r in one] == [r.policy for r in two] == names  # the order asked, not the order run
    for a, b in zip(one[:2], two[:2], strict=True):
        assert (a.hits, a.misses, a.late, a.prefetched, a.stall_s) == (
            b.hits,
            b.misses,
            b.late,
            b.prefetched,
            b.stall_s,
        )
        assert b.cpu_s > 0
    assert one[0].prefetched > 0 and one[0].hits != one[1].hits


def test_capacity_and_live_only_policies() -> None:
    shape = ModelShape(26, 64, 6)
    assert capacity_for(shape, cache_fraction=0.25) == 416
    assert capacity_for(shape, cache_fraction=0.25, cache_experts=50) == 50
    with pytest.raises(ValueError, match="at least 6"):
        capacity_for(shape, cache_experts=3)
    trace = make_trace([[[0], [1]]], [0])
    out = replay_all(build_schedule(trace), ["speculative"], lambda *a: LRU(), 2, COST)
    assert out[0].note == "needs hidden states (live only)" and out[0].hits == 0


def test_sim_cache_never_offers_the_copy_in_flight_or_the_layer_in_use_as_a_victim():
    """Random windows and accesses through the simulated copier: every victim asked for is landed and unpinned, and
    the copy in flight and the experts of the last access (pinned until the next) never are candidates."""
    from fmoe_bench.simcache import SimCache
    from fmoe_local.prefetch_queue import PrefetchQueue

    rng = np.random.default_rng(0)
    seen: list[set] = []

    class Checking(LRU):
        def choose_victims(self, candidates, current_layer, count=1):
            keys, t = set(candidates), sim.table
            seen.append(keys)
            assert sim.inflight is None or t.key_of(sim.inflight) not in keys
            assert all(t.landed(t.slot_of[k]) and t.pins(t.slot_of[k]) == 0 for k in keys)
            assert not (window and keys & set(last))  # during a window the last access is still in use
            return [candidates[int(i)] for i in rng.choice(len(candidates), size=count, replace=False)]

    shape = ModelShape(3, 8, 2)
    sim = SimCache(shape, 7, Checking(), CostModel(100, 1000.0, 0.01, 0.0))
    last: list = []
    window = False
    for step in range(300):
        layer = step % 3
        if layer == 0:
            sim.begin_iteration()
            last = []
        queue = PrefetchQueue(3, 8)
        queue.push(0, [Prefetch(int(rng.integers(layer, 3)), int(rng.integers(8)), 1.0) for _ in range(2)])
        window = True
        sim.transfer(float(rng.choice([0, 50, 100, 250])), queue, 0)
        window = False
        experts = tuple(int(e) for e in rng.choice(8, size=2, replace=False))
        sim.access(layer, experts)
        last = [(layer, e) for e in experts]
    assert len(seen) > 100


def test_prefill_wider_than_the_cache_runs_in_chunks() -> None:
    # three prefill tokens pick experts 0, 1, 2 of the single layer; two slots: chunks (0, 1) then (2,)
    trace = make_trace([[[0]], [[1]], [[2]], [[2]]], [0, 0, 0, 0], phases=[PREFILL, PREFILL, PREFILL, DECODE])
    r = replay(build_schedule(trace), LRU(), capacity=2, cost=COST, mode="online")
    assert (r.hits, r.misses) == (1, 3)
