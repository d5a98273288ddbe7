"""RequestHandle: one request's life from `Runtime.submit` to its `Finished`, the one place it is cancelled.

A caller iterates the handle synchronously (`for event in handle`, or `batches()`) or asynchronously (`async for
event in handle`): `TextDelta` events, then one `Finished`. Every iteration starts from the request's first event (the handle keeps
them), so a chat page that comes back to a reply still being written shows it whole. `cancel()` ends the request
within a token, or at once while it still waits for its turn; `result()` waits for the `Finished`.

Threads: one producer (the runtime's worker; a test's fake runtime) calls `claim`, `publish` and `finish`; any
thread may iterate, cancel or wait. The events, the final event and the waiters are guarded by `_cond`. No wait
polls: the producer wakes sync waiters through the condition and async ones through their event loop
(`call_soon_threadsafe`); no wait is unbounded, because the runtime's worker ends every handle it was given, even
when it ends itself (runtime.py, `_serve`'s `finally`). Done callbacks run on the thread that ends the request,
before any waiter sees the `Finished`, so what they record (a chat saved) is there when a waiter looks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from fmoe_local.runtime_types import Finished, TextDelta
from fmoe_local.stats import RequestStats

log = logging.getLogger(__name__)
Event = TextDelta | Finished


def cancelled_in_queue() -> Finished:
    """The end of a request cancelled before it ran: nothing was generated."""
    return Finished("", [], RequestStats(finish_reason="cancelled"), "cancelled")


class RequestHandle:
    def __init__(self, on_cancel: Callable[[RequestHandle], None] = lambda handle: None, behind: bool = False) -> None:
        # When submitted, another request was running or waiting ahead of this one (a snapshot: a page says it waits).
        self.behind = behind
        # Set by cancel() or by the runtime's close(); the token loop checks it before every forward pass.
        self.stop = threading.Event()
        self._on_cancel = on_cancel  # the runtime's part: interrupt a wait for an expert if this request runs
        self._cond = threading.Condition()
        self._events: list[TextDelta] = []
        self._final: Finished | None = None
        self._ending = False  # finish() has begun (its callbacks run): later finishes are ignored
        self._started = False
        self._cancelled = False
        self._callbacks: list[Callable[[Finished], None]] = []
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    # ---- consumers (any thread) ----------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        """The request has had its turn (False while it waits behind another one)."""
        return self._started

    @property
    def cancelled(self) -> bool:
        """cancel() was called: the request's owner ended it. A request the runtime's close() ended is not."""
        return self._cancelled

    @property
    def done(self) -> bool:
        return self._final is not None

    def cancel(self) -> None:
        """End the request: within a token while it runs, at once while it waits for its turn; nothing once ended."""
        with self._cond:
            if self._ending:
                return
            self._cancelled = True
            queued = not self._started
            if queued:
                self._ending = True  # the worker's claim() now refuses it
        self.stop.set()
        if queued:
            self._end(cancelled_in_queue())
        else:
            self._on_cancel(self)

    def add_done_callback(self, fn: Callable[[Finished], None]) -> None:
        """Call fn(final) once the request ends (at once if it has): on the thread that ends it, before waiters
        wake. fn must not raise or wait long: the runtime's worker runs it between two requests."""
        with self._cond:
            if self._final is None:
                self._callbacks.append(fn)
                return
            final = self._final
        _call(fn, final)

    def result(self, timeout: float | None = None) -> Finished:
        """The final event. `timeout` None waits until the request ends, which the worker guarantees (its end ends
        every handle); TimeoutError after `timeout` seconds otherwise."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._final is not None, timeout):
                raise TimeoutError(f"The request did not end within {timeout:g} s. Cancel it, or wait longer.")
            return self._final

    def __iter__(self) -> Iterator[Event]:
        for batch in self.batches():
            yield from batch

    def batches(self, min_interval_s: float = 0.0) -> Iterator[list[Event]]:
        """The events in lists of whatever has arrived since the last one (the last list ends with the Finished): a
        reader that comes late, or is slower than the model, redraws once per list instead of once per token.

        `min_interval_s`: after a list, the next one waits until that long after it (or the end, which never waits),
        so a reader that redraws per list redraws at most 1 / min_interval_s times a second however fast the model
        writes. The first list comes as soon as there is anything."""
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be 0 or more, not {min_interval_s}.")
        seen, due = 0, 0.0
        while True:
            with self._cond:
                self._cond.wait_for(lambda n=seen: len(self._events) > n or self._final is not None)
                wait = due - time.monotonic()
                if wait > 0:
                    self._cond.wait_for(lambda: self._final is not None, wait)
                batch, final = self._events[seen:], self._final
            seen += len(batch)
            if final is not None:  # nothing is published after the final event: the batch holds the rest
                yield [*batch, final]
                return
            due = time.monotonic() + min_interval_s
            yield batch

    async def __aiter__(self) -> AsyncIterator[Event]:
        loop = asyncio.get_running_loop()
        seen = 0
        while True:
            with self._cond:
                batch, final = self._events[seen:], self._final
                woken = None
                if not batch and final is None:
                    woken = loop.create_future()
                    self._wakers.append((loop, woken))
            if woken is not None:
                await woken  # a cancelled task (a client gone) leaves here with CancelledError
                continue
            for event in batch:
                yield event
            seen += len(batch)
            if final is not None:
                yield final
                return

    # ---- the producer (the runtime's worker) ---------------------------------------------------------------------
    def claim(self) -> bool:
        """The request's turn has come: False if it was cancelled (or ended) while it waited, so it is not run."""
        with self._cond:
            if self._ending:
                return False
            self._started = True
            return True

    def publish(self, event: TextDelta) -> None:
        with self._cond:
            if self._final is not None:
                return
            self._events.append(event)
            self._cond.notify_all()
            wakers, self._wakers = self._wakers, []
        _wake(wakers)

    def finish(self, final: Finished) -> bool:
        """End the request with `final` (callbacks first, then the waiters); False if it had already ended."""
        with self._cond:
            if self._ending:
                return False
            self._ending = True
        self._end(final)
        return True

    # ---- internals -----------------------------------------------------------------------------------------------
    def _end(self, final: Finished) -> None:
        with self._cond:
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _call(fn, final)
        with self._cond:
            self._final = final
            self._cond.notify_all()
            wakers, self._wakers = self._wakers, []
            later, self._callbacks = self._callbacks, []  # added while the first ones ran
        _wake(wakers)
        for fn in later:
            _call(fn, final)


def _call(fn: Callable[[Finished], None], final: Finished) -> None:
    try:
        fn(final)
    except Exception:  # noqa: BLE001 - a callback's failure must not keep the request's waiters from waking
        log.exception("a request's done callback failed")


def _wake(wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
    for loop, future in wakers:
        try:
            loop.call_soon_threadsafe(_resolve, future)
        except RuntimeError:  # that event loop has closed (the server stopped): nobody waits there any more
            pass


def _resolve(future: asyncio.Future) -> None:
    if not future.done():  # a waiter cancelled meanwhile (its client went away)
        future.set_result(None)
