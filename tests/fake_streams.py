"""A stand-in for copier.CudaStreams: the cache's and the copier's CUDA logic runs on CPU tensors, and every stream
operation is logged with the thread that made it, so tests can check who waits for what."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch


class FakeEvent:
    def __init__(self, log: list, number: int) -> None:
        self.log, self.number, self.stream = log, number, None

    def record(self, stream: object) -> None:
        self.stream = stream
        self.log.append(("record", self.number, stream.name, threading.current_thread().name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.number, threading.current_thread().name))

    def __repr__(self) -> str:
        return f"event{self.number}"


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.number, threading.current_thread().name))


class FakeStreams:
    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._using = threading.local()
        self.compute = FakeStream("compute", self.log)
        self._events = 0
        self._streams = 0
        self.registered: list[tuple[int, int]] = []  # [start, end) of each "page-locked" block
        self._lock = threading.Lock()

    def stream(self) -> FakeStream:
        """Copy streams are named "copy", "copy2", "copy3"… in the order they are made."""
        with self._lock:
            self._streams += 1
            return FakeStream("copy" if self._streams == 1 else f"copy{self._streams}", self.log)

    def current(self) -> FakeStream:
        return self.compute

    def event(self) -> FakeEvent:
        with self._lock:
            self._events += 1
            return FakeEvent(self.log, self._events)

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        before = getattr(self._using, "name", None)
        self._using.name = stream.name
        try:
            yield
        finally:
            self._using.name = before

    def in_use(self) -> str | None:
        """The stream the calling thread issues work on now (`use`), or None for the current one."""
        return getattr(self._using, "name", None)

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.log.append(("pinned", nbytes, threading.current_thread().name))
        return torch.empty(nbytes, dtype=torch.uint8)

    def register(self, block: torch.Tensor) -> None:
        """Pretend to page-lock `block`: copies from inside it count as pinned from now on."""
        start = block.data_ptr()
        self.registered.append((start, start + block.numel() * block.element_size()))

    def unregister(self, block: torch.Tensor) -> None:
        self.registered.remove((block.data_ptr(), block.data_ptr() + block.numel() * block.element_size()))

    def is_pinned(self, t: torch.Tensor) -> bool:
        at = t.data_ptr()
        return any(a <= at < b for a, b in self.registered)

    def by_thread(self, op: str, thread: str) -> list[tuple]:
        return [e for e in self.log if e[0] == op and e[-1] == thread]
