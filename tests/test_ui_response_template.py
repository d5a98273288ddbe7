"""A checkpoint that ships its own response template (tokenizer_config.json's `response_template`) has its replies
read by transformers' response parser (Runtime.reply_reader), not by our parser of its family's format: through the
real app on a tiny Qwen3-MoE model with Qwen's Hermes tool template and a response template for it; and a forced
call refused by name where the chat template writes calls in no format the app can force."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from fmoe_local.config import Sampling
from fmoe_local.runtime import readable_response_template
from tests.api_server import serving, serving_script
from tests.test_ui_tool_families import PAUSE, HarmonyScript, _openai_stream
from tests.tool_templates import ASK, HERMES_TEMPLATE, RESPONSE_TEMPLATE, THINKING_RESPONSE, WEATHER
from ui.openai_request import ApiError, parse_chat
from ui.reasoning import CONTENT, REASONING
from ui.reply_parts import merged
from ui.structured import shape
from ui.tool_calls import TemplateFormat

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    import shutil

    model = tmp_path_factory.mktemp("response-template") / "qwen3_moe"
    shutil.copytree(tiny_model_dir("qwen3_moe"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"response_template": RESPONSE_TEMPLATE}))
    with serving(model, tmp_path_factory.mktemp("response-template-data"), template=HERMES_TEMPLATE) as served:
        yield served


def test_a_reply_is_read_by_the_checkpoint_s_response_template(served, monkeypatch):
    _, session, client = served
    runtime, read = session.runtime, []
    assert runtime.response_template == RESPONSE_TEMPLATE
    reader = runtime.reply_reader

    def reading(tools, prefix):  # noqa: ANN001, ANN202 - records the text each reader was fed
        parser, fed = reader(tools, prefix), []
        read.append(fed)
        return SimpleNamespace(feed=lambda text: fed.append(text) or parser.feed(text), finalize=parser.finalize)

    monkeypatch.setattr(runtime, "reply_reader", reading)
    for stream in (False, True):
        kwargs = dict(model="x", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60)
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            calls = [p for c in chunks for p in c.choices[0].delta.tool_calls or []]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            reply = client.chat.completions.create(**kwargs).choices[0]
            calls = reply.message.tool_calls
            assert reply.finish_reason == "tool_calls"
        assert [c.function.name for c in calls] == ["weather"], calls
        assert json.loads(calls[0].function.arguments)["city"] in ("Oslo", "Lisbon")
    assert len(read) == 2 and all("<tool_call>" in "".join(fed) for fed in read)  # transformers' parser read both
    # A reply that does not parse (the model pushed off any call) is content, never an error.
    plain = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=6)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_a_response_template_transformers_cannot_read_counts_as_none(caplog):
    """Its replies are then read as a checkpoint's without one (by our parser of the family's format), not refused at
    every request; the log says why, once, at the load."""
    broken = {"fields": {"content": {"open_pattern": "(", "content": "text"}}}  # a regex that does not compile
    assert readable_response_template(broken) is None and "cannot be read" in caplog.text
    assert readable_response_template(RESPONSE_TEMPLATE) is RESPONSE_TEMPLATE
    assert readable_response_template(None) is None and readable_response_template("text") is None


def test_a_thought_the_opening_leaves_open_is_closed_for_the_parser():
    """ThinkSplit takes the thought off the reply before the template's parser reads it: the parser must be told the
    thought ended, or everything after it, calls too, would read as reasoning."""
    from transformers.utils.chat_parsing import ResponseParser

    runtime = _runtime(HERMES_TEMPLATE + "{# <think> </think> #}")
    runtime.reply_opening = lambda: "<|assistant|>\n<think>\n"
    runtime.reply_reader = lambda tools, prefix: ResponseParser(THINKING_RESPONSE, prefix=prefix, tools=tools)
    shaped = shape(runtime, parse_chat({"model": "x", "messages": ASK, "tools": [WEATHER]}, Sampling()))
    assert isinstance(shaped.fmt, TemplateFormat) and shaped.fmt.opening.endswith("<think>\n</think>")
    parts = shaped.parts([])
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    sent = [piece for ch in f"Dry.</think>\n\nLet me look. {call}" for piece in parts.add(ch)]
    rest, calls = parts.finish()
    assert merged(sent + rest) == [(REASONING, "Dry."), (CONTENT, "Let me look.")]
    assert [c.name for c in calls] == ["weather"]


def _runtime(chat_template: str) -> SimpleNamespace:
    return SimpleNamespace(
        chat_template=chat_template, response_template=RESPONSE_TEMPLATE, reply_reader=lambda tools, prefix: None,
        special_tokens=lambda texts=None: {}, supports_tools=lambda: True, check_grammar=lambda *a: None,
        reply_opening=lambda: "",
    )  # fmt: skip


def test_a_forced_call_is_refused_by_name_where_no_format_can_force_it():
    body = {"model": "x", "messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
    with pytest.raises(ApiError) as refused:
        shape(_runtime("{{ messages }}"), parse_chat(body, Sampling()))  # a template in no format we write
    assert (refused.value.status, refused.value.param) == (400, "tool_choice")
    auto = shape(_runtime("{{ messages }}"), parse_chat(body | {"tool_choice": "auto"}, Sampling()))
    assert isinstance(auto.fmt, TemplateFormat) and not auto.fmt.can_force
    forced = shape(_runtime(HERMES_TEMPLATE), parse_chat(body, Sampling()))
    assert isinstance(forced.fmt, TemplateFormat) and forced.sampling.grammar is not None


# ---- a reply streamed as the model writes it, from a scripted runtime ----


class TemplateScript(HarmonyScript):
    """A Qwen-style model whose checkpoint ships RESPONSE_TEMPLATE, as a script (HarmonyScript's PAUSEs)."""

    chat_template = HERMES_TEMPLATE

    @property
    def response_template(self) -> dict:
        return RESPONSE_TEMPLATE

    def reply_reader(self, tools, prefix=None):  # noqa: ANN001, ANN201
        from transformers.utils.chat_parsing import ResponseParser

        return ResponseParser(RESPONSE_TEMPLATE, prefix=prefix or "", tools=tools)


CALL = ["<tool_call>", "\n", '{"name": "weather", ', '"arguments": {"city": "Oslo"}}', "\n", "</tool_call>"]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    script = TemplateScript(SimpleNamespace(name="qwen-script"))
    with serving_script(script, tmp_path_factory.mktemp("template-script")) as clients:
        yield (script, *clients)


def test_a_reply_s_text_streams_before_its_call_is_written(scripted):
    """The client reads the text before the call while the model has not yet written the call (before, a reply
    read by a response template was held whole to its end)."""
    fake, client, _ = scripted
    fake.script, fake.waited = ["Let", " me", " look", ".", PAUSE, "\n", *CALL], []
    reader, reasons = _openai_stream(fake, client, [("content", "Let me look.")])
    assert fake.waited == [True], reader.events
    assert reader.kinds() == ["content", "call"] and reasons[-1] == "tool_calls"
    assert reader.text("content") == "Let me look." and reader.text("call") == 'weather {"city": "Oslo"}'


def test_a_malformed_call_is_content_after_what_streamed(scripted):
    fake, client, _ = scripted
    fake.script, fake.waited = ["Hi", PAUSE, " <tool_call>", "{oops", "</tool_call>"], []
    reader, reasons = _openai_stream(fake, client, [("content", "Hi")])
    assert fake.waited == [True] and reasons[-1] == "stop"
    assert reader.text("content") == "Hi <tool_call>{oops</tool_call>" and reader.text("call") == ""
