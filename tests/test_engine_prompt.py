"""Engine.encode_prompt: a final assistant message is continued (the chat's Continue), not answered; a prompt
too long for the model is refused in a sentence naming the model as people know it."""

from __future__ import annotations

import pytest

from fmoe_local.config import RuntimeConfig
from fmoe_local.runtime import Runtime


def test_a_final_assistant_message_is_continued_where_it_stopped(tiny_model_dir):
    with Runtime.load(tiny_model_dir("olmoe"), RuntimeConfig(device="cpu")) as runtime:
        engine = runtime.engine
        asked = [{"role": "user", "content": "Tell me about the sea."}]
        partial = asked + [{"role": "assistant", "content": "The sea is"}]
        text = engine.tokenizer.decode(engine.encode_prompt(partial)[0])
        assert text.endswith("The sea is")  # the prompt ends inside the reply: no end of turn, no new turn
        answered = engine.tokenizer.decode(engine.encode_prompt(asked)[0])
        assert text.startswith(answered)  # the same turn the model was answering


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
