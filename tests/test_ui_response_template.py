"""A checkpoint that ships its own response template (tokenizer_config.json's `response_template`) has its replies
read by transformers' parse_response (Runtime.parse_reply), not by our parser of its family's format: through the
real app on a tiny Qwen3-MoE model with Qwen's Hermes tool template and a response template for it; and a forced
call refused by name where the chat template writes calls in no format the app can force."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from fmoe_local.config import Sampling
from tests.api_server import serving
from tests.tool_templates import ASK, HERMES_TEMPLATE, WEATHER
from ui.openai_request import ApiError, parse_chat
from ui.structured import shape
from ui.tool_calls import TemplateFormat

openai = pytest.importorskip("openai")

# The tiny template's reply opens with <|assistant|> and ends with <|eos|>; calls as Qwen writes them.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|eos\|>", "content": "text"},
    },
}


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
    parse = runtime.parse_reply
    monkeypatch.setattr(
        runtime, "parse_reply", lambda text, tools, prefix: read.append(text) or parse(text, tools, prefix)
    )
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
    assert len(read) == 2 and all("<tool_call>" in text for text in read)  # transformers' parser read both replies
    # A reply that does not parse (the model pushed off any call) is content, never an error.
    plain = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=6)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def _runtime(chat_template: str) -> SimpleNamespace:
    return SimpleNamespace(
        chat_template=chat_template, response_template=RESPONSE_TEMPLATE, parse_reply=lambda text, tools, prefix: None,
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
