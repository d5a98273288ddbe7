"""Prefetcher: the background worker that runs the policy's matcher and copies predicted experts into the cache.

Scope: the event queue from the forward pass (iteration start, router probabilities per layer, iteration/request
end), calling the policy off the critical path, feeding the PrefetchQueue (prefetch_queue.py) and copying from it,
and yielding to on-demand loads. It does NOT choose experts (the policy does) or manage slots (the cache does).

The forward thread only appends to a queue (`publish_*`); tensors are turned into numpy here, so a GPU → host copy
never stalls the forward pass. In synchronous mode (tests, replay comparisons) the same code runs inline and every
queued prefetch completes before the forward pass goes on, which makes hit counts deterministic.

Once the cache is complete (every expert resident) nothing is left to predict: a forward pass's events are gathered
on the forward thread and reach the policy as one event at the pass's end (`_learn`), so that it keeps learning.

Failures: an exception in the policy, the map store or a prefetch copy does not end the worker. It is kept, the
pending events and prefetches are dropped, and the forward thread's next `raise_if_failed` (after every forward
pass) turns it into a `PrefetcherFailed` sentence for the running request; the engine then gives the worker a
fresh policy. Prefetching only ever speeds things up, so nothing computed before the failure is wrong.

Threads (the Offload's rule, offload.py, which alone owns a Prefetcher): `publish`, `per_layer`, `raise_if_failed`
and `wait_idle` belong to the forward thread; `set_policy` and `close` are called between requests; everything else
runs on the worker.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fmoe_local.cache import ExpertCache
from fmoe_local.policies._common import learn_pass
from fmoe_local.policies.base import Policy, Prefetch
from fmoe_local.prefetch_queue import PrefetchQueue

log = logging.getLogger(__name__)


class PrefetcherFailed(RuntimeError):
    """Prediction or a prefetch copy failed in the background; the sentence says what and what to do."""


def _to_numpy(t: torch.Tensor | np.ndarray | None) -> np.ndarray | None:
    if t is None or isinstance(t, np.ndarray):
        return t
    return t.detach().float().cpu().numpy()


@dataclass
class _Event:
    kind: str  # begin_request | begin_iteration | layer | end_iteration | end_request | pass
    iteration: int = -1
    layer: int = -1
    value: object = None  # request id, semantic embedding [h], probs [J], or a whole _Pass
    lookahead: object = None


@dataclass
class _Pass:
    """A forward pass run with every expert resident, gathered on the forward thread and handed over at its end."""

    semantic: object  # [h] or None
    layers: list[int]
    probs: list[object]  # per layer [J]


class Prefetcher:
    def __init__(self, cache: ExpertCache, policy: Policy, synchronous: bool = False) -> None:
        self.cache = cache
        self.policy = policy
        self.synchronous = synchronous
        self._events: deque[_Event] = deque()
        self._queue = PrefetchQueue(cache.host.num_layers, cache.host.num_experts)
        self._cond = threading.Condition()
        self._closed = False
        self._iteration = -1  # the forward pass now running (forward thread's view)
        self._idle = threading.Event()
        self._idle.set()
        self._pending: _Event | None = None  # synchronous mode: the last router event, not handled yet
        self._pass: _Pass | None = None  # the forward pass now running, when the cache is complete
        self._failure: BaseException | None = None  # the worker's first failure not yet reported
        self._thread: threading.Thread | None = None
        if not synchronous:
            self._thread = threading.Thread(target=self._run, name="fmoe-prefetcher", daemon=True)
            self._thread.start()

    # ---- forward thread ------------------------------------------------------------------------------------------
    def publish(self, kind: str, layer: int = -1, value: object = None, lookahead: object = None) -> None:
        event = self._event(kind, layer, value, lookahead)
        if event is None:
            return
        if self.synchronous:
            # A router's event is handled when the next event arrives, i.e. after its layer's experts ran: the
            # replay benchmark's order (access, record, observe, copies), so the two give the same hit counts.
            pending, self._pending = self._pending, None
            try:
                if pending is not None:
                    self._handle(pending)
                    self._drain_queue()
                if event.kind == "layer":
                    self._pending = event
                    return
                self._handle(event)
                self._drain_queue()
            except Exception as exc:  # noqa: BLE001 - the same sentence as from the worker
                self._fail(exc)
                self.raise_if_failed()
            return
        with self._cond:
            self._events.append(event)
            self._idle.clear()
            self._cond.notify_all()

    def _event(self, kind: str, layer: int, value: object, lookahead: object) -> _Event | None:
        """What a publish hands on after the forward pass's bookkeeping; None while a complete cache's pass is being
        gathered (it reaches the policy as one "pass" event at its end)."""
        if kind == "begin_iteration":
            self._iteration += 1
            self.cache.current_layer = -1
            self.cache.unhold()
            # Every expert resident: nothing can miss, so nothing is urgent. The pass's distributions still teach
            # the policy, in one event at its end: no per-layer wake-up, no matching while the layers run.
            self._pass = _Pass(value, [], []) if self.cache.complete else None
        if self._pass is not None:
            if kind == "layer":
                self._pass.layers.append(layer)
                self._pass.probs.append(value)
                return None
            if kind == "begin_iteration":
                return None
            if kind == "end_iteration":
                kind, value, self._pass = "pass", self._pass, None
            else:  # the request ended inside a pass: an incomplete map has nothing to teach
                self._pass = None
        return _Event(kind, self._iteration, layer, value, lookahead)

    @property
    def per_layer(self) -> bool:
        """Whether the running forward pass is handled layer by layer (False when the cache is complete)."""
        return self._pass is None

    def set_policy(self, policy: Policy) -> None:
        self.wait_idle()
        with self._cond:
            self.policy = policy
            self._queue.clear()

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until every published event was handled (between requests; never on the token path). False when
        the worker is still busy after `timeout` seconds (a copy stuck in a read)."""
        return self._idle.wait(timeout)

    def raise_if_failed(self) -> None:
        """Forward thread: raise PrefetcherFailed for a worker failure not reported yet (and forget it)."""
        with self._cond:
            failure, self._failure = self._failure, None
        if failure is not None:
            error = PrefetcherFailed(
                f"Expert prediction failed in the background ({type(failure).__name__}: {failure}), so this reply "
                "was stopped. Prediction has restarted: send the message again."
            )
            raise error from failure
        if self._thread is not None and not self._closed and not self._thread.is_alive():
            raise PrefetcherFailed("Expert prediction stopped working. Load the model again (Models tab).")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- worker --------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._step():
                    return
            except Exception as exc:  # noqa: BLE001 - kept for the request; the worker goes on
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        log.error("expert prefetcher failed", exc_info=exc)
        with self._cond:
            if self._failure is None:
                self._failure = exc
            self._events.clear()
            self._queue.clear()
            self._cond.notify_all()

    def _step(self) -> bool:
        """Handle what was published and copy one prefetch; False once closed."""
        with self._cond:
            while not self._closed and not self._events and (not self._queue or self.cache.on_demand_active):
                if not self._queue:  # no event either: the loop condition says so
                    self._idle.set()
                self._cond.wait(timeout=0.05)
            if self._closed:
                self._idle.set()
                return False
            events = list(self._events)
            self._events.clear()
        for event in events:
            self._handle(event)
        # One copy at a time, so that new router outputs are matched promptly between copies. Not while an on-demand
        # load runs: try_prefetch would refuse the popped entry and it would be lost (the router hook publishes a
        # layer just before the forward pass waits on that layer's misses, which is when its events arrive); the
        # loop above waits for the demand to end and the entry is copied then.
        if not self.cache.on_demand_active:
            self._pop_and_copy()
        return True

    def _handle(self, event: _Event) -> None:
        policy = self.policy
        if event.kind == "begin_request":
            policy.begin_request(int(event.value))
        elif event.kind == "begin_iteration":
            self._push(event.iteration, policy.begin_iteration(_to_numpy(event.value)))
        elif event.kind == "layer":
            probs = _to_numpy(event.value)
            look = _to_numpy(event.lookahead) if policy.needs_lookahead else None
            self._push(event.iteration, policy.observe_layer(event.layer, probs, look))
        elif event.kind == "end_iteration":
            policy.end_iteration()
        elif event.kind == "pass":
            self._learn(event.value)
        elif event.kind == "end_request":
            policy.end_request()
            with self._cond:
                self._queue.clear()
        else:
            raise ValueError(f"unknown prefetcher event {event.kind}")

    def _learn(self, p: _Pass) -> None:
        """Give the policy a whole pass with nothing to prefetch (policies/_common.py `learn_pass`)."""
        if not p.probs:
            return
        probs = torch.stack(p.probs).float().cpu().numpy()  # [L, J]: one transfer
        learn_pass(self.policy, probs, _to_numpy(p.semantic), p.layers)

    def _push(self, iteration: int, prefetches: Sequence[Prefetch]) -> None:
        with self._cond:
            self._queue.push(iteration, prefetches)

    def _pop_and_copy(self) -> bool:
        # Entries for a layer the forward pass already reached (or an older forward pass) are useless now.
        with self._cond:
            if not self._queue:
                return False
        claimed = self.cache.claimed_mask()  # outside our lock: the cache takes its own
        with self._cond:
            key = self._queue.pop(self._iteration, self.cache.current_layer, claimed)
        if key is None:
            return False
        self.cache.try_prefetch(*key)
        return True

    def _drain_queue(self) -> None:
        while self._pop_and_copy():
            pass
