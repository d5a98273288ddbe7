"""A stand-in for fmoe_local.runtime.Runtime in the UI's tests: the same interface, the real RequestHandle.

A fake says what a request yields in `events(prompt, sampling, stop)` (TextDelta events, then one Finished, reading
`stop` as the token loop does); `submit` runs it on a worker thread of the fake's own, one request at a time, exactly
as the real worker feeds a handle (claim, publish, finish), so the UI meets the real lifecycle: queueing, cancel
while queued or running, done callbacks before waiters wake.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace

from fmoe_local.request_handle import RequestHandle
from fmoe_local.runtime_types import Finished, TextDelta


class FakeRuntime:
    info = SimpleNamespace(name="fake-moe")
    opening = ""  # reply_opening's answer
    context_length: int | None = None  # the model's maximum: a fake says none

    def __init__(self) -> None:
        self.turn = threading.Lock()

    def events(self, prompt, sampling, stop: threading.Event) -> Iterator[TextDelta | Finished]:  # noqa: ANN001
        raise NotImplementedError

    def check(self, prompt) -> int | None:  # noqa: ANN001
        return None

    def reply_opening(self) -> str:
        """What the template writes to open a reply: a fake whose replies start inside a thought says "<think>\n"."""
        return self.opening

    def submit(self, prompt, sampling=None) -> RequestHandle:  # noqa: ANN001
        handle = RequestHandle(behind=self.turn.locked())
        threading.Thread(target=self._serve, args=(handle, prompt, sampling), name="fake-runtime", daemon=True).start()
        return handle

    def _serve(self, handle: RequestHandle, prompt, sampling) -> None:  # noqa: ANN001
        with self.turn:
            if not handle.claim():
                return
            try:
                for event in self.events(prompt, sampling, handle.stop):
                    if isinstance(event, Finished):
                        handle.finish(event)
                        return
                    handle.publish(event)
            finally:
                handle.finish(Finished.failed("The fake runtime ended this request without a Finished."))
