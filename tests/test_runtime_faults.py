"""Fault injection through the public Runtime API: every background failure reaches the request as a sentence, no
wait hangs, and a refused or failed reconfigure leaves a working runtime behind (Stop and close: test_runtime_stop.py,
which shares this file's helpers).

Each test ends with a request that works again: recovering is part of handling a fault.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.engine import ContextTooLong
from fmoe_local.runtime import Runtime
from fmoe_local.runtime_types import Finished

PROMPT = [{"role": "user", "content": "Tell me about the ocean and the waves."}]
GREEDY = Sampling(greedy=True, max_new_tokens=6)


def _config(**changes) -> RuntimeConfig:
    # The copy path's failures (the CPU path's are in test_cpu_experts.py).
    return RuntimeConfig(device="cpu", cache_experts=3, miss_handling="copy", sampling=GREEDY).with_changes(**changes)


def cancel_running(runtime: Runtime) -> None:
    """Stop pressed for the request that runs now (from a hook inside it, where its handle is not at hand)."""
    runtime._current.cancel()  # noqa: SLF001


def _works(runtime: Runtime) -> Finished:
    final = runtime.generate(PROMPT)
    assert final.reason in ("stop", "length", "context") and final.error == "", final.error
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
        with pytest.raises(ContextTooLong, match="reads at most 512"):  # told before queueing (the API's 400)
            runtime.check(pasted)
        assert 0 < runtime.check([{"role": "user", "content": "the sea"}]) < 512
        _works(runtime)


def test_a_reply_ends_where_the_context_does_and_says_so(tiny_model_dir, monkeypatch):
    import fmoe_local.generate as generate

    with Runtime.load(tiny_model_dir("olmoe"), _config()) as runtime:

        def length(words: list[str]) -> int:
            try:
                return runtime.engine.encode_prompt([{"role": "user", "content": " ".join(words)}]).shape[1]
            except ContextTooLong:
                return 10**6

        words = ["sea"] * 600
        while length(words) > 512 - 6:  # a prompt a few tokens short of the context
            words = words[:-1]
        prompt = [{"role": "user", "content": " ".join(words)}]
        n = runtime.engine.encode_prompt(prompt).shape[1]
        # A model that never ends on its own, so the reply runs into the context whatever the tokenizer.
        never_eos = next(t for t in range(10, 100) if t not in runtime.engine.eos_ids)
        monkeypatch.setattr(generate, "sample_next", lambda logits, sampling, generator: never_eos)
        final = runtime.generate(prompt, Sampling(greedy=True, max_new_tokens=100))
        assert len(final.token_ids) == 512 - n
        assert final.reason == final.stats.finish_reason == "context"  # before: "length", as if Max new tokens cut it
        final = runtime.generate(prompt, Sampling(greedy=True, max_new_tokens=2))  # room left: the user's limit
        assert len(final.token_ids) == 2 and final.reason == "length"


def test_stop_reaches_a_prefill_at_the_next_moe_layer(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(cache_experts=None, cache_gb=1.0)) as runtime:
        _works(runtime)  # every expert resident: no load to interrupt, only the forward pass itself
        first = runtime.engine.moe_layers[0].experts
        handle = first.register_forward_pre_hook(lambda module, args: cancel_running(runtime))
        try:
            final = runtime.generate(PROMPT)
        finally:
            handle.remove()
        assert final.reason == "cancelled" and final.token_ids == []  # not even the prefill's token
        _works(runtime)


def test_a_background_failure_in_a_stopped_request_does_not_end_the_next(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="fmoe")) as runtime:
        expected = _works(runtime).token_ids

        def broken(*args, **kwargs):
            cancel_running(runtime)  # the user presses Stop just as prediction fails in the background
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


def test_a_read_that_hangs_past_its_deadline_fails_one_reply_naming_its_expert_and_the_next_reply_works(
    tiny_model_dir,
):
    # Before: the loader's thread stayed in the hung read, so every later reply waited out the deadline and failed,
    # naming an expert that was only queued behind it, until a restart.
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="on_demand", load_timeout_s=1.0)) as runtime:
        clean = _works(runtime).token_ids
        runtime.reset_cache()
        held = HeldReads(runtime, first_only=True)  # the first read hangs (a disk that stalls once)
        failed = runtime.generate(PROMPT)
        assert failed.reason == "error"
        layer, expert = held.reads[0]
        assert (
            f"expert {expert} of MoE layer {layer} took too long" in failed.error and "check the disk" in failed.error
        )
        assert not held.release.is_set()  # the hung read is still hung while the next replies run
        assert _works(runtime).token_ids == clean
        held.release.set()
        for thread in runtime.engine.cache._loader.abandoned:  # the hung read returns: it must land nowhere
            thread.join(5)
        assert _works(runtime).token_ids == clean
        runtime.reset_cache()
        assert _works(runtime).token_ids == clean
