"""Cancel and close through the public Runtime API (submit → RequestHandle): a cancel ends a request stuck in a read,
a cancel aimed at one request never ends another, close() ends the running request and what is still queued with a
sentence, a worker that ends for any reason leaves no waiter waiting, and a cancelled request's queued loads are
dropped. Each test ends with a request that works again where the runtime is still open.
"""

from __future__ import annotations

import threading
import time

import pytest

from fmoe_local.config import Sampling
from fmoe_local.runtime import CLOSED, Runtime
from fmoe_local.runtime_types import Finished
from tests.test_runtime_faults import GREEDY, PROMPT, HeldReads, _config, _works


def test_cancel_ends_a_request_stuck_in_a_blocked_host_read(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="on_demand")) as runtime:
        held = HeldReads(runtime)
        request = runtime.submit(PROMPT)
        assert held.entered.wait(10), "the request never reached the host store"
        t0 = time.perf_counter()
        request.cancel()
        final = request.result(timeout=5)
        took = time.perf_counter() - t0
        assert isinstance(final, Finished) and final.reason == "cancelled"
        assert took < 1.0, f"Stop took {took:.2f} s to end a request stuck in a read"
        held.release.set()
        _works(runtime)


def test_close_ends_requests_still_waiting_for_their_turn_with_a_sentence(tiny_model_dir):
    runtime = Runtime.load(tiny_model_dir("mixtral"), _config(policy="on_demand"))
    held = HeldReads(runtime)  # holds the first request inside the model while the second queues behind it
    first = runtime.submit(PROMPT)
    assert held.entered.wait(10), "the first request never reached the host store"
    second = runtime.submit(PROMPT)  # queued behind it
    t0 = time.perf_counter()
    closing = threading.Thread(target=runtime.close, daemon=True)
    closing.start()
    assert first.result(timeout=5).reason == "cancelled"
    assert not first.cancelled  # its owner did not cancel it: the UI says "interrupted", not "stopped"
    queued = second.result(timeout=5)  # before the fix it ran in full while the model was being closed under it
    assert queued.reason == "error" and queued.error == CLOSED and queued.text == ""
    held.release.set()
    closing.join(10)
    assert not closing.is_alive() and time.perf_counter() - t0 < 5


def test_a_request_that_slips_in_after_close_ends_instead_of_waiting_for_ever(tiny_model_dir):
    runtime = Runtime.load(tiny_model_dir("mixtral"), _config())
    runtime.close()
    runtime._closed = False  # the caller checked `closed` just before close() ran: its request lands after the end
    t0 = time.perf_counter()
    events = list(runtime.submit(PROMPT))
    assert len(events) == 1 and events[0].reason == "error" and events[0].error == CLOSED
    with pytest.raises(RuntimeError, match="unloaded before this request ran"):
        runtime.reset_cache()  # a job between requests, too
    assert time.perf_counter() - t0 < 5


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the worker's death, on purpose
def test_a_worker_that_dies_ends_the_running_request_and_every_queued_one(tiny_model_dir):
    """No wait polls the worker any more: its `finally` must wake every waiter, however it ends."""
    runtime = Runtime.load(tiny_model_dir("mixtral"), _config(policy="on_demand"))
    held = HeldReads(runtime)
    running = runtime.submit(PROMPT)
    assert held.entered.wait(10)
    queued = runtime.submit(PROMPT)

    class WorkerKilled(BaseException):
        """Not an Exception: nothing in the worker catches it, as with an interpreter shutting the thread down."""

    def die(*args, **kwargs):
        raise WorkerKilled

    runtime.engine.request = die  # the queued request's turn comes: the worker ends while serving it
    calls = threading.Thread(target=lambda: pytest.raises(RuntimeError, runtime.reset_cache), daemon=True)
    calls.start()  # a settings change queued behind them
    time.sleep(0.2)
    running.cancel()
    held.release.set()
    assert running.result(timeout=10).reason == "cancelled"
    assert queued.result(timeout=10).error == CLOSED  # before: a wait for a worker that was gone
    calls.join(10)
    assert not calls.is_alive()
    assert runtime.submit(PROMPT).result(timeout=5).error == CLOSED  # after the worker ended: at once
    # Its `finally` answers the waiters before the exception leaves the thread: wait for it here, so that its report
    # lands in this test (where the warning is expected), not in whichever test runs next.
    runtime._worker.join(10)  # noqa: SLF001
    assert not runtime._worker.is_alive()  # noqa: SLF001
    runtime._engine.close()  # noqa: SLF001 - close() would join a worker that is already gone


def test_cancel_ends_that_request_only_and_at_once_while_it_waits_its_turn(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="on_demand")) as runtime:
        long = Sampling(greedy=True, max_new_tokens=40)
        held = HeldReads(runtime)
        theirs = runtime.submit(PROMPT, long)
        assert held.entered.wait(10)
        mine = runtime.submit(PROMPT, long)  # waits for its turn
        mine.cancel()
        assert mine.result(timeout=1).reason == "cancelled" and mine.done  # at once, not after theirs
        held.release.set()
        assert theirs.result(timeout=60).reason in ("length", "stop", "context")  # it ran to its own end
        held.restore()
        _works(runtime)


def test_a_cancel_of_a_request_that_just_ended_never_lands_on_the_next(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="on_demand")) as runtime:
        a = runtime.submit(PROMPT, GREEDY)
        a.result(timeout=30)
        held = HeldReads(runtime)  # B's first expert load waits here, interruptible like any load
        b = runtime.submit(PROMPT, GREEDY)
        assert held.entered.wait(10)
        # A's owner presses Stop late, while B runs (the stop thread descheduled between reading A's state and acting
        # on it would do the same): the engine's interrupt must stay B's.
        runtime._cancel(a)  # noqa: SLF001 - what A's cancel() does once A has started
        a.cancel()
        held.release.set()
        assert b.result(timeout=30).reason in ("length", "stop", "context")  # before the fix: "cancelled"


def test_cancel_drops_the_loads_its_request_left_queued(tiny_model_dir):
    with Runtime.load(tiny_model_dir("mixtral"), _config(policy="on_demand", cache_experts=8)) as runtime:
        held = HeldReads(runtime, first_only=True)  # a slow disk: the request's first read holds the loader
        request = runtime.submit(PROMPT)
        assert held.entered.wait(10)
        request.cancel()
        final = request.result(timeout=5)
        assert final.reason == "cancelled"
        queued = held.reads[:]  # the prefill's layer 0 asked for several experts; one read was under way
        held.release.set()
        runtime.engine.offload.wait_idle(5)
        time.sleep(0.3)
        assert held.reads == queued and len(queued) == 1  # before the fix every queued load still read after the Stop
        held.restore()
        _works(runtime)
