"""Moving one expert from the host store into a cache slot, and the landing that says when (or whether) it arrived.

Scope: the copy itself (chunked: a plain copy on CPU; on CUDA straight from a page-locked host expert, or
through two pinned staging buffers in rotation, on a copy stream with events, behind `CudaStreams` so tests can
fake them), a `Landing` per
load that waiters block on with a deadline and an interrupt, and the loader thread that runs the forward pass's
on-demand loads. It does NOT choose slots or count hits (cache.py owns residency).

Why demand loads run on a thread of their own: a host read can block (a slow or failing disk tier) and the forward
thread must still notice Stop within a fraction of a second and give up, instead of sitting inside the read. The
read goes on in the background and settles its slot when it ends.

Threads: `Loader.submit` is called by the forward thread (cache.acquire); the loader thread runs `job()`; a
Landing is set once, by whichever thread ran its load, and read by any thread. `Copier.copy` runs on the loader
and prefetcher threads, each with its own copy stream and staging buffers; the forward thread never calls it and
never waits on a copy's event on the host (on CUDA a landing means "issued": the compute stream waits for the
event).

Why three more rules on CUDA: issuing a DMA takes microseconds and running it milliseconds, so a pause between two
chunks means nothing unless the link is really free. Each copying thread copies on a stream of its own, so a demand
copy queues behind nothing the prefetcher issued and the compute stream never waits for a prefetch it does not use;
a prefetch keeps at most IN_FLIGHT (2) chunks on its stream (its thread waits for the older chunk's event); and its
pause (cache._give_way) also waits for the last demand copy's event, so a demand copy has the link to itself. A
copy into a slot waits for the slot's previous copy event and its last reader (`last_use`). `land` (a host store's
device layout, packed_host.PackedHostStore.land) runs after the last chunk on the same stream, before the copy's
event is recorded.
"""

from __future__ import annotations

import collections
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
        # Set (under the cache's lock) when every access waiting for this load gave up (Stop): a load not started
        # yet is then skipped, so a stopped request's leftover reads do not hold up the next request's.
        self.abandoned = False
        self.job: object | None = None  # the Loader's token of an on-demand load (None: a prefetch's own thread)
        self.copying = False  # set (under the cache's lock) once the read returned and the copy began

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


class CudaStreams:
    """The few CUDA operations the copier and the cache use, behind one object so that tests can run the very same
    code with a fake (tests/fake_streams.py) on a machine without a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self) -> object:
        return torch.cuda.Stream(device=self.device)

    def current(self) -> object:
        return torch.cuda.current_stream(self.device)

    def event(self) -> object:
        return torch.cuda.Event()

    def use(self, stream: object) -> object:
        return torch.cuda.stream(stream)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8).pin_memory()

    def register(self, block: torch.Tensor) -> None:
        """Page-lock a block of host memory in place (cudaHostRegister), so copies from it need no staging."""
        nbytes = block.numel() * block.element_size()
        error = int(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, 0))
        if error:
            raise RuntimeError(f"cudaHostRegister of {nbytes >> 20} MB failed with CUDA error {error}")

    def unregister(self, block: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(block.data_ptr())

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()


class _Staging:
    """One pinned buffer and the event of the last copy out of it (None: free)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.event: object | None = None


