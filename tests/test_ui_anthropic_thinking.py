"""Anthropic's `thinking` option acted on or refused by name: a chat template with Qwen3's `enable_thinking` switch
gets it set (through the real app and the anthropic client: the prompt the model reads changes); a model that
thinks with no switch refuses "disabled" with a 400 naming 'thinking'; a model that does not think takes any.

Its budget_tokens is held to: refused as Anthropic refuses it (missing, under 1024, not under max_tokens), and
otherwise the request's Sampling.thought, which the runtime holds to (fmoe_local/logits_rules.py). Anthropic's least
budget is beyond a tiny model's 512-token context, so the reply's thought is cut with small budgets through vLLM's
`thinking_token_budget` on the OpenAI side, which shares the same path after the body: a tiny Qwen3 whose untrained
thought never closes gives exactly B thinking tokens, the close, and an answer — streamed as reasoning then content,
and with a forced tool call or a JSON schema held from the end of the thought. One test streams Anthropic's least
budget, 1024, from a copy of the model that reads 2,048 tokens: a thinking block, then text."""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import pytest

from fmoe_local.config import Sampling
from fmoe_local.logits_rules import grammar_after_thought
from tests.api_server import serving
from tests.tool_templates import HARMONY_TEMPLATE, HERMES_TEMPLATE, HYBRID_TEMPLATE, THINKING_TEMPLATE, WEATHER
from ui.anthropic_request import parse_messages
from ui.openai_request import ApiError, parse_chat
from ui.structured import shape

ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("thinking")
    with serving(tiny_model_dir("qwen3_moe"), data, template=HYBRID_TEMPLATE) as (server, _, _):
        yield anthropic.Anthropic(base_url=server.url.rstrip("/"), api_key="x", max_retries=0, timeout=120)


def test_the_template_s_switch_is_set_by_the_thinking_option(client):
    def reply(**thinking):  # noqa: ANN202
        return client.messages.create(model="x", messages=ASK, max_tokens=2, extra_body={"temperature": 0}, **thinking)

    default, on = reply(), reply(thinking={"type": "adaptive"})  # "enabled" needs a budget under max_tokens
    off = reply(thinking={"type": "disabled"})
    read = [r.usage.input_tokens + r.usage.cache_read_input_tokens for r in (default, on, off)]
    assert read[0] == read[1] < read[2], read  # "disabled": the empty thought the template writes is in the prompt
    assert all(b.type == "text" for b in off.content)


def _stand_in(template: str, opening: str = "<|assistant|>\n<think>\n") -> SimpleNamespace:
    """What `shape` reads of a loaded runtime: its chat template, the reply's opening (here the template opens the
    thought), a model that takes tools, and checks that pass."""
    return SimpleNamespace(
        chat_template=template,
        reply_opening=lambda: opening,
        response_template=None,
        supports_tools=lambda: True,
        check_grammar=lambda *args: None,
        special_tokens=lambda markers=(): list(markers),
    )


def _shape(template: str, thinking: str | None):  # noqa: ANN202 - a Shaped
    runtime = _stand_in(template, opening="")
    body = {"model": "x", "max_tokens": 4, "messages": ASK} | ({"thinking": {"type": thinking}} if thinking else {})
    return shape(runtime, parse_messages(body, Sampling()))


def test_disabled_is_refused_by_name_for_a_model_that_always_thinks():
    with pytest.raises(ApiError) as refused:
        _shape(THINKING_TEMPLATE, "disabled")
    assert (refused.value.status, refused.value.param) == (400, "thinking")
    assert _shape(THINKING_TEMPLATE, "adaptive").variables is None  # it thinks anyway: what was asked
    assert _shape(HERMES_TEMPLATE, "disabled").variables is None  # it never thinks: nothing to turn off
    assert _shape(HYBRID_TEMPLATE, "disabled").variables == {"enable_thinking": False}
    assert _shape(HYBRID_TEMPLATE, None).variables is None


def test_disabled_is_refused_by_name_for_gpt_oss_which_always_thinks_in_its_analysis_channel():
    """Harmony has no switch that stops the analysis channel (reasoning effort is low, medium or high): before, the
    request was taken and the model thought anyway."""
    with pytest.raises(ApiError) as refused:
        _shape(HARMONY_TEMPLATE, "disabled")
    assert (refused.value.status, refused.value.param) == (400, "thinking")
    assert "cannot be disabled" in str(refused.value)


