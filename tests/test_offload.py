"""Offload: the one owner of the cache, the prefetcher, the policy's calls and the miss handling.

Driven through a runtime on a tiny model (the real loading path), since what matters is that a settings change made
through the Offload reaches every piece it owns, and that the forward pass gets what it asks for.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.copier import Interrupted
from fmoe_local.cpu_experts import NATIVE
from fmoe_local.engine import Engine
from fmoe_local.experts import OffloadedExperts
from fmoe_local.miss_cost import MissCosts
from fmoe_local.offload import Offload
from fmoe_local.policies import make_policy
from fmoe_local.runtime import Runtime
from fmoe_local.stats import LayerCounters
from tests.fake_streams import FakeStreams

PROMPT = [{"role": "user", "content": "Tell me about the ocean and the waves."}]


def _config(**changes) -> RuntimeConfig:
    base = RuntimeConfig(device="cpu", cache_experts=4, miss_handling="copy", synchronous_prefetch=True)
    return base.with_changes(sampling=Sampling(greedy=True, max_new_tokens=4), **changes)


def test_a_new_policy_reaches_the_cache_the_matcher_and_the_miss_handling(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="lru")) as runtime:
        engine = runtime.engine
        offload = engine.offload
        assert offload.miss_handling == "copy"
        policy = make_policy("cpu_moe", engine.shape, runtime.config, engine.map_store)
        offload.set_policy(policy)
        assert offload.policy is policy and engine.cache.policy is policy and engine.policy is policy
        assert offload.miss_handling == "cpu"  # cpu_moe forces its own
        layers_kept = offload.capacity // engine.shape.num_experts
        assert len(policy.resident_layers) == layers_kept  # it was told the cache's size
        stats = runtime.generate(PROMPT).stats
        assert stats.misses > 0 and stats.on_host == stats.misses  # every miss computed on the CPU, none copied


def test_miss_handling_changes_reach_the_forward_pass(tiny_model_dir):
    with Runtime.load(tiny_model_dir("olmoe"), _config(policy="on_demand")) as runtime:
        copied = runtime.generate(PROMPT)
        assert copied.stats.misses > 0 and copied.stats.on_host == 0 and copied.stats.bytes_moved > 0
        runtime.reconfigure(miss_handling="cpu")
        assert runtime.engine.offload.miss_handling == "cpu"
        runtime.reset_cache()
        on_cpu = runtime.generate(PROMPT)
        assert on_cpu.stats.misses > 0 and on_cpu.stats.on_host == on_cpu.stats.misses
        assert on_cpu.stats.bytes_moved == 0 and on_cpu.stats.host_s > 0
        assert on_cpu.token_ids == copied.token_ids  # on a CPU device both paths run the same ops


def test_a_resize_gives_a_cold_cache_of_the_new_size_that_the_policy_is_told(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="cpu_moe")) as runtime:
        offload = runtime.engine.offload
        J = runtime.engine.shape.num_experts
        runtime.generate(PROMPT)
        offload.resize(2 * J)
        assert offload.capacity == 2 * J and offload.resident() == []
        assert len(offload.policy.resident_layers) == 2
        assert runtime.generate(PROMPT).error == ""


def test_after_stop_the_next_layer_asks_for_nothing(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="lru")) as runtime:
        offload = runtime.engine.offload
        offload.interrupt.set()
        try:
            with pytest.raises(Interrupted):
                offload.acquire(0, [0, 1])
            assert offload.resident() == [] and runtime.engine.counters.misses.sum() == 0
        finally:
            offload.interrupt.clear()
        offload.release([-1, -1])  # host experts hold no slot: nothing to release
        assert runtime.generate(PROMPT).error == ""


def test_the_pinned_ram_budget_is_half_the_machine_unless_set_and_never_negative(tiny_model_dir):
    from fmoe_local import hardware
    from fmoe_local.engine import pinned_budget

    assert pinned_budget(RuntimeConfig()) == hardware.ram_bytes()[0] // 2
    assert pinned_budget(RuntimeConfig(pinned_ram_gb=1.5)) == int(1.5 * 1024**3)
    assert pinned_budget(RuntimeConfig(pinned_ram_gb=0.0)) == 0
    with pytest.raises(ValueError, match="pinned RAM to 0 GB"):
        RuntimeConfig(pinned_ram_gb=-1.0).validate()
    with Runtime.load(tiny_model_dir("olmoe"), _config()) as runtime:  # a CPU device copies nothing: pins nothing
        assert runtime.engine.offload.pinned_bytes == 0 == runtime.engine.host.pinned_bytes


class LoggingHost:
    """A host store that logs every read with the thread that made it into `log` (the fake streams' log, so reads
    and copy-stream events share one order), and reads slowly on the loader thread (the copies)."""

    def __init__(self, host: object, log: list) -> None:
        self._host, self._log = host, log

    def __getattr__(self, name: str) -> object:
        return getattr(self._host, name)

    def read(self, layer: int, expert: int) -> object:
        thread = threading.current_thread().name
        self._log.append(("read", layer, expert, thread))
        if thread == "fmoe-loader":
            time.sleep(0.01)  # a slow read: a host expert computed before the copies were issued would show first
        return self._host.read(layer, expert)


def _split_offload(engine, cpu_ms: float) -> tuple[Offload, FakeStreams]:
    """An Offload over the engine's host experts that believes in a GPU: copies take 1 ms, the CPU `cpu_ms` at any
    token count; its cache runs the CUDA logic on CPU tensors through fake streams."""
    streams = FakeStreams()
    host = LoggingHost(engine.host, streams.log)
    costs = MissCosts(
        device="cuda", fmt="fp32", expert_bytes=host.expert_bytes, h2d_gbps=host.expert_bytes / 1e6,
        cpu_kernel="fp32 native", cpu_s_1=cpu_ms * 1e-3, cpu_s_n=cpu_ms * 1e-3,
    )  # fmt: skip
    shape = engine.shape
    policy = make_policy("lru", shape, engine.config)
    counters = LayerCounters(shape.num_layers, shape.num_experts)
    offload = Offload(
        host, torch.device("cpu"), shape.num_experts, policy, counters, costs, NATIVE, synchronous=True, streams=streams
    )
    return offload, streams


def test_auto_shares_a_layers_misses_between_the_link_and_the_cpu_as_the_costs_say(tiny_model_dir):
    engine = Engine.build(tiny_model_dir("mixtral"), _config(policy="lru"))
    offload, _ = _split_offload(engine, cpu_ms=2.5)
    try:
        # Copies end at 1, 2, 3, ... ms; the CPU's 2.5 ms beats only the third copy (3 ms). The fourth would end at
        # 5 ms on the CPU, so the rest are copied (the sixth ties at 5 ms: copied, it stays resident).
        slots = offload.acquire(0, [0, 1, 2, 3, 4, 5])
        assert [s < 0 for s in slots] == [False, False, True, False, False, False]
        c = offload.counters
        assert int(c.misses.sum()) == 6 and int(c.on_host.sum()) == int(c.on_host[0, 2]) == 1
        offload.release(slots)
        # Resident experts are hits, never planned: the one miss left is alone, and a lone miss is copied here.
        assert min(offload.acquire(0, [0, 1, 2])) >= 0 and int(c.on_host.sum()) == 1
    finally:
        offload.close()
        engine.close()


def test_copies_are_issued_before_the_cpu_computes_its_share_and_the_layer_stays_exact(tiny_model_dir):
    model_dir = tiny_model_dir("mixtral")
    engine = Engine.build(model_dir, _config(policy="lru"))
    offload, streams = _split_offload(engine, cpu_ms=2.5)
    try:
        ref = engine.moe_layers[0]
        plain = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32)
        eager = plain.get_submodule(engine.arch.experts_prefix(ref.layer_index))
        layer = OffloadedExperts({id(ref.experts): 0}, offload)
        index = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])  # a prefill needing all 8 experts, one token each
        weights = torch.softmax(torch.randn(4, 2, generator=torch.Generator().manual_seed(0)), dim=-1)
        x = torch.randn(4, engine.shape.embed_dim, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            got = layer(ref.experts, x, index, weights)
            expected = eager(x, index, weights)
        assert torch.equal(got, expected)
        log = streams.log
        # 8 equal misses: copies end at 1, 2, 3, 4, 5, 6 ms, the CPU's two at 2.5 and 5 ms (the third and seventh).
        host_reads = [i for i, e in enumerate(log) if e[0] == "read" and e[-1] == threading.main_thread().name]
        copies = [i for i, e in enumerate(log) if e[0] == "record" and e[2] == "copy" and e[-1] == "fmoe-loader"]
        assert [log[i][2] for i in host_reads] == [2, 6]
        assert len(copies) >= 6 and max(copies) < min(host_reads)  # every copy issued before the CPU's first read
    finally:
        offload.close()
        engine.close()
