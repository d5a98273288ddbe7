"""Tool calls read back from a reply's text (Hermes/Qwen format), whole and as it streams: a well-formed call
becomes a tool call, anything else stays content."""

from __future__ import annotations

import json

import pytest

from tests.tool_templates import HERMES_TEMPLATE, RESPONSE_TEMPLATE, THINKING_RESPONSE
from ui.reasoning import CONTENT, REASONING
from ui.reply_parts import ReplyParts, merged
from ui.tool_calls import DEEPSEEK_V3, DEEPSEEK_V31, HARMONY, HERMES, MISTRAL, CallStream, TemplateFormat, format_of

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _said(pieces: list) -> str:
    """The text of a reader's pieces, all of them content."""
    assert all(kind == CONTENT for kind, _ in pieces), pieces
    return "".join(text for _, text in pieces)


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
    sent = "".join(_said(stream.add(text[i : i + 3])) for i in range(0, len(text), 3))
    rest, calls = stream.finish()
    assert calls == [] and sent + _said(rest) == text


def test_streamed_text_is_sent_until_a_call_begins_and_the_call_at_the_end():
    stream = CallStream(HERMES, TOOLS)
    pieces = ["Sure", " <to", "ol_c", "all>\n", CALL[len("<tool_call>\n") :]]
    sent = [_said(stream.add(p)) for p in pieces]
    assert "".join(sent) == "Sure " and sent[1] == " "  # "<to" held: it may begin a call
    rest, calls = stream.finish()
    assert rest == [] and calls[0].name == "weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_text_held_as_a_possible_call_start_is_sent_once_it_cannot_be_one():
    stream = CallStream(HERMES, TOOLS)
    assert stream.add("a <to") == [(CONTENT, "a ")] and stream.add("p>") == [(CONTENT, "<top>")]


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
    stream = fmt.reader(TOOLS)
    sent = [piece for i in range(0, len(text), 3) for piece in stream.add(text[i : i + 3])]
    rest, streamed = stream.finish()
    assert [p for p in sent + rest if p[0] == CONTENT] == [] and streamed == calls


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
    stream = fmt.reader(TOOLS)
    sent = [piece for i in range(0, len(text), 5) for piece in stream.add(text[i : i + 5])]
    rest, calls = stream.finish()
    shown = "".join(t for kind, t in sent + rest if kind == CONTENT)
    assert calls == [] and shown.strip(), text
    assert not any(marker in shown for marker in fmt.markers), shown  # the user never sees a special token


def test_a_name_that_is_no_string_is_malformed_not_an_error():
    assert MISTRAL.parse('[TOOL_CALLS] [{"name": {"a": 1}, "arguments": {}}]', TOOLS) is None  # was a TypeError


# A GPT-OSS reply as its tokenizer splits it: each marker one token, the text a word at a time.
HARMONY_TOKENS = {
    "analysis + final": [
        "<|channel|>", "analysis", "<|message|>", "The", " user", " asks", ".", "<|end|>",
        "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "It", " is", " dry", ".",
    ],
    "analysis + call": [
        "<|channel|>", "analysis", "<|message|>", "Look", " it", " up", ".", "<|end|>", "<|start|>", "assistant",
        "<|channel|>", "commentary", " to", "=", "functions", ".", "weather", " ", "<|constrain|>", "json",
        "<|message|>", '{"', "city", '":', ' "', "Oslo", '"}',
    ],  # <|call|> ends the reply: an end token, left out of its text
    "only final": ["<|channel|>", "final", "<|message|>", "It", " is", " dry", ".", "<|return|>"],
    "preamble + call": [
        "<|channel|>", "commentary", "<|message|>", "Checking", " the", " weather", ".", " ", "<|end|>", "<|start|>",
        "assistant", " to", "=", "functions", ".", "weather", "<|channel|>", "commentary", " json", "<|message|>",
        '{"', "city", '":', ' "', "Oslo", '"}', "<|call|>",
    ],
}  # fmt: skip
# What each reads as, the pieces in order and the calls: as a reply held whole and read at its end was read.
HARMONY_READ = {
    "analysis + final": ([(REASONING, "The user asks."), (CONTENT, "It is dry.")], []),
    "analysis + call": ([(REASONING, "Look it up.")], [("weather", {"city": "Oslo"})]),
    "only final": ([(CONTENT, "It is dry.")], []),
    "preamble + call": ([(CONTENT, "Checking the weather.")], [("weather", {"city": "Oslo"})]),  # stripped
}


def _read(parts, tokens: list[str]) -> tuple[list, list, list]:  # noqa: ANN001 - a ReplyParts
    """(what each token let through, the pieces at the end, the calls) of a reply fed to `parts` token by token."""
    each = [parts.add(token) for token in tokens]
    rest, calls = parts.finish()
    return each, rest, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("reply", list(HARMONY_TOKENS))