class Copier:
    """Moves one expert from the host store into a slot, in chunks of `chunk_bytes`.

    CPU: a plain copy per chunk. CUDA: each copying thread (loader, prefetcher) has a copy stream of its own; a
    chunk of a page-locked host expert (host.pin) is copied straight from it with `non_blocking`, nobody waiting;
    any other chunk is staged into one of two pinned buffers in rotation and copied the same way, the host waiting
    only for the event of the buffer it is about to refill (on the copying thread, never the forward thread). The
    slot gets the copy's final event, which the compute stream waits on (cache.before_use) — no thread waits for
    the whole copy.

    Chunks are where a prefetch gives way: `copy(..., pause=...)` calls `pause()` before every chunk after the
    first, and the cache's pause waits while an on-demand load is running, so a demand load overtakes a prefetch
    within one chunk instead of queueing behind the whole expert. On CUDA that needs two things, since issuing a
    copy takes microseconds and the DMA milliseconds: a prefetch keeps at most `IN_FLIGHT` chunks queued on its
    stream (its thread waits for the older one's event first), and demand loads go on the loader's own stream, so
    they queue behind nothing the prefetcher issued and the compute stream never waits for a prefetch it does not
    use. A slot's next copy waits for the events of its previous occupant's copy (if never used) and last reader.
    """

    IN_FLIGHT = 2  # prefetch chunks queued on the copy engine at once: a demand load waits behind at most these

    def __init__(self, device: torch.device, chunk_bytes: int = 32 * 1024**2, streams: object | None = None) -> None:
        if chunk_bytes < 1:
            raise ValueError("The copy chunk must be at least one byte.")
        self.chunk_bytes = chunk_bytes
        self.streams = streams if streams is not None else (CudaStreams(device) if device.type == "cuda" else None)
        self.cuda = self.streams is not None
        self._local = threading.local()  # per copying thread (loader, prefetcher): its stream and two buffers

    def stream(self) -> object | None:
        """The calling thread's copy stream (created on its first copy); None on the CPU."""
        if not self.cuda:
            return None
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = self.streams.stream()
        return stream

    def copy(
        self,
        slot: object,
        dst: dict[str, torch.Tensor],
        index: int,
        src: dict[str, torch.Tensor],
        pause: Callable[[], None] | None = None,
        land: Callable[[dict[str, torch.Tensor]], None] | None = None,
    ) -> None:
        """`slot` carries `last_use` (event of the last kernel reading it) and receives `copy_event`. `land(rows)`
        rewrites the landed slot rows in place (the host store's layout for the device), after the last chunk and
        on the same copy stream, so that `copy_event` covers it and readers never see the bytes half-rewritten."""
        for name, t in src.items():
            want = tuple(dst[name].shape[1:])
            if tuple(t.shape) != want:
                raise ValueError(
                    f"An expert's {name} has shape {tuple(t.shape)} in the model files, not {want}. "
                    "The files do not match the model's config.json: download the model again."
                )
        queued: collections.deque = collections.deque()  # events of this prefetch's chunks still on the engine
        for k, (to, frm) in enumerate(self.chunks(dst, index, src)):
            if k and pause is not None:
                while self.cuda and len(queued) >= self.IN_FLIGHT:
                    queued.popleft().synchronize()  # the copying thread waits, so that pause() below is timely
                pause()
            if self.cuda:
                pinned = self.streams.is_pinned(frm)
                done = self._issue(slot, k == 0, to, *((frm, None) if pinned else self._stage(frm)))
                if pause is not None:
                    queued.append(done if done is not None else self._record())
            else:
                to.copy_(frm)
        if land is not None:
            rows = {name: dst[name][index] for name in src}
            if self.cuda:
                with self.streams.use(self.stream()):
                    land(rows)
            else:
                land(rows)
        if self.cuda:
            slot.copy_event = self._record()

    def chunks(
        self, dst: dict[str, torch.Tensor], index: int, src: dict[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) flat pieces of at most `chunk_bytes` (at least one element), in order."""
        out = []
        for name, t in src.items():
            to = dst[name][index].reshape(-1)  # a slot row is contiguous: a view
            frm = t.reshape(-1)
            step = max(1, self.chunk_bytes // max(1, t.element_size()))
            out += [(to[a : a + step], frm[a : a + step]) for a in range(0, frm.numel(), step)]
        return out

    def _stage(self, frm: torch.Tensor) -> tuple[torch.Tensor, _Staging]:
        """`frm` copied into the next staging buffer, once that buffer's previous DMA is done."""
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            size = max(self.chunk_bytes, 16)  # a chunk is at least one element
            buffers = [_Staging(self.streams.pinned(size)) for _ in range(2)]
            self._local.buffers, self._local.turn = buffers, 0
        staging = buffers[self._local.turn]
        self._local.turn ^= 1
        if staging.event is not None:
            staging.event.synchronize()  # its previous DMA must be done before it is refilled (copying thread)
        nbytes = frm.numel() * frm.element_size()
        staged = staging.buffer[:nbytes].view(frm.dtype)
        staged.copy_(frm)
        return staged, staging

    def _issue(
        self, slot: object, first: bool, to: torch.Tensor, frm: torch.Tensor, staging: _Staging | None = None
    ) -> object | None:
        """The DMA of one chunk from page-locked `frm` (a staging buffer's, or a pinned host expert's), on this
        thread's copy stream; a staging buffer gets the DMA's event (returned), which its next refill waits for."""
        stream = self.stream()
        with self.streams.use(stream):
            if first:
                # The slot's previous occupant: its copy (issued on another thread's stream, and never waited for
                # if it was evicted unused) and its last reader must both be done before it is overwritten.
                for before in (slot.copy_event, slot.last_use):
                    if before is not None:
                        stream.wait_event(before)
            to.copy_(frm, non_blocking=True)
            if staging is None:
                return None
            staging.event = self._record()
            return staging.event

    def _record(self) -> object:
        """An event recorded now on this thread's copy stream."""
        event = self.streams.event()
        event.record(self.stream())
        return event


class Loader:
    """A background thread running load jobs in order (the forward pass's on-demand loads, the CPU path's disk reads).

    A job stuck in a read (a failing disk, a hung network mount) must not hold up the jobs queued behind it: when its
    waiter gives up (`abandon`: its deadline passed, or Stop), the stuck job keeps its thread, which ends once the
    read returns, and a fresh thread takes the queue. A timeout therefore always names the read that hung: nothing
    queues behind a read its waiter gave up on. Threads: `submit`, `abandon` and `close` from any thread; jobs run
    on the loader's threads.
    """

    def __init__(self, name: str = "fmoe-loader") -> None:
        self._name = name
        self._jobs: queue.Queue[tuple[object, Callable[[], None]] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._running: object | None = None  # the token of the job the current thread runs
        self.abandoned: list[threading.Thread] = []  # threads left to a stuck job (daemons, ending when it returns)
        self._thread = self._start()

    def _start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        thread.start()
        return thread

    def submit(self, job: Callable[[], None]) -> object:
        """Queue `job` (it must never raise: it settles its own Landing); returns its token for `abandon`."""
        token = object()
        self._jobs.put((token, job))
        return token

    def abandon(self, token: object) -> bool:
        """If the job of `token` is running now, leave its thread to it and start a fresh one for the rest of the
        queue; returns whether it was running. A job not started yet stays queued (its own code skips it)."""
        with self._lock:
            if self._running is not token:
                return False
            self._running = None
            self.abandoned.append(self._thread)
            self._thread = self._start()
            return True

    def close(self, timeout: float = 1.0) -> None:
        """Ends the thread after the queued jobs; gives up waiting for a job stuck in a read after `timeout` (the
        thread is a daemon and ends with it)."""
        self._jobs.put(None)
        thread = self._thread
        if thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            item = self._jobs.get()
            if item is None:
                return
            token, job = item
            with self._lock:
                self._running = token
            job()
            with self._lock:
                if self._thread is not me:  # abandoned while the job was stuck: the fresh thread has the queue
                    return
                self._running = None