def _body(max_tokens: int = 2048, **thinking) -> dict:  # noqa: ANN003 - the thinking option's fields
    return {"model": "x", "max_tokens": max_tokens, "messages": ASK, "thinking": thinking}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (_body(type="enabled"), "needs 'budget_tokens'"),
        (_body(type="enabled", budget_tokens=1023), "at least 1024"),
        (_body(1024, type="enabled", budget_tokens=1024), "'max_tokens' (1024) must be greater"),
    ],
)
def test_a_budget_anthropic_refuses_is_refused_with_a_sentence(body, says):
    with pytest.raises(ApiError) as refused:
        parse_messages(body, Sampling())
    assert (refused.value.status, refused.value.param) == (400, "thinking") and says in str(refused.value)


def test_vllm_s_thinking_token_budget_is_a_whole_number_of_at_least_0():
    from ui.openai_request import parse_chat

    body = {"model": "x", "messages": ASK}
    assert parse_chat(body | {"thinking_token_budget": 7}, Sampling()).thought_budget == 7
    assert parse_chat(body, Sampling()).thought_budget is None
    for wrong in (-1, 2.5, "7"):
        with pytest.raises(ApiError) as refused:
            parse_chat(body | {"thinking_token_budget": wrong}, Sampling())
        assert (refused.value.status, refused.value.param) == (400, "thinking_token_budget")
        assert "at least 0" in str(refused.value)


def test_a_refused_budget_reaches_the_anthropic_client_as_a_400(client):
    with pytest.raises(anthropic.BadRequestError, match="at least 1024"):
        client.messages.create(
            model="x", messages=ASK, max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 8}
        )


def test_the_budget_is_the_request_s_sampling_thought_where_the_model_thinks():
    def thought(template: str, **extra):  # noqa: ANN003, ANN202 - a ThoughtBudget or None
        runtime = _stand_in(template)
        body = _body(type="enabled", budget_tokens=1500) | extra
        return shape(runtime, parse_messages(body, Sampling())).sampling.thought

    opened = thought(THINKING_TEMPLATE)
    assert (opened.tokens, opened.start, opened.end, opened.close, opened.opened) == (
        1500, "<think>", "</think>", "\n</think>\n\n", True,
    )  # fmt: skip
    harmony = thought(HARMONY_TEMPLATE)  # GPT-OSS: its analysis channel, which the reply opens itself
    assert (harmony.start, harmony.end, harmony.opened) == ("<|channel|>analysis<|message|>", "<|end|>", False)
    assert harmony.close == "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert thought(HERMES_TEMPLATE) is None  # a model that does not think: nothing to hold
    assert thought(HERMES_TEMPLATE, thinking={"type": "adaptive"}) is None
    # With tools, GPT-OSS's spent budget opens the next channel without naming it: a call is still possible after it.
    tool = {"name": "weather", "input_schema": WEATHER["function"]["parameters"]}
    assert thought(HARMONY_TEMPLATE, tools=[tool]).close == "<|end|><|start|>assistant<|channel|>"


def test_a_budget_goes_with_enabled_thinking_only():
    for kind in ("adaptive", "disabled"):
        with pytest.raises(ApiError, match='with {"type": "enabled"} only') as refused:
            parse_messages(_body(type=kind, budget_tokens=3), Sampling())
        assert refused.value.param == "thinking"


# The Hermes tool template with Qwen3-Thinking's opened thought: a reply thinks, then answers or calls a tool.
THINKING_TOOLS = HERMES_TEMPLATE.replace(
    "<|assistant|>\n{%- if message.content %}",
    "<|assistant|>\n{%- if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n"
    "{%- endif %}\n{%- if message.content %}",
).replace(
    "{%- if add_generation_prompt %}\n<|assistant|>\n", "{%- if add_generation_prompt %}\n<|assistant|>\n<think>\n"
)
B, MAX = 6, 40  # thinking tokens, and every token of the reply


@pytest.fixture(scope="module")
def thinker(tiny_model_dir, tmp_path_factory):
    """(openai client, the served runtime) on a tiny Qwen3 whose template opens the reply's thought and shows tools."""
    assert THINKING_TOOLS.count("<think>") == 2
    data = tmp_path_factory.mktemp("budget")
    with serving(tiny_model_dir("qwen3_moe"), data, template=THINKING_TOOLS) as (_, session, openai):
        yield openai, session.runtime


def _ask(openai, max_tokens: int = MAX, **extra):  # noqa: ANN001, ANN003, ANN202 - the client's reply
    return openai.chat.completions.create(model="x", messages=ASK, max_tokens=max_tokens, temperature=0, **extra)


