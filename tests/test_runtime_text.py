"""The text a request streams is its reply: what the streaming detokenizer holds back for a later id (half a
character, a short last word a tokenizer may still clean up) reaches the stream when the reply ends."""

from __future__ import annotations

from fmoe_local import runtime as runtime_module
from fmoe_local.generate import Detokenizer
from fmoe_local.runtime import Runtime
from fmoe_local.runtime_types import TextDelta
from tests.test_runtime_faults import PROMPT, _config


class _HoldsEverything(Detokenizer):
    """Holds back every delta until the end: the most a streaming detokenizer may hold."""

    def add(self, token_id: int) -> str:
        super().add(token_id)
        return ""

    def rest(self) -> str:
        return self.text


def test_what_the_detokenizer_held_back_is_streamed_at_the_end(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(runtime_module, "Detokenizer", _HoldsEverything)
    with Runtime.load(tiny_model_dir("qwen3_moe"), _config()) as runtime:
        events = list(runtime.submit(PROMPT))
    final = events[-1]
    assert final.error == "" and final.text
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert streamed == final.text  # was "": a reply's held-back end never reached the stream
