"""What the UI uses of the loaded model: the members of fmoe_local.runtime.Runtime that ui/ calls, and no other.

Scope: the one interface between the UI and the runtime, as a Protocol. `Session.runtime` holds a Runtime typed as
this; the UI's tests hold a fake (tests/fake_runtime.py). tests/test_ui_loaded_runtime.py checks that Runtime and
every fake have each member with the same parameters, and that ui/ reads nothing of a runtime that is not here, so a
fake cannot drift from the real interface and the UI cannot reach past it (Runtime.engine, for one).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fmoe_local.config import RuntimeConfig, Sampling
    from fmoe_local.dtype_verdicts import DtypeVerdicts
    from fmoe_local.miss_cost import MissCosts
    from fmoe_local.request_handle import RequestHandle
    from fmoe_local.runtime_types import ModelInfo


class ReplyReader(Protocol):
    """transformers' streaming response parser, as the UI uses it: `feed` a reply's text as it comes, for its events
    ({"type": "region_open" | "region_chunk" | "region_close", "field": ..., "text": ...}); `finalize` at its end, for
    the message dict and the last events. Either may raise on a malformed reply."""

    def feed(self, text: str) -> list[dict]: ...

    def finalize(self) -> tuple[dict, list[dict]]: ...


class LoadedRuntime(Protocol):
    @property
    def info(self) -> ModelInfo:
        """The model and the settings in force (header, Settings and Stats tabs, the API's model list)."""
        ...

    @property
    def config(self) -> RuntimeConfig: ...

    @property
    def dtype_verdicts(self) -> DtypeVerdicts:
        """What `dtype` auto decided with at load; the session saves it for the next load on this machine."""
        ...

    @property
    def miss_costs(self) -> MissCosts:
        """Measured at load; the session saves them for the next load of this model."""
        ...

    @property
    def miss_explanation(self) -> str: ...

    @property
    def load_notice(self) -> str: ...

    @property
    def context_length(self) -> int | None:
        """The most tokens the model reads (a chat's context length is checked against it); None when unknown."""
        ...

    @property
    def chat_template(self) -> str | None: ...

    def submit(
        self,
        prompt: list[dict] | str,
        sampling: Sampling | None = None,
        tools: list[dict] | None = None,
        keep: frozenset[str] = frozenset(),
        variables: dict | None = None,
    ) -> RequestHandle: ...

    def check(
        self, prompt: list[dict] | str, tools: list[dict] | None = None, variables: dict | None = None
    ) -> int | None: ...

    def special_tokens(self, texts: Iterable[str] | None = None) -> dict[str, int]:
        """Which of `texts` are the tokenizer's special tokens (a tool-call format's markers): what `keep` keeps."""
        ...

    @property
    def response_template(self) -> dict | None: ...

    def reply_reader(self, tools: list[dict], prefix: str | None = None) -> ReplyReader | None:
        """A reader of one reply by the checkpoint's response template; None without one."""
        ...

    def supports_tools(self) -> bool: ...

    def reply_opening(self) -> str: ...

    def check_grammar(self, grammar: str, schema: dict | None = None, where: str = "schema") -> None: ...

    def reconfigure(
        self,
        cache_gb: float | None = None,
        cache_experts: int | None = None,
        prefetch_distance: int | None = None,
        policy: str | None = None,
        store_capacity: int | None = None,
        miss_handling: str | None = None,
    ) -> RuntimeConfig: ...

    def clear_maps(self) -> None: ...

    def close(self) -> None: ...
