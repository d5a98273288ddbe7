"""Engine.encode_prompt: a final assistant message is continued (the chat's Continue), not answered."""

from __future__ import annotations

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