def test_a_thought_is_cut_at_its_budget_and_the_answer_follows(thinker):
    openai, runtime = thinker
    free = runtime.submit(ASK, Sampling(greedy=True, max_new_tokens=MAX)).result()  # the thought left alone
    assert "</think>" not in free.text and len(free.token_ids) == MAX  # untrained: it never ends by itself
    whole = _ask(openai).choices[0]
    assert whole.message.content == "" and whole.message.model_extra["reasoning_content"]  # no budget: not cut
    cut = _ask(openai, extra_body={"thinking_token_budget": B})
    message = cut.choices[0].message
    tokenizer = runtime.engine.tokenizer
    assert message.model_extra["reasoning_content"] == tokenizer.decode(free.token_ids[:B]).strip()  # B tokens
    assert message.content.strip() and cut.usage.completion_tokens == MAX  # an answer, max_tokens counting all
    chunks = list(_ask(openai, extra_body={"thinking_token_budget": B}, stream=True))
    kinds = [
        "reasoning" if (c.choices[0].delta.model_extra or {}).get("reasoning_content") else "content"
        for c in chunks
        if c.choices and ((c.choices[0].delta.model_extra or {}).get("reasoning_content") or c.choices[0].delta.content)
    ]
    assert kinds == sorted(kinds, reverse=True) and kinds[0] == "reasoning" and kinds[-1] == "content"  # then
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content


def test_a_budget_not_under_max_tokens_changes_nothing(thinker):
    openai, _ = thinker
    free = _ask(openai).choices[0].message
    same = _ask(openai, extra_body={"thinking_token_budget": MAX}).choices[0].message
    assert (same.content, same.model_extra) == (free.content, free.model_extra)


def test_a_budget_not_under_max_tokens_still_starts_a_grammar_after_the_thought():
    """Such a budget cuts nothing, but with a grammar it says where the grammar starts: before, it was dropped, and
    the grammar held the reply from its first token, inside the thought the prompt opened."""
    runtime = _stand_in(THINKING_TEMPLATE)
    body = {"model": "x", "max_tokens": 40, "messages": ASK, "response_format": {"type": "json_object"}}
    req = parse_chat(body | {"thinking_token_budget": 100}, Sampling())
    shaped = shape(runtime, req)
    assert shaped.sampling.thought is not None and shaped.sampling.thought.tokens == 100
    assert shaped.sampling.grammar is not None and grammar_after_thought(shaped.sampling)


def test_a_json_schema_holds_the_reply_from_the_end_of_the_thought(thinker):
    openai, _ = thinker
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    message = _ask(openai, response_format=fmt, extra_body={"thinking_token_budget": B}).choices[0].message
    assert message.model_extra["reasoning_content"] and isinstance(json.loads(message.content)["ok"], bool)
    plain = _ask(openai, response_format=fmt).choices[0].message  # no budget: the grammar from the first token
    assert "reasoning_content" not in plain.model_extra and isinstance(json.loads(plain.content)["ok"], bool)


def test_a_forced_tool_call_follows_the_thought(thinker):
    openai, _ = thinker
    budget = {"thinking_token_budget": B}
    reply = _ask(openai, 120, tools=[WEATHER], tool_choice="required", extra_body=budget)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"], choice
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] in ("Oslo", "Lisbon")


def test_claude_s_budget_cuts_a_streamed_thought_into_a_thinking_block_then_text(tiny_model_dir, tmp_path):
    """Anthropic's least budget, 1024, through the anthropic client's stream: the model's copy reads 2,048 tokens."""
    from tests.tiny import with_special_tokens

    model = with_special_tokens(tiny_model_dir("qwen3_moe"), tmp_path / "long", [], context=2048)
    with serving(model, tmp_path / "data", template=THINKING_TEMPLATE) as (server, _, _):
        claude = anthropic.Anthropic(base_url=server.url.rstrip("/"), api_key="x", max_retries=0, timeout=300)
        thinking = {"type": "enabled", "budget_tokens": 1024}
        kwargs = dict(model="x", messages=ASK, max_tokens=1040, thinking=thinking, extra_body={"temperature": 0})
        with claude.messages.stream(**kwargs) as stream:
            starts = [e.content_block.type for e in stream if e.type == "content_block_start"]
            final = stream.get_final_message()
    assert starts == ["thinking", "text"] == [b.type for b in final.content], final
    assert final.content[0].thinking and final.content[1].text.strip()  # the thought, cut; then the answer
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 1040)  # max_tokens counts them all
