"""A GPT-OSS reply's analysis channel comes back apart from its final channel in every chat request, tools or not
(ui/harmony_reply.py): as `reasoning_content` in the OpenAI API (`delta.reasoning_content` streamed), as a thinking
block in the Anthropic API, and as the chat's folded thought, stored in the `<think>` form. The reply is scripted,
token by token, by a runtime that writes harmony's markers only where the request keeps them (Runtime.submit's
`keep`, as the real Detokenizer does), so a request that does not ask for them gets its thought and answer joined —
what every request without tools got before. A reply held to a grammar from its first token has no channels and is
read as it is written; /v1/completions stays the raw text. Last, the real runtime on a tiny GPT-OSS: a thinking
budget writes the analysis' end and the final header for the untrained model, and both APIs split the reply there."""

from __future__ import annotations

from types import SimpleNamespace

import anthropic
import pytest

from fmoe_local.config import Sampling, ThoughtBudget
from tests.api_server import serving_script
from tests.fake_runtime import FakeRuntime
from tests.tool_templates import ASK, HARMONY_TEMPLATE, HERMES_TEMPLATE
from ui import harmony_reply
from ui.openai_request import parse_chat
from ui.reasoning import CONTENT, HARMONY_ANALYSIS, REASONING
from ui.reply_parts import merged
from ui.structured import shape
from ui.tool_calls import HARMONY

openai = pytest.importorskip("openai")

