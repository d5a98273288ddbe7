"""Moving one expert from the host store into a cache slot, and the landing that says when (or whether) it arrived.

Scope: the copy itself (a plain copy on CPU; pinned staging, a copy stream and an event on CUDA), a `Landing` per
load that waiters block on with a deadline and an interrupt, and the loader thread that runs the forward pass's
on-demand loads. It does NOT choose slots or count hits (cache.py owns residency).

Why demand loads run on a thread of their own: a host read can block (a slow or failing disk tier) and the forward
thread must still notice Stop within a fraction of a second and give up, instead of sitting inside the read. The
read goes on in the background and settles its slot when it ends.

Threads: `Loader.submit` is called by the forward thread (cache.acquire); the loader thread runs `job()`; a
Landing is set once, by whichever thread ran its load, and read by any thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

_POLL_S = 0.05  # how often a waiter looks at its interrupt flag


class Interrupted(RuntimeError):
    """The wait was given up because the user stopped the request (or the model is closing)."""


class LoadTimeout(RuntimeError):
    pass


class Landing:
    """One load into one slot: done when the weights are there, or when the load failed (`error`)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def is_set(self) -> bool:
        return self._done.is_set()

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def wait_until(self, deadline: float, interrupt: threading.Event, what: str) -> None:
        """Block until landed; raise its load error, `Interrupted` when `interrupt` is set, `LoadTimeout` past
        `deadline` (a perf_counter time). Never waits unbounded."""
        while not self._done.wait(_POLL_S):
            if interrupt.is_set():
                raise Interrupted("Stopped while waiting for an expert to load.")
            if time.perf_counter() > deadline:
                raise LoadTimeout(
                    f"Loading {what} took too long. The disk or the model files may be failing; "
                    "check the disk, or download the model again."
                )
        if self.error is not None:
            raise self.error


class Copier:
    """Moves one expert from the host store into a slot: a plain copy on CPU, a copy stream + events on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        # One pinned staging set per thread (loader thread, prefetcher thread), reused: pinning is expensive, and
        # only staging is pinned because pinning every expert exhausts consumer machines' RAM.
        self._staging = threading.local()

    def copy(self, slot: object, dst: dict[str, torch.Tensor], index: int, src: dict[str, torch.Tensor]) -> None:
        """`slot` carries `last_use` (CUDA event of the last kernel reading it) and receives `copy_event`."""
        for name, t in src.items():
            want = tuple(dst[name].shape[1:])
            if tuple(t.shape) != want:
                raise ValueError(
                    f"An expert's {name} has shape {tuple(t.shape)} in the model files, not {want}. "
                    "The files do not match the model's config.json: download the model again."
                )
        if not self.cuda:
            for name, t in src.items():
                dst[name][index].copy_(t)
            return
        # Pinned staging so the DMA is truly asynchronous; the copy stream first waits for the last kernels that
        # read this slot's previous occupant.
        staged = getattr(self._staging, "buffers", None)
        if staged is None:
            staged = {name: torch.empty_like(t, device="cpu").pin_memory() for name, t in src.items()}
            self._staging.buffers = staged
        for name, t in src.items():
            staged[name].copy_(t)
        with torch.cuda.stream(self.stream):
            if slot.last_use is not None:
                self.stream.wait_event(slot.last_use)
            for name, t in staged.items():
                dst[name][index].copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        slot.copy_event = event
        # The staging buffers are reused by this thread's next copy: wait for this DMA to finish first.
        event.synchronize()


class Loader:
    """One background thread running load jobs in order (the forward pass's on-demand loads)."""

    def __init__(self, name: str = "fmoe-loader") -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """`job` must never raise: it settles its own Landing (cache.py's `_load` does)."""
        self._jobs.put(job)

    def close(self, timeout: float = 1.0) -> None:
        """Ends the thread after the queued jobs; gives up waiting for a job stuck in a read after `timeout` (the
        thread is a daemon and ends with it)."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()
