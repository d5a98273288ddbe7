"""Stop and close through the public Runtime API: Stop ends a request stuck in a read, a stop aimed at one request
never ends another, close() ends what is still queued with a sentence, and a stopped request's queued loads are
dropped. Each test ends with a request that works again where the runtime is still open.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from fmoe_local.config import Sampling
from fmoe_local.runtime import CLOSED, Runtime
from fmoe_local.runtime_types import Finished
from tests.test_runtime_faults import GREEDY, PROMPT, HeldReads, _config, _works


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
        assert events[-1].reason in ("length", "stop", "context")  # it ran to its own end
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
        assert results.get(timeout=30).reason in ("length", "stop", "context")  # before the fix: "cancelled"


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
