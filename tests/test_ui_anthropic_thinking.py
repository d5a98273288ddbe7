"""Anthropic's `thinking` option acted on or refused by name: a chat template with Qwen3's `enable_thinking` switch
gets it set (through the real app and the anthropic client: the prompt the model reads changes); a model that
thinks with no switch refuses "disabled" with a 400 naming 'thinking'; a model that does not think takes any."""

from __future__ import annotations

from types import SimpleNamespace

import anthropic
import pytest

from fmoe_local.config import Sampling
from tests.api_server import serving
from tests.tool_templates import HERMES_TEMPLATE, HYBRID_TEMPLATE, THINKING_TEMPLATE
from ui.anthropic_request import parse_messages
from ui.openai_request import ApiError
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

    default, on = reply(), reply(thinking={"type": "enabled", "budget_tokens": 1024})
    off = reply(thinking={"type": "disabled"})
    read = [r.usage.input_tokens + r.usage.cache_read_input_tokens for r in (default, on, off)]
    assert read[0] == read[1] < read[2], read  # "disabled": the empty thought the template writes is in the prompt
    assert all(b.type == "text" for b in off.content)


def _shape(template: str, thinking: str | None):  # noqa: ANN202 - a Shaped
    runtime = SimpleNamespace(chat_template=template, reply_opening=lambda: "")
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