def test_a_harmony_reply_reads_as_it_did_whole_however_it_streams(reply):
    tokens = HARMONY_TOKENS[reply]
    each, rest, calls = _read(ReplyParts([], None, HARMONY.reader(TOOLS)), tokens)
    assert (merged([p for ps in each for p in ps] + rest), calls) == HARMONY_READ[reply]
    text = "".join(tokens)
    for step in range(1, len(text) + 1):  # markers split anywhere: none of them ever shows
        each, rest, again = _read(ReplyParts([], None, HARMONY.reader(TOOLS)), [text[i : i + step] for i in
                                  range(0, len(text), step)])  # fmt: skip
        sent = [p for ps in each for p in ps] + rest
        assert (merged(sent), again) == HARMONY_READ[reply], step
        assert not any("<" in piece or "|" in piece for _, piece in sent), (step, sent)


def test_a_harmony_reply_s_channels_stream_as_they_come():
    """The analysis channel's text is reasoning as it is written, the final channel's content: before the reply
    ends (before, a reply that may call tools was read whole at its end)."""
    tokens = HARMONY_TOKENS["analysis + final"]
    each, rest, calls = _read(ReplyParts([], None, HARMONY.reader(TOOLS)), tokens)
    assert each[3:7] == [[(REASONING, "The")], [(REASONING, " user")], [(REASONING, " asks")], [(REASONING, ".")]]
    assert each[13:] == [[(CONTENT, "It")], [(CONTENT, " is")], [(CONTENT, " dry")], [(CONTENT, ".")]]
    assert all(not sent for sent in each[:3] + each[7:13]) and rest == [] and calls == []  # headers: never sent


def test_a_harmony_call_is_held_whole_and_what_came_before_it_streams():
    tokens = HARMONY_TOKENS["preamble + call"]
    each, rest, calls = _read(ReplyParts([], None, HARMONY.reader(TOOLS)), tokens)
    assert [p for ps in each[:8] for p in ps] == [(CONTENT, "Checking"), (CONTENT, " the"), (CONTENT, " weather"),
                                                  (CONTENT, ".")]  # fmt: skip
    assert all(not sent for sent in each[8:]) and rest == []  # the space after it: dropped, as a call follows
    assert calls == [("weather", {"city": "Oslo"})]
    each, rest, calls = _read(ReplyParts([], None, HARMONY.reader(TOOLS)), HARMONY_TOKENS["analysis + call"])
    assert [p for ps in each[:7] for p in ps] == [(REASONING, "Look"), (REASONING, " it"), (REASONING, " up"),
                                                  (REASONING, ".")]  # fmt: skip
    assert all(not sent for sent in each[7:]) and rest == [] and calls == [("weather", {"city": "Oslo"})]


@pytest.mark.parametrize(
    "tail",
    ['{"city": "Oslo"', '{"city": "Oslo"} and then some words', "Oslo, please"],
    ids=["cut short", "words after", "no json"],
)
def test_a_malformed_harmony_call_is_content_at_the_end_after_what_streamed(tail):
    tokens = [*HARMONY_TOKENS["preamble + call"][:20], tail]
    each, rest, calls = _read(ReplyParts([], None, HARMONY.reader(TOOLS)), tokens)
    assert merged([p for ps in each for p in ps]) == [(CONTENT, "Checking the weather.")]  # sent before the end
    assert rest == [(CONTENT, " " + tail)] and calls == []  # the held space, then the call's text


def test_a_harmony_reply_without_messages_is_its_text_less_the_markers():
    each, rest, calls = _read(ReplyParts([], None, HARMONY.reader(TOOLS)), ["Just", " words", "<|end|>"])
    assert each == [[], [], []] and rest == [(CONTENT, "Just words")] and calls == []


def test_analysis_messages_are_one_reasoning_a_line_between_them():
    tokens = ["<|channel|>analysis<|message|>", " One.\n", "<|end|><|start|>assistant<|channel|>analysis<|message|>",
              "Two.", "<|end|><|start|>assistant<|channel|>final<|message|>", "Done."]  # fmt: skip
    each, rest, _ = _read(ReplyParts([], None, HARMONY.reader(TOOLS)), tokens)
    assert merged([p for ps in each for p in ps] + rest) == [(REASONING, "One.\nTwo."), (CONTENT, "Done.")]


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


# ---- a checkpoint's own response template, read by transformers' streaming parser ----


def _template(spec: dict | None = RESPONSE_TEMPLATE, opening: str = "<|assistant|>\n") -> TemplateFormat:
    from transformers.utils.chat_parsing import ResponseParser

    def read(tools, prefix):  # noqa: ANN001, ANN202 - as Runtime.reply_reader
        return ResponseParser(spec, prefix=prefix, tools=tools) if spec else None

    return TemplateFormat(read, opening, (), HERMES)


