"""Tool calls read back from a reply's text (Hermes/Qwen format), whole and as it streams: a well-formed call
becomes a tool call, anything else stays content."""

from __future__ import annotations

import json

import pytest

from tests.tool_templates import HERMES_TEMPLATE
from ui.tool_calls import DEEPSEEK_V3, DEEPSEEK_V31, HARMONY, HERMES, MISTRAL, CallStream, format_of

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_the_format_is_read_from_the_template():
    assert format_of(HERMES_TEMPLATE) is HERMES
    assert format_of("{% for m in messages %}{{ m.content }}{% endfor %}") is None and format_of(None) is None


def test_calls_and_the_text_before_them_are_parsed():
    content, calls = HERMES.parse(f"Let me look.\n{CALL}\n{CALL.replace('Oslo', 'Rome')}", TOOLS)
    assert content == "Let me look." and [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"]
    assert {c.name for c in calls} == {"weather"}


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',  # not one of the tools
        '<tool_call>\n{"name": "weather", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": ["weather"], "arguments": {}}\n</tool_call>',  # a name that cannot be looked up
        '<tool_call>\n{"name": "weather", "arguments": {}}',  # never closed (cut by max_tokens)
        f"{CALL} and then some words",
        "no call at all",
    ],
)
def test_malformed_call_text_is_content_not_an_error(text):
    assert HERMES.parse(text, TOOLS) is None
    stream = CallStream(HERMES, TOOLS)
    sent = "".join(stream.add(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, calls = stream.finish()
    assert calls == [] and sent + rest == text


def test_streamed_text_is_sent_until_a_call_begins_and_the_call_at_the_end():
    stream = CallStream(HERMES, TOOLS)
    pieces = ["Sure", " <to", "ol_c", "all>\n", CALL[len("<tool_call>\n") :]]
    sent = [stream.add(p) for p in pieces]
    assert "".join(sent) == "Sure " and sent[1] == " "  # "<to" held: it may begin a call
    rest, calls = stream.finish()
    assert rest == "" and calls[0].name == "weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_text_held_as_a_possible_call_start_is_sent_once_it_cannot_be_one():
    stream = CallStream(HERMES, TOOLS)
    assert stream.add("a <to") == "a " and stream.add("p>") == "<top>"


# Each format as its models write a call of `weather` with {"city": "Oslo"}, the markers as the special tokens'
# text (what a request that keeps them gets: Runtime.submit's keep).
WRITTEN = {
    MISTRAL: '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}]',
    DEEPSEEK_V3: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n"
    '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    DEEPSEEK_V31: '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>",
    HARMONY: "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}',  # <|call|> ends the reply: an EOS
}
OTHER_WRITINGS = [
    (MISTRAL, '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}'),  # Mistral's later tokenizers
    (HARMONY, '<|start|>assistant to=functions.weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'),
    (
        DEEPSEEK_V31,
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>',
    ),
]


@pytest.mark.parametrize(
    "template, fmt",
    [
        ("{{ '[TOOL_CALLS] [' }}{% for c in m.tool_calls %}{{ c | tojson }}{% endfor %}", MISTRAL),
        ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json'}}", DEEPSEEK_V3),
        ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments}}", DEEPSEEK_V31),
        ("{{- '<|start|>assistant to=functions.' + name + '<|channel|>commentary json<|message|>' }}", HARMONY),
    ],
)  # fmt: skip
def test_each_family_s_format_is_read_from_its_template(template, fmt):
    assert format_of(template) is fmt


