"""RequestHandle without a model: every reader sees every event, sync and async readers wake without polling, a
cancel before the request's turn ends it at once and the producer does not run it, done callbacks run before any
waiter wakes, and a result that does not come in time is a sentence."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fmoe_local.request_handle import RequestHandle
from fmoe_local.runtime_types import Finished, TextDelta
from fmoe_local.stats import RequestStats


def _final(text: str, reason: str = "stop") -> Finished:
    return Finished(text, list(range(len(text))), RequestStats(finish_reason=reason), reason)


def test_every_iteration_sees_the_request_from_its_first_event():
    handle = RequestHandle()
    assert handle.claim()
    handle.publish(TextDelta("Once", 1))
    late = iter(handle)
    assert next(late) == TextDelta("Once", 1)  # a reader that comes later still sees the start
    handle.publish(TextDelta(" upon", 2))
    handle.finish(_final("Once upon"))
    assert [e.text for e in late] == [" upon", "Once upon"]
    assert [e.text for e in handle] == ["Once", " upon", "Once upon"]
    assert handle.result(timeout=0).text == "Once upon"
    handle.publish(TextDelta("after the end", 3))  # ignored: the request has ended
    assert not handle.finish(_final("again"))
    assert len(list(handle)) == 3


def test_a_sync_reader_waits_on_the_producer_without_a_timeout():
    handle = RequestHandle()
    handle.claim()
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(handle))
    reader.start()
    handle.publish(TextDelta("a", 1))
    handle.finish(_final("a"))
    reader.join(5)
    assert not reader.is_alive() and [e.text for e in got] == ["a", "a"]


def test_an_async_reader_is_woken_by_the_producer_s_thread_and_can_be_cancelled():
    async def main() -> None:
        handle = RequestHandle()
        handle.claim()

        async def read() -> list[str]:
            return [e.text async for e in handle]

        task = asyncio.create_task(read())
        await asyncio.sleep(0)  # the reader waits on its future, not on a poll
        loop = asyncio.get_running_loop()
        producer = threading.Thread(target=lambda: (handle.publish(TextDelta("x", 1)), handle.finish(_final("x"))))
        await loop.run_in_executor(None, lambda: (producer.start(), producer.join()))
        assert await asyncio.wait_for(task, 5) == ["x", "x"]

        waiting = RequestHandle()
        waiting.claim()
        gone = asyncio.create_task(_drain(waiting))
        await asyncio.sleep(0)
        gone.cancel()  # a client that went away: the reader leaves; the producer can still publish
        with pytest.raises(asyncio.CancelledError):
            await gone
        waiting.publish(TextDelta("y", 2))
        waiting.finish(_final("y"))

    asyncio.run(main())


async def _drain(handle: RequestHandle) -> list:
    return [e async for e in handle]


def test_cancel_while_queued_ends_at_once_and_the_producer_does_not_run_it():
    handle = RequestHandle(on_cancel=lambda h: pytest.fail("a queued request has nothing running to interrupt"))
    handle.cancel()
    final = handle.result(timeout=0)
    assert final.reason == "cancelled" and final.text == "" and handle.cancelled and handle.stop.is_set()
    assert not handle.claim()  # its turn comes: it is not run


def test_cancel_while_running_sets_the_stop_flag_and_asks_the_runtime_to_interrupt():
    asked: list = []
    handle = RequestHandle(on_cancel=asked.append)
    assert handle.claim()
    handle.cancel()
    assert handle.stop.is_set() and asked == [handle] and not handle.done  # it ends when the token loop sees it
    handle.finish(_final("", "cancelled"))
    handle.cancel()  # once ended: nothing
    assert asked == [handle]


def test_done_callbacks_run_before_any_waiter_wakes_and_late_ones_at_once():
    handle = RequestHandle()
    handle.claim()
    saved = threading.Event()
    seen_by_waiter: list[bool] = []

    def save(final: Finished) -> None:
        assert not handle.done  # waiters cannot see the end yet
        saved.set()

    handle.add_done_callback(save)
    waiter = threading.Thread(target=lambda: seen_by_waiter.append((handle.result(), saved.is_set())[1]))
    waiter.start()
    handle.add_done_callback(lambda final: 1 / 0)  # a failing callback is logged; the waiters still wake
    handle.finish(_final("done"))
    waiter.join(5)
    assert seen_by_waiter == [True]
    late: list = []
    handle.add_done_callback(late.append)
    assert [f.text for f in late] == ["done"]


def test_a_result_that_does_not_come_in_time_is_a_sentence():
    handle = RequestHandle()
    with pytest.raises(TimeoutError, match="did not end within 0.05 s"):
        handle.result(timeout=0.05)


def test_a_late_reader_gets_what_arrived_in_one_batch():
    handle = RequestHandle()
    handle.claim()
    for i in range(3):
        handle.publish(TextDelta(str(i), i))
    batches = handle.batches()
    assert [e.text for e in next(batches)] == ["0", "1", "2"]
    handle.publish(TextDelta("3", 3))
    handle.finish(_final("0123"))
    assert [e.text for e in next(batches)] == ["3", "0123"]
    assert next(batches, None) is None


def test_a_list_waits_out_its_interval_gathering_what_arrives_and_the_end_does_not_wait():
    handle = RequestHandle()
    handle.claim()
    handle.publish(TextDelta("0", 0))
    batches = handle.batches(min_interval_s=3600.0)
    assert [e.text for e in next(batches)] == ["0"]  # the first list at once
    handle.publish(TextDelta("1", 1))
    got: list = []
    reader = threading.Thread(target=lambda: got.append(next(batches)))
    reader.start()  # it waits out the hour, unless the request ends
    handle.publish(TextDelta("2", 2))
    handle.finish(_final("012"))
    reader.join(timeout=60)
    assert [e.text for e in got[0]] == ["1", "2", "012"]


def test_a_list_comes_once_its_interval_has_passed():
    handle = RequestHandle()
    handle.claim()
    handle.publish(TextDelta("0", 0))
    batches = handle.batches(min_interval_s=0.01)
    assert [e.text for e in next(batches)] == ["0"]
    handle.publish(TextDelta("1", 1))
    assert [e.text for e in next(batches)] == ["1"]  # no end is coming: the interval's end lets it go


def test_a_negative_interval_is_refused_with_a_sentence():
    with pytest.raises(ValueError, match="min_interval_s must be 0 or more"):
        next(RequestHandle().batches(min_interval_s=-1.0))
