"""Engine.encode_prompt and Runtime.tokenize: a final assistant message is continued (the chat's Continue), not
answered, inside its thought when it has only that; a prompt too long for the model is refused in a sentence naming the model as people know it."""

from __future__ import annotations

import pytest
import torch

from fmoe_local.config import RuntimeConfig
from fmoe_local.runtime import Runtime


def test_a_final_assistant_message_is_continued_where_it_stopped(tiny_model_dir):
    with Runtime.load(tiny_model_dir("olmoe"), RuntimeConfig(device="cpu")) as runtime:
        engine = runtime.engine
        asked = [{"role": "user", "content": "Tell me about the sea."}]
        partial = asked + [{"role": "assistant", "content": "The sea is"}]
        ids = runtime.tokenize(partial)  # what the worker encodes, on the caller's thread
        assert ids == engine.encode_prompt(partial)[0].tolist() and runtime.check(partial) == len(ids)
        text = engine.tokenizer.decode(ids)
        assert text.endswith("The sea is")  # the prompt ends inside the reply: no end of turn, no new turn
        answered = engine.tokenizer.decode(runtime.tokenize(asked))
        assert text.startswith(answered)  # the same turn the model was answering


def test_a_final_assistant_message_with_only_a_thought_is_continued_inside_the_thought(tiny_model_dir):
    """GPT-OSS's template shows a last reply's `thinking` as an analysis message: a reply cut inside its thought (no
    content yet) goes on there, where transformers' continue_final_message="thinking" ends the prompt."""
    from tests.tool_templates import HARMONY_TEMPLATE

    with Runtime.load(tiny_model_dir("olmoe"), RuntimeConfig(device="cpu")) as runtime:
        tokenizer = runtime.engine.tokenizer
        tokenizer.chat_template = HARMONY_TEMPLATE
        asked = [{"role": "user", "content": "Tell me about the sea."}]
        thought = asked + [{"role": "assistant", "content": "", "thinking": "They ask"}]
        text = tokenizer.decode(runtime.tokenize(thought))
        assert text.endswith("<|start|>assistant<|channel|>analysis<|message|>They ask")
        assert text.startswith(tokenizer.decode(runtime.tokenize(asked)).removesuffix("<|start|>assistant"))
        nothing = tokenizer.decode(runtime.tokenize(asked + [{"role": "assistant", "content": ""}]))
        assert nothing.endswith("<|start|>assistant")  # nothing to continue: a new turn, as before


def test_a_template_that_errs_on_a_conversation_refuses_its_messages(tiny_model_dir):
    """An error the template raises that is not its own refusal (here a TypeError on a message's content) refuses
    these messages as a refusal does — a 400 for an API client, a sentence in the chat — not a RuntimeError (a 500)."""
    from fmoe_local.engine import TemplateRefused

    with Runtime.load(tiny_model_dir("olmoe"), RuntimeConfig(device="cpu")) as runtime:
        runtime.engine.tokenizer.chat_template = "{{ messages[0]['content'] + 1 }}"
        with pytest.raises(TemplateRefused) as refused:
            runtime.check([{"role": "user", "content": "Tell me about the sea."}])
        assert "refuses these messages" in str(refused.value) and "TypeError" in str(refused.value)


def test_a_conversation_too_long_names_the_model_as_people_know_it(tiny_model_dir):
    from fmoe_local.demo import demo_model_dir
    from fmoe_local.engine import ContextTooLong

    too_long = [{"role": "user", "content": "the sea and the ships " * 2000}]
    tiny = tiny_model_dir("olmoe")
    for model_dir, name in ((demo_model_dir(), "the demo model"), (tiny, tiny.name)):
        with Runtime.load(model_dir, RuntimeConfig(device="cpu")) as runtime:
            with pytest.raises(ContextTooLong) as refused:
                runtime.check(too_long)
            said = str(refused.value)
            assert f"but {name} reads at most" in said, said  # before: "but weights reads at most 1,024" (its folder)


class _Counting:
    """A tokenizer that notes the length of every text it is asked to encode."""

    def __init__(self, tokenizer) -> None:  # noqa: ANN001
        self._tokenizer, self.lengths = tokenizer, []

    def __call__(self, text: str, **kwargs):  # noqa: ANN204
        self.lengths.append(len(text))
        return self._tokenizer(text, **kwargs)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._tokenizer, name)


def test_a_text_far_longer_than_the_context_is_refused_from_a_prefix(tiny_model_dir, monkeypatch):
    from fmoe_local.engine import ContextTooLong

    with Runtime.load(tiny_model_dir("olmoe"), RuntimeConfig(device="cpu")) as runtime:  # reads 512 tokens
        counting = _Counting(runtime.engine.tokenizer)
        monkeypatch.setattr(runtime.engine, "tokenizer", counting)
        pasted = "the sea and the ships " * 100_000  # 2.2 MB: was tokenized whole, ~8 s here (a 10 MB one: 42 s)
        for prompt, said in ((pasted, "This prompt"), ([{"role": "user", "content": pasted}], "This conversation")):
            with pytest.raises(ContextTooLong, match=f"{said} is over 1,024 tokens long, but .* reads at most 512"):
                runtime.check(prompt)
        assert 0 < max(counting.lengths) <= 8 * 512
        counting.lengths.clear()
        long_but_fitting = "<|assistant|>" * 400  # 13 characters a token: past the first prefix, within the context
        assert runtime.check(long_but_fitting) == len(counting._tokenizer(long_but_fitting)["input_ids"]) < 512
        assert max(counting.lengths) == len(long_but_fitting)  # counted whole after all


def test_a_checked_prompt_is_not_tokenized_again_when_it_runs(tiny_model_dir, monkeypatch):
    """An API request is checked on its caller's thread, then encoded by the worker: the conversation is tokenized
    once (a long one costs milliseconds each time), and the ids are the tokenizer's own."""
    from fmoe_local.config import Sampling
    from fmoe_local.engine import ENCODED_KEPT

    with Runtime.load(tiny_model_dir("olmoe"), RuntimeConfig(device="cpu")) as runtime:
        counting = _Counting(runtime.engine.tokenizer)
        monkeypatch.setattr(runtime.engine, "tokenizer", counting)
        chat = [{"role": "system", "content": "the sea and the ships " * 40}, {"role": "user", "content": "Why?"}]
        assert runtime.check(chat) == len(runtime.tokenize(chat))
        final = runtime.generate(chat, Sampling(greedy=True, max_new_tokens=2))
        assert len(counting.lengths) == 1 and final.stats.prompt_tokens == runtime.check(chat)
        text = counting.lengths[0]
        rendered = counting._tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        expected = counting._tokenizer(rendered, add_special_tokens=False)
        assert runtime.tokenize(chat) == expected["input_ids"] and text > 900
        encoded = runtime.engine.encode_prompt(chat)  # the worker's tensor of the same ids
        assert encoded.dtype == torch.long and encoded.shape == (1, len(expected["input_ids"]))
        assert encoded[0].tolist() == expected["input_ids"]
        others = [[{"role": "user", "content": f"Question {i}?"}] for i in range(ENCODED_KEPT)]
        for prompt in others:  # as many other prompts as are kept: the first one's ids are let go
            runtime.check(prompt)
        assert len(counting.lengths) == 1 + ENCODED_KEPT
        runtime.check(others[-1])
        runtime.check(chat)
        assert len(counting.lengths) == 2 + ENCODED_KEPT
