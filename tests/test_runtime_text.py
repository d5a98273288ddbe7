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


def test_a_request_keeps_the_special_tokens_it_asks_for_and_no_other(tiny_model_dir):
    """A tool-call parser reads markers that are special tokens (Mistral's [TOOL_CALLS], GPT-OSS's <|call|>): the
    request that names them gets them in its text; any other request's text leaves them out, as before."""
    from dataclasses import replace

    with Runtime.load(tiny_model_dir("qwen3_moe"), _config()) as runtime:
        user = runtime._engine.tokenizer.convert_tokens_to_ids("<|user|>")
        forced = replace(runtime.config.sampling, greedy=True, max_new_tokens=3, logit_bias=((user, 100.0),))
        kept = list(runtime.submit(PROMPT, forced, keep=frozenset({"<|user|>"})))
        plain = list(runtime.submit(PROMPT, forced))
    assert kept[-1].text == "<|user|>" * 3 == "".join(e.text for e in kept if isinstance(e, TextDelta))
    assert plain[-1].token_ids == kept[-1].token_ids == [user] * 3 and plain[-1].text == ""
