"""A reasoning model's thought read out of its reply (ui/reasoning.py), whole and however the text is split into
deltas, and through reply_parts.py with stop sequences and tool calls after it."""

from __future__ import annotations

import pytest

from ui.reasoning import CONTENT, REASONING, THINK, ThinkSplit, format_of
from ui.reply_parts import ReplyParts, merged
from ui.tool_calls import HERMES, CallStream

QWEN3 = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there!"


def _split(text: str, opened: bool = False, step: int = 0) -> list[tuple[str, str]]:
    """The pieces of `text` fed whole (step 0) or `step` characters at a time."""
    split = ThinkSplit(THINK, opened)
    chunks = [text] if step == 0 else [text[i : i + step] for i in range(0, len(text), step)]
    pieces = [p for chunk in chunks for p in split.add(chunk)]
    return merged(pieces + split.finish())


@pytest.mark.parametrize("step", [0, 1, 2, 3, 7])
def test_a_thought_is_reasoning_and_the_rest_content_however_it_streams(step):
    assert _split(QWEN3, step=step) == [(REASONING, "The user greets me.\nI greet back."), (CONTENT, "Hello there!")]
    # The template opened the thought (Qwen3-Thinking, DeepSeek-R1): the reply has no <think> of its own.
    opened = QWEN3.removeprefix("<think>")
    assert _split(opened, opened=True, step=step) == _split(QWEN3, step=step)


def test_what_is_not_a_thought_is_content():
    assert _split("Hello <think>not at the start</think>") == [(CONTENT, "Hello <think>not at the start</think>")]
    assert _split("<div>html</div>", step=1) == [(CONTENT, "<div>html</div>")]
    assert _split("<thin") == [(CONTENT, "<thin")]  # the reply ended on what was never the marker
    assert _split("<think>\n\n</think>\n\nJust this.") == [(CONTENT, "Just this.")]  # an empty thought: none


def test_a_thought_cut_short_is_reasoning_to_its_end():
    assert _split("<think>\nStill thinking about </thi", step=4) == [(REASONING, "Still thinking about </thi")]
    assert _split("Thinking, opened", opened=True) == [(REASONING, "Thinking, opened")]


def test_text_is_sent_as_soon_as_it_cannot_be_a_marker():
    split = ThinkSplit(THINK)
    assert split.add("<thi") == [] and split.add("nk>Some") == [(REASONING, "Some")]
    assert split.add(" idea</th") == [(REASONING, " idea")]  # "</th" may become the end marker: held
    assert split.add("ink>\n\nDone") == [(REASONING, ""), (CONTENT, "Done")]


def test_which_templates_think_and_which_openings_leave_a_thought_open():
    assert format_of("{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}") == THINK
    assert format_of("<|im_start|>assistant\n") is None and format_of(None) is None
    assert THINK.opened("<|im_start|>assistant\n<think>\n")
    assert not THINK.opened("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3 with enable_thinking off
    assert not THINK.opened("<|im_start|>assistant\n")


def test_the_reply_s_parts_cut_stops_then_split_the_thought_then_read_calls():
    weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    text = '<think>\nCall it.\n</think>\n\n<tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call>'
    parts = ReplyParts([], ThinkSplit(THINK), CallStream(HERMES, [weather]))
    pieces = [p for i in range(0, len(text), 5) for p in parts.add(text[i : i + 5])]
    rest, calls = parts.finish()
    assert merged(pieces + rest) == [(REASONING, "Call it.")] and [c.name for c in calls] == ["weather"]
    parts = ReplyParts(["STOP"], ThinkSplit(THINK))
    pieces = parts.add("<think>a STOP b</think>c")
    assert parts.stopped and parts.matched == "STOP"
    assert merged(pieces + parts.finish()[0]) == [(REASONING, "a")]  # stopped inside the thought


@pytest.fixture(scope="module")
def thinking(tiny_model_dir, tmp_path_factory):
    """The real app on a tiny Qwen3-MoE whose template opens the reply's thought (tests/tool_templates.py)."""
    import anthropic

    from tests.api_server import serving
    from tests.tool_templates import THINKING_TEMPLATE

    data = tmp_path_factory.mktemp("reasoning-api")
    with serving(tiny_model_dir("qwen3_moe"), data, template=THINKING_TEMPLATE) as (server, session, openai):
        yield openai, anthropic.Anthropic(base_url=server.url.rstrip("/"), api_key="x", max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "Say hi."}]


def test_a_thought_comes_back_apart_from_the_content_in_both_apis_streamed_and_not(thinking):
    """The untrained model never closes the thought its template opened: the whole reply is reasoning, none of it
    content — before, it was all content, the thought mixed into the answer."""
    openai, claude = thinking
    reply = openai.chat.completions.create(model="x", messages=ASK, max_tokens=8, temperature=0)
    message = reply.choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert thought.strip() and message.content == "" and reply.choices[0].finish_reason == "length"
    chunks = list(openai.chat.completions.create(model="x", messages=ASK, max_tokens=8, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == ""
    whole = claude.messages.create(model="x", messages=ASK, max_tokens=8, extra_body={"temperature": 0})
    assert [(b.type, b.thinking) for b in whole.content] == [("thinking", thought)]
    with claude.messages.stream(model="x", messages=ASK, max_tokens=8, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.thinking) for b in final.content] == [("thinking", thought)]


def test_a_prefill_that_closed_the_thought_continues_as_content(thinking):
    openai, claude = thinking
    prefill = {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nHi"}
    reply = openai.chat.completions.create(model="x", messages=[*ASK, prefill], max_tokens=6, temperature=0)
    message = reply.choices[0].message
    assert message.content and "reasoning_content" not in (message.model_extra or {})
    other = claude.messages.create(model="x", messages=[*ASK, prefill], max_tokens=6, extra_body={"temperature": 0})
    assert [(b.type, b.text) for b in other.content] == [("text", message.content)]