@pytest.mark.parametrize("fmt, text", [*WRITTEN.items(), *OTHER_WRITINGS], ids=lambda v: getattr(v, "name", ""))
def test_a_call_in_each_format_is_parsed_whole_and_as_it_streams(fmt, text):
    content, calls = fmt.parse(text, TOOLS)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Oslo"})]
    stream = CallStream(fmt, TOOLS)
    sent = "".join(stream.add(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, streamed = stream.finish()
    assert sent + rest == "" and streamed == calls


@pytest.mark.parametrize("fmt", list(WRITTEN), ids=lambda f: f.name)
@pytest.mark.parametrize(
    "breakage",
    [
        lambda t: t.replace('"Oslo"}', '"Oslo"'),  # JSON cut short (max_tokens)
        lambda t: t.replace("weather", "delete_everything"),  # not one of the tools
        lambda t: t.replace('{"city": "Oslo"}', "[1]"),  # arguments that are not an object
        lambda t: t + " and then some words",
    ],
)
def test_malformed_call_text_in_each_format_is_content_without_its_markers(fmt, breakage):
    text = breakage(WRITTEN[fmt])
    assert fmt.parse(text, TOOLS) is None
    stream = CallStream(fmt, TOOLS)
    sent = "".join(stream.add(text[i : i + 5]) for i in range(0, len(text), 5))
    rest, calls = stream.finish()
    shown = sent + rest
    assert calls == [] and shown.strip(), text
    assert not any(marker in shown for marker in fmt.markers), shown  # the user never sees a special token


def test_a_name_that_is_no_string_is_malformed_not_an_error():
    assert MISTRAL.parse('[TOOL_CALLS] [{"name": {"a": 1}, "arguments": {}}]', TOOLS) is None  # was a TypeError


def test_a_harmony_reply_s_analysis_is_reasoning_and_its_final_channel_the_content():
    from ui.reply_parts import CONTENT, REASONING, ReplyParts

    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>It is dry."
    stream = CallStream(HARMONY, TOOLS)
    assert stream.add(text) == "" and stream.finish() == ("It is dry.", []) and stream.reasoning == "Think."
    parts = ReplyParts([], None, CallStream(HARMONY, TOOLS))
    assert parts.add(text) == [] and parts.finish() == ([(REASONING, "Think."), (CONTENT, "It is dry.")], [])
    parts = ReplyParts([], None, CallStream(HARMONY, TOOLS))
    assert parts.add(WRITTEN[HARMONY]) == []
    pieces, calls = parts.finish()
    assert pieces == [(REASONING, "The user wants the weather.")] and [c.name for c in calls] == ["weather"]


@pytest.fixture(scope="module")
def marked_tokenizer(tmp_path_factory):
    """The tiny models' tokenizer with every format's markers added as special tokens (as the real checkpoints have
    them), for llguidance."""
    from tests.tiny import train_tokenizer

    tok = train_tokenizer(tmp_path_factory.mktemp("marked"))
    markers = sorted({m for fmt in WRITTEN for m in fmt.markers})
    tok.add_tokens(markers, special_tokens=True)
    return tok


@pytest.mark.parametrize("fmt", [HERMES, *WRITTEN], ids=lambda f: f.name)
def test_each_format_s_grammar_takes_its_call_and_refuses_another_function(fmt, marked_tokenizer):
    """The grammar that forces a call (tool_choice required or named) holds the reply to exactly what the parser
    reads: the markers as the special tokens they are, the arguments to the tool's parameters."""
    import llguidance
    import llguidance.hf

    from fmoe_local.generate import special_token_ids

    tok = marked_tokenizer
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False
    }}}, {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    specials = special_token_ids(tok, fmt.markers)
    assert set(specials) == set(fmt.markers)
    llg = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    # The JSON as the grammar writes it: no whitespace but what the format itself has.
    # A forced harmony call is the reply's first message (no analysis before it).
    written = WRITTEN.get(fmt, CALL).replace('": ', '":').replace('", "', '","')
    written = written[written.find("<|channel|>commentary") :] if fmt is HARMONY else written
    for only, accepted in ((None, True), ("weather", True), ("time", False)):
        grammar = llguidance.LLMatcher.grammar_from_lark(fmt.grammar(tools, only, False, specials))
        assert not llguidance.LLMatcher.validate_grammar(grammar, llg)
        matcher = llguidance.LLMatcher(llg, grammar, log_level=0)
        ids = tok.encode(written, add_special_tokens=False)
        taken = matcher.try_consume_tokens(ids)
        assert (taken == len(ids) and not matcher.is_error()) == accepted, (fmt.name, only, taken, len(ids))
    assert fmt.parse(written, tools)[1][0].name == "weather"
