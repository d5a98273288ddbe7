"""The prefetcher with a complete cache (every expert resident): whole passes reach the policy, which still learns.

With nothing left to predict, a forward pass's distributions go to the policy in one event at its end instead of
one per layer. These tests check that the policy learns exactly the maps the router produced (against a recorded
trace), through both ways a policy can take a pass: `observe_iteration` when it has one, else the usual events.
"""

from __future__ import annotations

import numpy as np
import pytest

from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.maps import ExpertMap, MapPersistence
from fmoe_local.policies.base import Prefetch
from fmoe_local.policies.lru import LRUPolicy
from fmoe_local.runtime import Runtime
from fmoe_local.traces import load_trace

# Long enough that the prefill routes to every expert of every layer of the tiny mixtral: the cache is complete
# after the first request.
WARM = [{"role": "user", "content": "Tell me about the ocean, its waves, its tides and the life in it. " * 3}]
PROMPT = [{"role": "user", "content": "Write a poem about the moon."}]


def pass_maps(trace_path) -> list[np.ndarray]:
    """Each forward pass's expert map [L, J] from a recorded trace: the mean over the pass's token rows."""
    trace = load_trace(trace_path)
    starts = np.flatnonzero(np.r_[True, np.diff(trace.iter_ids) != 0])
    return [m.mean(0) for m in np.split(trace.probs, starts[1:])]


class MapLog(MapPersistence):
    """A MapPersistence that keeps every map the store writes."""

    def __init__(self) -> None:
        self.maps: list[ExpertMap] = []

    def load(self) -> list[tuple[int, ExpertMap]]:
        return []

    def put(self, slot: int, expert_map: ExpertMap) -> None:
        self.maps.append(expert_map)

    def clear(self) -> None:
        self.maps.clear()


class PassLog(LRUPolicy):
    """lru that takes whole passes (`observe_iteration`) and logs which events it got."""

    def __init__(self, shape) -> None:  # noqa: ANN001
        super().__init__(shape)
        self.passes: list[tuple[np.ndarray, np.ndarray | None]] = []
        self.layer_events = 0
        self.iteration_events = 0

    def begin_iteration(self, semantic: np.ndarray | None) -> list[Prefetch]:
        self.iteration_events += 1
        return []

    def observe_layer(self, layer: int, probs: np.ndarray, lookahead: np.ndarray | None = None) -> list[Prefetch]:
        self.layer_events += 1
        return []

    def observe_iteration(self, probs: np.ndarray, semantic: np.ndarray | None) -> None:
        self.passes.append((probs, semantic))


@pytest.mark.parametrize("synchronous", [True, False])
def test_fmoe_learns_every_pass_of_a_complete_cache(synchronous, tiny_model_dir, tmp_path):
    trace_path = tmp_path / "run.npz"
    config = RuntimeConfig(
        device="cpu",
        cache_experts=10**6,
        miss_handling="copy",  # misses fill the cache until it is complete
        policy="fmoe",
        synchronous_prefetch=synchronous,
        record_trace=str(trace_path),
        sampling=Sampling(greedy=True, max_new_tokens=6),
    )
    log = MapLog()
    with Runtime.load(tiny_model_dir("mixtral"), config, map_persistence=log) as runtime:
        runtime.generate(WARM)
        assert runtime.engine.cache.complete
        stats = runtime.generate(PROMPT).stats
        assert stats.misses == 0 and stats.hits > 0
    expected = pass_maps(trace_path)
    # One map per forward pass, before and after the cache became complete, each the router's own distributions.
    assert len(log.maps) == len(expected) == 12
    for got, want in zip(log.maps, expected, strict=True):
        np.testing.assert_allclose(got.probs, want, rtol=0, atol=1e-6)
        assert got.semantic is not None


@pytest.mark.parametrize("synchronous", [True, False])
def test_a_policy_with_observe_iteration_gets_one_event_per_complete_pass(synchronous, tiny_model_dir, tmp_path):
    trace_path = tmp_path / "run.npz"
    config = RuntimeConfig(
        device="cpu",
        cache_experts=10**6,
        miss_handling="copy",
        policy="lru",
        synchronous_prefetch=synchronous,
        record_trace=str(trace_path),
        sampling=Sampling(greedy=True, max_new_tokens=5),
    )
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        engine = runtime.engine
        runtime.generate(WARM)
        assert engine.cache.complete
        policy = PassLog(engine.shape)
        engine.offload.set_policy(policy)
        tokens = runtime.generate(PROMPT).stats.tokens
    assert policy.layer_events == policy.iteration_events == 0
    assert len(policy.passes) == tokens == 5
    for (got, semantic), want in zip(policy.passes, pass_maps(trace_path)[-tokens:], strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        assert semantic is not None and semantic.shape == (engine.shape.embed_dim,)


def test_no_lookahead_router_runs_during_a_complete_pass(tiny_model_dir):
    config = RuntimeConfig(
        device="cpu",
        cache_experts=10**6,
        miss_handling="copy",
        policy="speculative",
        sampling=Sampling(greedy=True, max_new_tokens=4),
    )
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        engine = runtime.engine
        calls = []
        handle = engine.moe_layers[1].router.register_forward_hook(lambda *_: calls.append(1))
        try:
            runtime.generate(PROMPT)  # cold: layer 0's hook also runs layer 1's router on its input
            cold = len(calls)
            runtime.generate(WARM)
            assert engine.cache.complete
            calls.clear()
            tokens = runtime.generate(PROMPT).stats.tokens
        finally:
            handle.remove()
    assert cold == 2 * 4
    assert len(calls) == tokens == 4


def test_a_prefetch_predicted_while_a_demand_load_runs_is_copied_after_it_not_lost():
    import time
    from types import SimpleNamespace

    from fmoe_local.prefetcher import Prefetcher

    class Cache:
        """The cache's side of the prefetcher: it refuses prefetches while an on-demand load runs, as the real one."""

        def __init__(self) -> None:
            self.host = SimpleNamespace(num_layers=4, num_experts=8)
            self.current_layer, self.complete, self.demand, self.copied = -1, False, False, []

        @property
        def on_demand_active(self) -> bool:
            return self.demand

        def claimed_mask(self):
            return np.zeros((4, 8), dtype=bool)

        def unhold(self) -> None:
            pass

        def try_prefetch(self, layer: int, expert: int) -> bool:
            if self.demand:
                return False  # refused: before the fix the popped entry was dropped here
            self.copied.append((layer, expert))
            return True

    class Policy(LRUPolicy):
        def __init__(self) -> None:
            pass

        needs_lookahead = False

        def observe_layer(self, layer, probs, lookahead=None):
            return [Prefetch(layer + 2, 5, 1.0)]

    cache = Cache()
    prefetcher = Prefetcher(cache, Policy())
    try:
        prefetcher.publish("begin_iteration", value=np.zeros(4, dtype=np.float32))
        cache.demand = True  # the forward pass waits on layer 0's misses as its router event arrives
        prefetcher.publish("layer", 0, np.full(8, 1 / 8, dtype=np.float32))
        time.sleep(0.3)  # the worker has handled the event meanwhile
        assert cache.copied == []
        cache.demand = False  # the demand load ended
        deadline = time.monotonic() + 5
        while not cache.copied and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.copied == [(2, 5)]
    finally:
        prefetcher.close()