def _streamed(fmt: TemplateFormat, text: str, step: int = 3) -> tuple[list, list, list]:
    """(the pieces sent as the text came, `step` characters at a time; those sent at its end; the calls)."""
    stream = fmt.reader(TOOLS)
    sent = [piece for i in range(0, len(text), step) for piece in stream.add(text[i : i + step])]
    rest, calls = stream.finish()
    return sent, rest, calls


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_response_template_reply_streams_its_text_and_gives_its_calls_at_the_end(step):
    """Before, the whole reply was held and read at its end: a client saw nothing until the model stopped."""
    sent, rest, calls = _streamed(_template(), f"Let me look.\n{CALL}\n{CALL.replace('Oslo', 'Rome')}", step)
    assert _said(sent) == "Let me look." and rest == []
    assert [c.name for c in calls] == ["weather"] * 2
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"]


def test_a_response_template_s_reasoning_streams_as_reasoning():
    sent, rest, calls = _streamed(_template(THINKING_RESPONSE), f"<think>hmm, yes</think>Dry? {CALL}")
    assert merged(sent) == [(REASONING, "hmm, yes"), (CONTENT, "Dry?")] and rest == [] and len(calls) == 1


def test_content_the_template_reads_after_the_calls_comes_with_them():
    sent, rest, calls = _streamed(_template(), f"{CALL} and then some words")
    assert sent == [] and rest == [(CONTENT, "and then some words")] and calls[0].name == "weather"


@pytest.mark.parametrize(
    "text",
    [
        "Hi <tool_call>\n{not json}\n</tool_call>",
        'Hi <tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',  # not one of the tools
        'Hi <tool_call>\n{"name": "weather", "arguments": [1]}\n</tool_call>',
        'Hi <tool_call>\n{"name": ["weather"], "arguments": {}}\n</tool_call>',
        "no call at all\n\n",
    ],
)
@pytest.mark.parametrize("step", [1, 4])
def test_a_response_template_reply_that_calls_nothing_well_is_content_as_written(text, step):
    sent, rest, calls = _streamed(_template(), text, step)
    assert calls == [] and _said(sent) + _said(rest) == text
    assert _said(sent).startswith("Hi" if text.startswith("Hi") else "no call at all")  # sent as it came


def test_without_a_reader_the_reply_is_read_by_the_family_s_format_or_is_content_at_its_end():
    """No reader (Runtime.reply_reader gives none): the chat template's own format reads the calls, and where it has
    none the reply is the text as written, at its end."""
    sent, rest, calls = _streamed(_template(None), f"Hi {CALL}")
    assert _said(sent + rest).strip() == "Hi" and [c.name for c in calls] == ["weather"]
    unformatted = TemplateFormat(lambda tools, prefix: None, "<|assistant|>\n", (), None)
    sent, rest, calls = _streamed(unformatted, f"Hi {CALL}")
    assert sent == [] and rest == [(CONTENT, f"Hi {CALL}")] and calls == []


def test_whitespace_the_opening_leaves_held_does_not_cost_the_reply_its_first_word():
    """The parser holds the opening's trailing newline (it may begin the content's closing delimiter) and gives it back
    glued to the reply's first text: before, that chunk was not found in the reply and was dropped."""
    for text in ("Hi there, no call", f"Hi there. {CALL}"):
        sent, rest, calls = _streamed(_template(opening="<|assistant|>\n\n"), text, 1)
        assert _said(sent).startswith("Hi there"), sent
    assert calls and _said(sent) == "Hi there."


def test_a_malformed_call_after_a_thought_is_content_once():
    """The held text is not found by searching the reply for what was sent (the "k" of "</think>" once was)."""
    sent, rest, calls = _streamed(_template(THINKING_RESPONSE), "<think>x</think>k<tool_call>{bad}</tool_call>", 1)
    assert calls == [] and merged(sent + rest) == [(REASONING, "x"), (CONTENT, "k{bad}")]


def test_text_before_and_after_a_call_stay_apart():
    sent, rest, calls = _streamed(_template(), f"Let me look.\n{CALL} and then {CALL} done")
    assert _said(sent) == "Let me look." and rest == [(CONTENT, "\nand then\ndone")] and len(calls) == 2


def test_a_reply_missing_a_field_the_template_requires_is_content_as_written():
    """finalize raises (a required field never came): the calls are not read, the text stays."""
    spec = RESPONSE_TEMPLATE | {
        "fields": RESPONSE_TEMPLATE["fields"] | {"answer": {"open": "<a>", "close": "</a>", "content": "text"}}
    }
    spec["fields"]["answer"]["optional"] = False
    text = f"Hi. {CALL}"
    sent, rest, calls = _streamed(_template(spec), text)
    assert calls == [] and _said(sent) + _said(rest) == text


def test_an_opening_the_parser_cannot_read_leaves_the_reply_to_the_family_s_reader():
    """Not an error on the event loop: the chat template's own format reads the calls (Hermes here)."""

    def read(tools, prefix):  # noqa: ANN001, ANN202
        raise ValueError("an opening this template cannot read")

    stream = TemplateFormat(read, "<|assistant|>\n", (), HERMES).reader(TOOLS)
    sent = [piece for ch in f"Hi. {CALL}" for piece in stream.add(ch)]
    rest, calls = stream.finish()
    assert _said(sent + rest).strip() == "Hi." and [c.name for c in calls] == ["weather"]
