"""Fault injection through the public Runtime API: every background failure reaches the request as a sentence, no
wait hangs, Stop ends even a stuck read, and a refused or failed reconfigure leaves a working runtime behind.

Each test ends with a request that works again: recovering is part of handling a fault.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time

import pytest

from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.runtime import CLOSED, Finished, Runtime

PROMPT = [{"role": "user", "content": "Tell me about the ocean and the waves."}]
GREEDY = Sampling(greedy=True, max_new_tokens=6)


def _config(**changes) -> RuntimeConfig:
    # The copy path's failures (the CPU path's are in test_cpu_experts.py).
    return RuntimeConfig(device="cpu", cache_experts=3, miss_handling="copy", sampling=GREEDY).with_changes(**changes)


def _works(runtime: Runtime) -> Finished:
    final = runtime.generate(PROMPT)
    assert final.reason in ("stop", "length") and final.error == "", final.error
    return final


class HeldReads:
    """The host store's reads held, as on a stuck disk: every read (or only the first, `first_only`) waits for
    `release`; `entered` says one is waiting, `reads` lists them all. `restore()` puts the real read back."""

    def __init__(self, runtime: Runtime, first_only: bool = False) -> None:
        self.host, self.first_only = runtime.engine.host, first_only
        self.real = self.host.read
        self.reads: list[tuple[int, int]] = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.host.read = self._read

    def _read(self, layer: int, expert: int):
        self.reads.append((layer, expert))
        if not (self.entered.is_set() if self.first_only else self.release.is_set()):
            self.entered.set()
            self.release.wait(30)
        return self.real(layer, expert)

    def restore(self) -> None:
        self.host.read = self.real


def test_a_policy_that_raises_in_the_worker_ends_the_request_with_a_sentence(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="fmoe")) as runtime:
        expected = _works(runtime).token_ids
        policy = runtime.engine.policy

        def broken(*args, **kwargs):
            raise IndexError("index 7 is out of bounds")

        policy.observe_layer = broken  # the instance only: recovery builds a fresh policy
        final = runtime.generate(PROMPT)
        assert final.reason == "error"
        assert "Expert prediction failed" in final.error and "IndexError" in final.error
        assert "send the message again" in final.error
        assert runtime.engine.policy is not policy  # the worker was given a fresh policy
        assert runtime.engine.offload.wait_idle(1.0)  # nothing left piling up
        assert _works(runtime).token_ids == expected  # recovered, and still lossless


def test_a_policy_that_raises_in_synchronous_mode_is_the_same_sentence(tiny_model_dir):
    with Runtime.load(tiny_model_dir("olmoe"), _config(policy="lru", synchronous_prefetch=True)) as runtime:

        def broken(*args, **kwargs):
            raise KeyError("slot")

        runtime.engine.policy.observe_layer = broken
        final = runtime.generate(PROMPT)
        assert final.reason == "error" and "Expert prediction failed in the background (KeyError" in final.error
        _works(runtime)


def test_a_host_read_that_raises_releases_its_slot_and_the_next_request_works(tiny_model_dir):
    with Runtime.load(tiny_model_dir("qwen3_moe"), _config(policy="on_demand")) as runtime:
        host = runtime.engine.host
        real_read = host.read
        failing = {"on": True}

        def read(layer, expert):
            if failing["on"] and layer == 1:
                raise OSError(5, "Input/output error")
            return real_read(layer, expert)

        host.read = read
        final = runtime.generate(PROMPT)
        assert final.reason == "error"
        assert "Could not load expert" in final.error and "MoE layer 1" in final.error
        assert "download the model again" in final.error
        cache = runtime.engine.cache
        assert not cache.claimed_mask()[1].any()  # the failed claim was released, nothing half-loaded stays
        failing["on"] = False
        _works(runtime)  # on today's main this waited forever on the slot the failed load left claimed


def test_stop_ends_a_request_stuck_in_a_blocked_host_read(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="on_demand")) as runtime:
        held = HeldReads(runtime)
        events: queue.Queue = queue.Queue()
        consumer = threading.Thread(target=lambda: [events.put(e) for e in runtime.stream(PROMPT)], daemon=True)
        consumer.start()
        assert held.entered.wait(10), "the request never reached the host store"
        t0 = time.perf_counter()
        runtime.stop()
        final = events.get(timeout=5)
        took = time.perf_counter() - t0
        assert isinstance(final, Finished) and final.reason == "cancelled"
        assert took < 1.0, f"Stop took {took:.2f} s to end a request stuck in a read"
        held.release.set()
        _works(runtime)


def test_a_disk_tier_file_truncated_after_load_gives_a_sentence_not_a_crash(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("olmoe"), model_dir)
    with Runtime.load(model_dir, _config(policy="lru", host_ram_gb=0.0)) as runtime:
        weights = model_dir / "model.safetensors"
        size = weights.stat().st_size
        with open(weights, "r+b") as f:
            f.truncate(size // 2)  # on today's main the next read killed the process (SIGBUS)
        final = runtime.generate(PROMPT)
        assert final.reason == "error"
        assert "model.safetensors is damaged" in final.error and "Download the model again" in final.error
        assert runtime.generate(PROMPT).reason == "error"  # says so again; no hang, no crash


def test_an_impossible_cache_size_is_refused_and_changes_nothing(tiny_model_dir):
    with Runtime.load(tiny_model_dir("qwen2_moe"), _config(cache_experts=None, cache_gb=0.01)) as runtime:
        expected = _works(runtime).token_ids
        before = (runtime.config, runtime.engine.cache.capacity)
        with pytest.raises(ValueError, match="must hold at least one expert"):
            runtime.reconfigure(cache_gb=1e-9)
        assert (runtime.config, runtime.engine.cache.capacity) == before
        assert _works(runtime).token_ids == expected  # on today's main: "Generation failed: 'gate_up_proj'"
        # A second, valid Apply really applies (today it "succeeded" without changing anything).
        runtime.reconfigure(cache_experts=4)
        assert runtime.engine.cache.capacity == 4


def test_a_cache_allocation_that_fails_rolls_back_to_the_previous_size(tiny_model_dir, monkeypatch):
    import fmoe_local.offload as offload_module

    with Runtime.load(tiny_model_dir("deepseek_v2"), _config(cache_experts=3)) as runtime:
        expected = _works(runtime).token_ids
        real_cache = offload_module.ExpertCache

        def out_of_memory(host, capacity, *args, **kwargs):
            if capacity == 6:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return real_cache(host, capacity, *args, **kwargs)

        monkeypatch.setattr(offload_module, "ExpertCache", out_of_memory)
        with pytest.raises(
            ValueError, match="Could not set up a 6-expert cache.*out of memory.*3-expert cache is back"
        ):
            runtime.reconfigure(cache_experts=6, prefetch_distance=2)
        assert runtime.config.cache_experts == 3 and runtime.config.prefetch_distance == 3
        assert runtime.engine.cache.capacity == 3
        assert _works(runtime).token_ids == expected


def test_ram_tier_experts_survive_their_file_being_truncated(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("qwen2_moe"), model_dir)
    with Runtime.load(model_dir, _config(policy="lru")) as runtime:  # every expert in RAM
        expected = _works(runtime).token_ids
        (model_dir / "model.safetensors").write_bytes(b"")  # a re-download starting over, say
        runtime.reset_cache()  # every expert must come from the host store again
        assert _works(runtime).token_ids == expected  # today: SIGBUS, the app is gone


def test_an_over_long_prompt_is_refused_before_any_compute(tiny_model_dir):
    with Runtime.load(tiny_model_dir("olmoe"), _config()) as runtime:  # the tiny models read 512 tokens
        pasted = [{"role": "user", "content": "the sea and the ships " * 20_000}]
        final = runtime.generate(pasted)
        assert final.reason == "error" and final.token_ids == []
        assert "tokens long, but" in final.error and "reads at most 512" in final.error
        assert "Start a new chat, or shorten the message." in final.error
        assert runtime.engine.counters.misses.sum() + runtime.engine.counters.hits.sum() == 0  # nothing ran
        _works(runtime)


def test_a_reply_ends_where_the_context_does(tiny_model_dir):
    with Runtime.load(tiny_model_dir("olmoe"), _config()) as runtime:
        from fmoe_local.engine import ContextTooLong

        def length(words: list[str]) -> int:
            try:
                return runtime.engine.encode_chat([{"role": "user", "content": " ".join(words)}]).shape[1]
            except ContextTooLong:
                return 10**6

        words = ["sea"] * 600
        while length(words) > 512 - 6:  # a prompt a few tokens short of the context
            words = words[:-1]
        prompt = [{"role": "user", "content": " ".join(words)}]
        n = runtime.engine.encode_chat(prompt).shape[1]
        final = runtime.generate(prompt, Sampling(greedy=True, max_new_tokens=100))
        assert len(final.token_ids) <= 512 - n and final.reason in ("length", "stop")


def test_stop_reaches_a_prefill_at_the_next_moe_layer(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(cache_experts=None, cache_gb=1.0)) as runtime:
        _works(runtime)  # every expert resident: no load to interrupt, only the forward pass itself
        first = runtime.engine.moe_layers[0].experts
        handle = first.register_forward_pre_hook(lambda module, args: runtime.stop())
        try:
            final = runtime.generate(PROMPT)
        finally:
            handle.remove()
        assert final.reason == "cancelled" and final.token_ids == []  # not even the prefill's token
        _works(runtime)


def test_close_ends_requests_still_waiting_for_their_turn_with_a_sentence(tiny_model_dir):
    runtime = Runtime.load(tiny_model_dir("mixtral"), _config(policy="on_demand"))
    held = HeldReads(runtime)  # holds the first request inside the model while the second queues behind it
    first, second = queue.Queue(), queue.Queue()
    for events in (first, second):
        threading.Thread(target=lambda q=events: [q.put(e) for e in runtime.stream(PROMPT)], daemon=True).start()
        if events is first:
            assert held.entered.wait(10), "the first request never reached the host store"
    time.sleep(0.2)  # the second is queued
    t0 = time.perf_counter()
    closing = threading.Thread(target=runtime.close, daemon=True)
    closing.start()
    assert first.get(timeout=5).reason == "cancelled"
    queued = second.get(timeout=5)  # before the fix it ran in full while the model was being closed under it
    assert queued.reason == "error" and queued.error == CLOSED and queued.text == ""
    held.release.set()
    closing.join(10)
    assert not closing.is_alive() and time.perf_counter() - t0 < 5


def test_a_request_that_slips_in_after_close_ends_instead_of_waiting_for_ever(tiny_model_dir):
    runtime = Runtime.load(tiny_model_dir("mixtral"), _config())
    runtime.close()
    runtime._closed = False  # the caller checked `closed` just before close() ran: its request lands after the end
    t0 = time.perf_counter()
    events = list(runtime.stream(PROMPT))
    assert len(events) == 1 and events[0].reason == "error" and events[0].error == CLOSED
    with pytest.raises(RuntimeError, match="unloaded before this request ran"):
        runtime.reset_cache()  # a job between requests, too
    assert time.perf_counter() - t0 < 5


def test_stop_with_a_request_s_flag_ends_that_request_only(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="on_demand")) as runtime:
        long = Sampling(greedy=True, max_new_tokens=40)
        mine, theirs = threading.Event(), threading.Event()
        started = threading.Event()
        first: queue.Queue = queue.Queue()

        def run_theirs():
            for event in runtime.stream(PROMPT, long, stop=theirs):
                started.set()
                first.put(event)

        threading.Thread(target=run_theirs, daemon=True).start()
        assert started.wait(30)
        runtime.stop(mine)  # mine is not running: the running request goes on
        events = []
        while not events or not isinstance(events[-1], Finished):
            events.append(first.get(timeout=30))
        assert events[-1].reason in ("length", "stop")  # it ran to its own end
        # A request whose flag was already set (stopped while it waited for its turn) ends at once.
        assert [e.reason for e in runtime.stream(PROMPT, long, stop=mine) if isinstance(e, Finished)] == ["cancelled"]


def test_a_stop_for_a_request_that_just_ended_never_lands_on_the_next(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="on_demand")) as runtime:
        held = HeldReads(runtime)  # B's first expert load waits here, interruptible like any load

        class SlowFlag(threading.Event):
            """A's stop flag: setting it through the running request (after stop() read `_current`) is slow, as a
            stop thread descheduled there while A ends and B begins would be."""

            calls = 0

            def set(self) -> None:
                self.calls += 1
                if self.calls == 2:
                    held.entered.wait(3)
                super().set()

        a_flag = SlowFlag()
        a_request = type("A", (), {"stop": a_flag})()
        with runtime._turn:  # noqa: SLF001 - A is the request running when stop() looks
            runtime._current = a_request  # noqa: SLF001
        stopper = threading.Thread(target=runtime.stop, args=(a_flag,), daemon=True)
        stopper.start()
        time.sleep(0.1)  # stop() has read `_current` and is inside A's slow set()
        runtime._current = None  # noqa: SLF001 - A ends (unlocked, as the worker's finally would race)
        results: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: results.put(list(runtime.stream(PROMPT, GREEDY))[-1]), daemon=True).start()
        stopper.join(10)
        held.release.set()
        assert results.get(timeout=30).reason in ("length", "stop")  # before the fix: "cancelled"


def test_a_background_failure_in_a_stopped_request_does_not_end_the_next(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="fmoe")) as runtime:
        expected = _works(runtime).token_ids

        def broken(*args, **kwargs):
            runtime.stop()  # the user presses Stop just as prediction fails in the background
            raise IndexError("index 7 is out of bounds")

        runtime.engine.policy.observe_layer = broken
        assert runtime.generate(PROMPT).reason in ("cancelled", "error")
        # Before the fix the next request ran on the failed policy, and the stored failure was waiting for it.
        assert _works(runtime).token_ids == expected


def test_changes_asked_for_during_a_reply_are_all_applied_none_undoes_another(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="fmoe", prefetch_distance=1)) as runtime:
        held = HeldReads(runtime)  # holds the reply while two settings changes queue behind it
        reply = threading.Thread(target=lambda: runtime.generate(PROMPT), daemon=True)
        reply.start()
        assert held.entered.wait(10)
        first = threading.Thread(target=lambda: runtime.reconfigure(prefetch_distance=2), daemon=True)
        first.start()
        time.sleep(0.2)  # queued first
        second = threading.Thread(target=lambda: runtime.reconfigure(policy="lru"), daemon=True)
        second.start()
        time.sleep(0.2)
        held.restore()
        held.release.set()
        for t in (reply, first, second):
            t.join(30)
        # Before the fix the second change was built from the settings before the first, and undid it.
        assert (runtime.config.prefetch_distance, runtime.config.policy) == (2, "lru")
        _works(runtime)


def test_a_cache_larger_than_the_gpu_holds_is_cut_to_what_fits_and_the_load_says_so(tiny_model_dir, monkeypatch):
    from fmoe_local import cache_budget

    model = tiny_model_dir("mixtral")
    with Runtime.load(model, _config(cache_experts=None, cache_gb=4.0)) as roomy:
        expert_bytes, expected = roomy.engine.host.expert_bytes, _works(roomy).token_ids
        assert roomy.load_notice == ""
    # A fake GPU with room for 5 experts beside the resident part (the CUDA path's arithmetic, on the CPU).
    monkeypatch.setattr(cache_budget, "device_room_bytes", lambda device: 5 * expert_bytes)
    with Runtime.load(model, _config(cache_experts=None, cache_gb=4.0)) as tight:
        assert tight.info.cache_experts == 5 and "so it holds 5 experts" in tight.load_notice
        assert _works(tight).token_ids == expected  # a smaller cache, the same reply


def test_stop_drops_the_loads_its_request_left_queued(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="on_demand", cache_experts=8)) as runtime:
        held = HeldReads(runtime, first_only=True)  # a slow disk: the request's first read holds the loader
        events: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [events.put(e) for e in runtime.stream(PROMPT)], daemon=True).start()
        assert held.entered.wait(10)
        runtime.stop()
        final = events.get(timeout=5)
        while not isinstance(final, Finished):
            final = events.get(timeout=5)
        assert final.reason == "cancelled"
        queued = held.reads[:]  # the prefill's layer 0 asked for several experts; one read was under way
        held.release.set()
        runtime.engine.offload.wait_idle(5)
        time.sleep(0.3)
        assert held.reads == queued and len(queued) == 1  # before the fix every queued load still read after the Stop
        held.restore()
        _works(runtime)


def test_a_cache_that_cannot_be_set_up_again_is_a_sentence_not_a_crash_or_a_hang(tiny_model_dir, monkeypatch):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="lru")) as runtime:
        offload = runtime.engine.offload
        real_new = offload._new_cache

        def no_memory(capacity):
            raise RuntimeError("CUDA out of memory")

        monkeypatch.setattr(offload, "_new_cache", no_memory)  # the new size and the old one both fail
        with pytest.raises(RuntimeError):
            runtime.reconfigure(cache_experts=6)
        t0 = time.perf_counter()
        final = runtime.generate(PROMPT)  # before: KeyError on a hit, or a 60 s wait on a closed loader
        assert final.reason == "error" and final.error == (
            "The expert cache could not be set up again. Load the model again (Models tab)."
        )
        assert time.perf_counter() - t0 < 5
        monkeypatch.setattr(offload, "_new_cache", real_new)
        runtime.reset_cache()  # a resize that works brings the runtime back
        _works(runtime)


def test_a_change_while_a_prefetch_is_stuck_in_a_read_is_refused_and_changes_nothing(tiny_model_dir, monkeypatch):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="fmoe")) as runtime:
        offload, before = runtime.engine.offload, runtime.config
        cache = offload.cache
        monkeypatch.setattr(offload, "wait_idle", lambda timeout_s: False)  # a prefetch read that did not return
        for change in (lambda: runtime.reconfigure(cache_experts=5), runtime.reset_cache):
            with pytest.raises(ValueError, match="still stuck reading the model files, so nothing was changed"):
                change()  # before: the cache was swapped under the stuck copy anyway
            assert runtime.config == before and offload.cache is cache
        monkeypatch.undo()
        runtime.reconfigure(cache_experts=5)
        assert runtime.info.cache_experts == 5
        _works(runtime)
