"""A stand-in for fmoe_local.runtime.Runtime in the UI's tests: the same interface, the real RequestHandle.

A fake says what a request yields in `events(prompt, sampling, stop)` (TextDelta events, then one Finished, reading
`stop` as the token loop does); `submit` runs it on a worker thread of the fake's own, one request at a time, exactly
as the real worker feeds a handle (claim, publish, finish), so the UI meets the real lifecycle: queueing, cancel
while queued or running, done callbacks before waiters wake.

Every member of ui.loaded_runtime.LoadedRuntime is here (tests/test_ui_loaded_runtime.py checks it, with the same
parameters as Runtime's); what a test does not give a fake raises NotImplementedError, so a test that needs it says so
instead of reading a made-up value.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace

from fmoe_local.request_handle import RequestHandle
from fmoe_local.runtime_types import Finished, TextDelta


def _missing(what: str) -> NotImplementedError:
    return NotImplementedError(f"This fake runtime has no {what}: give the test's fake one.")


class FakeRuntime:
    info = SimpleNamespace(name="fake-moe")
    opening = ""  # reply_opening's answer
    context_length: int | None = None  # the model's maximum: a fake says none

    def __init__(self) -> None:
        self.turn = threading.Lock()

    def events(self, prompt, sampling, stop: threading.Event) -> Iterator[TextDelta | Finished]:  # noqa: ANN001
        raise NotImplementedError

    # ---- ui.loaded_runtime.LoadedRuntime ---------------------------------------------------------------------------
    @property
    def config(self):  # noqa: ANN201
        raise _missing("config")

    @property
    def dtype_verdicts(self):  # noqa: ANN201
        raise _missing("dtype verdicts")

    @property
    def miss_costs(self):  # noqa: ANN201
        raise _missing("miss costs")

    @property
    def miss_explanation(self) -> str:
        raise _missing("miss explanation")

    @property
    def load_notice(self) -> str:
        raise _missing("load notice")

    @property
    def chat_template(self) -> str | None:
        raise _missing("chat template")

    def check(self, prompt, tools=None, variables=None) -> int | None:  # noqa: ANN001
        return None  # as the real runtime when it cannot tell: the request's handle gives the verdict

    def special_tokens(self, texts=None) -> dict[str, int]:  # noqa: ANN001
        return {}  # a tokenizer without special tokens: no tool-call format's markers to keep

    @property
    def response_template(self) -> dict | None:
        return None  # as a checkpoint that ships none

    def reply_reader(self, tools, prefix=None):  # noqa: ANN001, ANN201
        return None  # what Runtime.reply_reader answers without a response template

    def submit(self, prompt, sampling=None, tools=None, keep=frozenset(), variables=None) -> RequestHandle:  # noqa: ANN001
        handle = RequestHandle(behind=self.turn.locked())
        threading.Thread(target=self._serve, args=(handle, prompt, sampling), name="fake-runtime", daemon=True).start()
        return handle

    def supports_tools(self) -> bool:
        raise _missing("tool support")

    def reply_opening(self) -> str:
        """What the template writes to open a reply: a fake whose replies start inside a thought says "<think>\n"."""
        return self.opening

    def check_grammar(self, grammar, schema=None, where="schema") -> None:  # noqa: ANN001
        raise _missing("grammar check")

    def reconfigure(
        self,
        cache_gb=None,  # noqa: ANN001
        cache_experts=None,  # noqa: ANN001
        prefetch_distance=None,  # noqa: ANN001
        policy=None,  # noqa: ANN001
        store_capacity=None,  # noqa: ANN001
        miss_handling=None,  # noqa: ANN001
    ):  # noqa: ANN201
        raise _missing("settings to change")

    def clear_maps(self) -> None:
        raise _missing("expert maps")

    def close(self) -> None:
        raise _missing("close")

    # ---- the fake's worker ---------------------------------------------------------------------------------------
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
