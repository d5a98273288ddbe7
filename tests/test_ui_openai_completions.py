"""/v1/completions through the official openai client against the real app (`app.serve` on a tiny Mixtral whose
chat template is Mixtral-Instruct's): the prompt is continued as it is, without the template; plain and streamed
replies agree; echo; usage; and what it cannot do is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from tests.api_server import serving

openai = pytest.importorskip("openai")

PROMPT = "The sea and the ships"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("api-completions-data")
    with serving(tiny_model_dir("mixtral"), data, strict_template=True) as served:
        yield served


def test_the_prompt_is_continued_as_it_is_without_the_chat_template(served):
    _, session, client = served
    tok = session.runtime.engine.tokenizer
    plain = client.completions.create(model="x", prompt=PROMPT, max_tokens=6, temperature=0)  # was: a 404
    assert plain.object == "text_completion" and isinstance(plain.choices[0].text, str)
    assert plain.usage.prompt_tokens == len(tok(PROMPT)["input_ids"])  # no [INST] … [/INST] around it
    chat = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": PROMPT}], max_tokens=1, temperature=0
    )
    assert chat.usage.prompt_tokens > plain.usage.prompt_tokens  # the chat's prompt is the template's
    assert plain.usage.completion_tokens <= 6
    assert plain.choices[0].finish_reason == ("length" if plain.usage.completion_tokens == 6 else "stop")
    assert session.store.chats.list() == []  # API requests are not the user's chats


def test_plain_streamed_and_echoed_replies_agree(served):
    _, _, client = served
    plain = client.completions.create(model="x", prompt=[PROMPT], max_tokens=6, temperature=0)
    chunks = list(
        client.completions.create(
            model="x", prompt=PROMPT, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    echoed = client.completions.create(model="x", prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = client.completions.create(model="x", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT + plain.choices[0].text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"logprobs": 3}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_what_it_cannot_do_is_a_400_naming_the_field(served, extra, param):
    server, _, _ = served
    before = len(server.api.finished)
    body = {"model": "x", "prompt": PROMPT, "max_tokens": 2} | extra
    r = httpx.post(f"{server.url}v1/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert len(server.api.finished) == before  # refused before it was queued


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_context_is_a_400(served, stream):
    server, _, client = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="x", prompt="sea ships " * 3000, max_tokens=2, stream=stream)
    assert caught.value.code == "context_length_exceeded" and caught.value.body["param"] == "prompt"
    assert "This prompt is" in caught.value.body["message"] and "Shorten the prompt" in caught.value.body["message"]