ANALYSIS = ["<|channel|>", "analysis", "<|message|>", "The", " user", " asks", ".", "<|end|>"]
FINAL = ["<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "It", " is", " dry", "."]
CALL = [
    "<|start|>", "assistant", "<|channel|>", "commentary", " to", "=", "functions", ".", "weather", " ",
    "<|constrain|>", "json", "<|message|>", '{"', "city", '":', ' "', "Oslo", '"}', "<|call|>",
]  # fmt: skip
THOUGHT, ANSWER = "The user asks.", "It is dry."
OPENED = {"role": "assistant", "content": HARMONY_ANALYSIS.start}  # a prefill: the reply goes on inside the analysis
B = 5  # thinking tokens before the runtime writes the analysis' end and the final channel's header


class HarmonyRuntime(FakeRuntime):
    """GPT-OSS as a script: `script`'s tokens, the harmony markers among them special tokens, written as text only
    where the request keeps them (`keep`), as the real runtime's Detokenizer leaves every other one out."""

    chat_template = HARMONY_TEMPLATE

    def __init__(self) -> None:
        super().__init__()
        self.info, self.script, self.kept = SimpleNamespace(name="gpt-oss-script"), [], []

    def special_tokens(self, texts=None) -> dict[str, int]:  # noqa: ANN001
        return {t: 200_000 + i for i, t in enumerate(HARMONY.markers) if texts is None or t in texts}

    def submit(self, prompt, sampling=None, tools=None, keep=frozenset(), variables=None):  # noqa: ANN001, ANN201
        self.kept.append(keep)  # read by `events`, which runs this request (these tests send one request at a time)
        return super().submit(prompt, sampling, tools, keep, variables)

    def supports_tools(self) -> bool:
        return True

    def check_grammar(self, grammar, schema=None, where="schema") -> None:  # noqa: ANN001
        return None

    def events(self, prompt, sampling, stop):  # noqa: ANN001, ANN201
        from fmoe_local.runtime_types import Finished, TextDelta
        from fmoe_local.stats import RequestStats

        keep = self.kept.pop(0)
        text, ids = "", []
        for token in self.script:
            shown = "" if token in HARMONY.markers and token not in keep else token
            text, ids = text + shown, [*ids, len(ids)]
            yield TextDelta(shown, ids[-1])
        yield Finished(text, ids, RequestStats(prompt_tokens=3, tokens=len(ids), finish_reason="stop"), "stop")


# ---- the stored form, and what is read for channels ----


def _stored(tokens: list[str]) -> list[str]:
    """The stored form after each token, and at the end."""
    view = harmony_reply.ThoughtText()
    return [view.add(token) for token in tokens] + [view.finish()]


def test_a_reply_is_stored_as_its_thought_then_its_answer_as_it_streams():
    views = _stored(ANALYSIS + FINAL)
    assert (
        views[-1] == harmony_reply.stored_form("".join(ANALYSIS + FINAL)) == f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    )
    assert views[len(ANALYSIS) - 1] == f"<think>\n{THOUGHT}"  # a thought with no answer yet stays open
    assert all(views[-1].startswith(view) for view in views)  # it only grows: what was shown stays
    assert harmony_reply.stored_form("".join(ANALYSIS)) == f"<think>\n{THOUGHT}"  # cut inside the thought
    assert harmony_reply.stored_form("".join(FINAL)) == ANSWER  # no thought: the answer alone


def test_a_call_written_without_tools_is_content_not_a_call():
    stream = harmony_reply.reader()
    pieces = [p for token in ANALYSIS + CALL for p in stream.add(token)]
    rest, calls = stream.finish()
    assert calls == [] and merged(pieces) == [(REASONING, THOUGHT)]
    assert rest == [(CONTENT, '{"city": "Oslo"}')]  # the call's text less its markers, as a malformed call's


def test_a_thought_the_prompt_opened_is_read_from_the_reply_s_first_token():
    stream = harmony_reply.reader(opened=True)
    pieces = [p for token in ANALYSIS[3:] + FINAL for p in stream.add(token)] + stream.finish()[0]
    assert merged(pieces) == [(REASONING, THOUGHT), (CONTENT, ANSWER)]


def _shaped(template: str, **body):  # noqa: ANN003, ANN202 - the request's fields; a Shaped
    runtime = HarmonyRuntime()
    runtime.chat_template = template
    return shape(runtime, parse_chat({"model": "x", "messages": ASK} | body, Sampling()))


def test_which_requests_keep_the_markers_and_read_the_channels():
    plain = _shaped(HARMONY_TEMPLATE)
    assert (
        plain.channels
        and plain.keep == frozenset(HARMONY.markers)
        and plain.submit_options() == {"keep": frozenset(HARMONY.markers)}
    )
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    held = _shaped(
        HARMONY_TEMPLATE, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    )
    assert not held.channels and held.keep == frozenset()  # the grammar holds it from its first token: no channels
    assert not _shaped(HERMES_TEMPLATE).channels  # not a harmony template
    prefill = _shaped(HARMONY_TEMPLATE, messages=[*ASK, {"role": "assistant", "content": "It is"}])
    assert not prefill.channels and prefill.keep == frozenset()  # it goes on inside its message: no header to read
    opened = _shaped(HARMONY_TEMPLATE, messages=[*ASK, OPENED])
    assert opened.channels and opened.opened  # it goes on inside the analysis the prefill opened
    from ui.openai_request import parse_completion

    completion = shape(HarmonyRuntime(), parse_completion({"model": "x", "prompt": "Once"}, Sampling()))
    assert not completion.channels and completion.keep == frozenset()  # raw text, as it was


# ---- through the real app and the official clients ----


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The real app with no model loaded, then the script as its runtime; (the script, openai, anthropic)."""
    script = HarmonyRuntime()
    with serving_script(script, tmp_path_factory.mktemp("harmony-reply")) as clients:
        yield (script, *clients)


def test_the_openai_api_sends_the_analysis_as_reasoning_content_and_the_final_channel_as_content(served):
    fake, client, _ = served
    fake.script = ANALYSIS + FINAL
    message = client.chat.completions.create(model="x", messages=ASK, max_tokens=99).choices[0].message
    assert (message.model_extra.get("reasoning_content"), message.content) == (THOUGHT, ANSWER)


def test_the_openai_stream_sends_delta_reasoning_content_then_delta_content(served):
    fake, client, _ = served
    fake.script = ANALYSIS + FINAL
    chunks = list(client.chat.completions.create(model="x", messages=ASK, max_tokens=99, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = [
        "reasoning" if (d.model_extra or {}).get("reasoning_content") else "content"
        for d in deltas
        if (d.model_extra or {}).get("reasoning_content") or d.content
    ]
    assert kinds[0] == "reasoning" and kinds[-1] == "content" and kinds == sorted(kinds, reverse=True), kinds
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_call_the_model_writes_without_tools_is_content(served):
    fake, client, _ = served
    fake.script = ANALYSIS + CALL
    choice = client.chat.completions.create(model="x", messages=ASK, max_tokens=99).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert (choice.message.model_extra.get("reasoning_content"), choice.message.content) == (
        THOUGHT,
        '{"city": "Oslo"}',
    )


def test_the_anthropic_api_sends_a_thinking_block_then_the_text(served):
    fake, _, claude = served
    fake.script = ANALYSIS + FINAL
    whole = claude.messages.create(model="x", messages=ASK, max_tokens=99)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in whole.content] == [
        ("thinking", THOUGHT), ("text", ANSWER)
    ]  # fmt: skip


def test_the_anthropic_stream_sends_thinking_deltas_then_text_deltas(served):
    fake, _, claude = served
    fake.script = ANALYSIS + FINAL
    with claude.messages.stream(model="x", messages=ASK, max_tokens=99) as stream:
        deltas = [(e.delta.type, getattr(e.delta, "thinking", None) or e.delta.text) for e in stream
                  if e.type == "content_block_delta"]  # fmt: skip
        final = stream.get_final_message()
    assert "".join(t for kind, t in deltas if kind == "thinking_delta") == THOUGHT
    assert "".join(t for kind, t in deltas if kind == "text_delta") == ANSWER
    assert [b.type for b in final.content] == ["thinking", "text"] and final.stop_reason == "end_turn"


def test_the_raw_completion_is_the_text_as_before(served):
    fake, client, _ = served
    fake.script = ANALYSIS + FINAL
    text = client.completions.create(model="x", prompt="Once", max_tokens=99).choices[0].text
    assert text == "analysisThe user asks.assistantfinalIt is dry."  # special tokens left out, as decode skips them


# ---- the chat ----


@pytest.fixture
def chat(tmp_path):
    from fmoe_local.config import RuntimeConfig
    from store import open_store
    from ui.session import Session

    store = open_store(tmp_path)
    session = Session(store=store, config=RuntimeConfig())
    session.runtime = HarmonyRuntime()
    conv = store.chats.create("weather")
    store.chats.append(conv.id, "user", ASK[0]["content"])
    yield session, conv.id
    store.close()


def test_the_chat_folds_the_analysis_as_its_thought_and_the_next_turn_reads_only_the_answer(chat):
    from ui import chat_flow

    session, conv_id = chat
    session.runtime.script = ANALYSIS + FINAL
    shown = list(chat_flow.reply(session, conv_id, "", Sampling()))
    assert [b.get("metadata", {}).get("title") for b in shown[-1]] == [None, "Thinking", None]
    assert shown[-1][1]["content"] == THOUGHT and shown[-1][2]["content"].startswith(ANSWER)
    assert session.store.chats.messages(conv_id)[-1].content == f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    session.store.chats.append(conv_id, "user", "And tomorrow?")
    seen_prompts = []
    session.runtime.events = _recording(session.runtime.events, seen_prompts)
    list(chat_flow.reply(session, conv_id, "", Sampling()))
    assert seen_prompts[0][1] == {"role": "assistant", "content": ANSWER}  # the thought is not read again


CUT = {"finish_reason": "length", "tokens": 4}


def _continued(session, conv_id: int, stored: str, script: list[str]):  # noqa: ANN001, ANN202
    """Continue the reply `stored` (cut by the length limit) with `script`: (the prompt read, the bubbles shown
    last, the reply as stored)."""
    from ui import chat_flow

    session.store.chats.append(conv_id, "assistant", stored, CUT)
    session.runtime.script, prompts = script, []
    session.runtime.events = _recording(session.runtime.events, prompts)
    *_, shown = list(chat_flow.continue_reply(session, conv_id, "", Sampling()))
    return prompts[0], shown, session.store.chats.messages(conv_id)[-1].content


def test_a_reply_cut_inside_its_thought_goes_on_in_it_and_its_answer_is_shown_unfolded(chat):
    """The model reads its thought as an analysis message still open (the template renders `thinking` so:
    Engine.tokenize_prompt), and writes the rest of it, its end and the final channel: kept, so the answer is the
    answer, not more thought."""
    session, conv_id = chat
    more = [" It", " is", " about", " rain", ".", "<|end|>"]
    prompt, shown, stored = _continued(session, conv_id, f"<think>\n{THOUGHT}", more + FINAL)
    assert prompt[-1] == {"role": "assistant", "content": "", "thinking": THOUGHT}
    assert stored == f"<think>\n{THOUGHT} It is about rain.\n</think>\n\n{ANSWER}"  # as a fresh reply is stored
    assert [b.get("metadata", {}).get("title") for b in shown] == [None, "Thinking", None]
    assert shown[1]["content"] == f"{THOUGHT} It is about rain." and shown[2]["content"].startswith(ANSWER)


def test_a_reply_cut_in_its_answer_goes_on_as_its_answer(chat):
    session, conv_id = chat
    prompt, shown, stored = _continued(session, conv_id, f"<think>\n{THOUGHT}\n</think>\n\nIt is", [" dry", "."])
    assert prompt[-1] == {"role": "assistant", "content": "It is", "thinking": THOUGHT}  # its turn as written
    assert stored == f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    assert shown[1]["content"] == THOUGHT and shown[2]["content"].startswith(ANSWER)


def test_a_harmony_template_that_never_shows_a_thought_reads_the_reply_whole_as_before(chat):
    session, conv_id = chat
    session.runtime.chat_template = HARMONY_TEMPLATE.replace("thinking", "analysis_text")
    prompt, _, stored = _continued(session, conv_id, f"<think>\n{THOUGHT}", [" More", "."])
    assert prompt[-1] == {"role": "assistant", "content": f"<think>\n{THOUGHT}"}  # no thought it could end inside
    assert stored == f"<think>\n{THOUGHT} More."


@pytest.mark.parametrize(
    "script",
    [
        ["<|message|>", " x", "<|channel|>"],  # a body marker, then a header never finished
        ["<|end|>", "<|end|>", "<|start|>", "<|message|>", "y", "<|return|>", "z"],
        ["<|channel|>", "final", "<|start|>", "<|channel|>", "<|message|>"],
        [" a", *CALL],  # a call with no tools to call
        ["<|end|>", "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "A", *ANALYSIS, "B"],
    ],
)
def test_a_malformed_continuation_of_a_thought_is_stored_as_text(chat, script):
    session, conv_id = chat
    _, shown, stored = _continued(session, conv_id, f"<think>\n{THOUGHT}", script)
    assert stored.startswith(f"<think>\n{THOUGHT}") and "<|" not in stored
    assert shown[1]["metadata"]["title"] == "Thinking" and shown[1]["content"].startswith(THOUGHT)


def test_a_continued_thought_keeps_its_leading_space_and_only_grows():
    view = harmony_reply.ThoughtText("Rain")
    assert view.add(" or") == " or" and view.add(" snow") == " or snow"  # what goes after the stored reply
    assert view.add("<|end|><|start|>assistant<|channel|>final<|message|>Dry") == " or snow\n</think>\n\nDry"
    later = view.add("<|end|><|start|>assistant<|channel|>analysis<|message|>Sure.")
    assert later == " or snow\nSure.\n</think>\n\nDry"  # later analysis is still the one thought, before the answer
    empty = harmony_reply.ThoughtText("")  # a thought cut before its first word: stored as its marker alone
    assert empty.text == "<think>\n" and empty.add(" So.") == " So."


def _recording(events, prompts: list):  # noqa: ANN001, ANN202 - the fake's events, recording each prompt
    def recorded(prompt, sampling, stop):  # noqa: ANN001, ANN202
        prompts.append(prompt)
        return events(prompt, sampling, stop)

    return recorded


# ---- the real runtime on a tiny GPT-OSS ----

B = 5  # thinking tokens before the runtime writes the analysis' end and the final channel's header


@pytest.fixture(scope="module")
def gpt_oss(tiny_model_dir, tmp_path_factory):
    """(openai client, anthropic client, runtime) on a tiny GPT-OSS whose tokenizer has harmony's markers as special
    tokens, as the real checkpoint's has, served with a harmony template."""
    from tests.api_server import serving
    from tests.tiny import with_special_tokens

    model = with_special_tokens(tiny_model_dir("gpt_oss"), tmp_path_factory.mktemp("oss") / "m", list(HARMONY.markers))
    with serving(model, tmp_path_factory.mktemp("oss-data"), template=HARMONY_TEMPLATE) as (server, session, client):
        claude = anthropic.Anthropic(base_url=server.url.rstrip("/"), api_key="x", max_retries=0, timeout=120)
        yield client, claude, session.runtime


def test_the_real_runtime_s_reply_keeps_its_markers_and_comes_back_as_reasoning_then_content(gpt_oss):
    """The untrained model never ends its analysis: a budget of B tokens makes the runtime end it and open the final
    channel (logits_rules.ThoughtRule), so the reply is B tokens of thought, then an answer."""
    client, claude, runtime = gpt_oss
    messages = [*ASK, OPENED]
    budget = Sampling(greedy=True, max_new_tokens=30, thought=ThoughtBudget(B, *_marks(), True))
    raw = runtime.submit(messages, budget, keep=harmony_reply.kept(runtime)).result().text
    thought, _, answer = raw.partition(HARMONY_ANALYSIS.close)
    assert thought.strip() and answer.strip(), raw
    kwargs = dict(model="x", messages=messages, max_tokens=30, temperature=0, extra_body={"thinking_token_budget": B})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert (message.model_extra.get("reasoning_content"), message.content) == (thought.strip(), answer)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought.strip()
    assert "".join(d.content or "" for d in deltas) == answer
    # No budget: the analysis never ends, so it is all thinking — one block, streamed or not.
    whole = claude.messages.create(model="x", messages=messages, max_tokens=8, extra_body={"temperature": 0})
    assert [b.type for b in whole.content] == ["thinking"] and whole.content[0].thinking.strip()
    with claude.messages.stream(model="x", messages=messages, max_tokens=8, extra_body={"temperature": 0}) as stream:
        assert stream.get_final_message().content == whole.content


def _marks() -> tuple[str, str, str]:
    return HARMONY_ANALYSIS.start, HARMONY_ANALYSIS.end, HARMONY_ANALYSIS.close


@pytest.fixture
def oss_chat(gpt_oss, tmp_path):
    """(session, chat id, runtime): a chat on the tiny GPT-OSS, one question in it."""
    from fmoe_local.config import RuntimeConfig
    from store import open_store
    from ui.session import Session

    store = open_store(tmp_path)
    session = Session(store=store, config=RuntimeConfig())
    session.runtime = gpt_oss[2]  # the server's: this session only borrows it, and does not close it
    conv = store.chats.create("weather")
    store.chats.append(conv.id, "user", ASK[0]["content"])
    yield session, conv.id, session.runtime
    store.close()


def _prompt_text(runtime, messages: list[dict]) -> str:  # noqa: ANN001 - a Runtime
    """The prompt the model reads for `messages`, its special tokens written out."""
    return runtime._engine.tokenizer.decode(runtime.tokenize(messages), skip_special_tokens=False)


def test_the_real_runtime_continues_a_thought_in_its_analysis_and_stores_the_answer_after_it(oss_chat):
    """The prompt ends inside the analysis message, as the harmony template renders a last reply's `thinking` (with
    transformers' continue_final_message="thinking"); a budget of B tokens then writes the analysis' end and the final
    channel's header for the untrained model, and the reply is stored as the old thought + the new one, then the
    answer: what the same request, run alone with its markers kept, writes."""
    from ui import chat_flow

    session, conv_id, runtime = oss_chat
    session.store.chats.append(conv_id, "assistant", f"<think>\n{THOUGHT}", CUT)
    unfinished = [*ASK, {"role": "assistant", "content": "", "thinking": THOUGHT}]
    assert _prompt_text(runtime, unfinished).endswith(f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}")
    budget = Sampling(greedy=True, max_new_tokens=30, thought=ThoughtBudget(B, *_marks(), True))
    raw = runtime.submit(unfinished, budget, keep=harmony_reply.kept(runtime)).result().text
    thought, _, answer = raw.partition(HARMONY_ANALYSIS.close)
    assert thought.strip() and answer.strip() and "<|" not in thought + answer, raw
    *_, shown = list(chat_flow.continue_reply(session, conv_id, "", budget))
    stored = session.store.chats.messages(conv_id)[-1].content
    assert stored == f"<think>\n{THOUGHT}{thought.rstrip()}\n</think>\n\n{answer}"
    assert [b.get("metadata", {}).get("title") for b in shown] == [None, "Thinking", None]
    assert shown[1]["content"].startswith(THOUGHT) and answer.strip() in shown[2]["content"]


def test_the_real_runtime_continues_an_answer_after_its_thought_as_text(oss_chat):
    from ui import chat_flow

    session, conv_id, runtime = oss_chat
    before = f"<think>\n{THOUGHT}\n</think>\n\nIt is"
    session.store.chats.append(conv_id, "assistant", before, CUT)
    unfinished = [*ASK, {"role": "assistant", "content": "It is", "thinking": THOUGHT}]
    assert _prompt_text(runtime, unfinished).endswith(
        f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>It is"
    )
    sampling = Sampling(greedy=True, max_new_tokens=6)
    more = runtime.submit(unfinished, sampling).result().text
    *_, shown = list(chat_flow.continue_reply(session, conv_id, "", sampling))
    assert session.store.chats.messages(conv_id)[-1].content == before + more
    assert shown[1]["content"] == THOUGHT and shown[2]["content"].startswith("It is" + more.rstrip())
