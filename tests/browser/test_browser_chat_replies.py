"""Real browser, what a reply is made of: a reasoning model's thinking is a folded "Thinking" block above the answer
(closed until clicked, never part of the answer's text, the same after a reload), and a chat's own context length
leaves its oldest turns out of what the model reads, which the reply says and a reload keeps (issues 28 and 30).

The model is the tiny test model made to write a fixed reply with `<think>…</think>` (netguard/scripted_reply.py):
its random weights would never write the markers; for GPT-OSS, a tiny GPT-OSS writing harmony's channels."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.browser.test_browser_app import CHROMIUM, CHROMIUM_ARGS, SHOTS, STREAM_TIMEOUT_MS, App, open_page, send

# A real browser against a real app: minutes on a busy 2-core machine, not the default 120 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
sync_api = pytest.importorskip("playwright.sync_api")

THOUGHT, ANSWER = "The user greets me, so I greet back.", "Hello from the model."
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"


@pytest.fixture(scope="module")
def browser():
    """One chromium for the module's tests; each test starts its own app (its own model and scripted reply)."""
    with sync_api.sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@contextmanager
def new_chat(browser, data: Path, model: Path, net_log: Path, reply: str) -> Iterator[tuple]:  # noqa: ANN001
    """The app on `model` writing `reply`, a page on a new chat; (page, the chatbot). The app stops at the end."""
    app = App(data, model, net_log, reply=reply)
    try:
        page = open_page(browser, app.url, [])
        page.locator("#new-chat").click()
        page.wait_for_function("() => new URLSearchParams(location.search).get('chat') === 'new'")
        yield page, page.locator("#chatbot")
    finally:
        app.stop()


def test_thinking_is_folded_above_the_answer_and_a_chats_context_length_survives_a_reload(
    browser, tiny_model_dir, tmp_path
):
    from store import open_store

    SHOTS.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "data"
    data.mkdir()
    with open_store(data) as store:
        store.settings.set(max_new_tokens=64)  # the scripted reply is shorter: it ends on its own
        long = store.chats.create("Long chat")
        for turn in ("first", "second", "third"):  # each turn far longer than the context length set below
            store.chats.append(long.id, "user", f"The {turn} question, " + "with many more words to read " * 8)
            store.chats.append(long.id, "assistant", f"The {turn} answer, " + "with as many words in it " * 8)
    with new_chat(browser, data, tiny_model_dir("mixtral"), tmp_path / "net.log", REPLY) as (page, chat):
        send(page, "Hi there.")
        chat.locator(".reply-stats").first.wait_for(timeout=STREAM_TIMEOUT_MS)
        thought = chat.locator(".thought-group")
        assert thought.count() == 1 and "Thinking" in thought.inner_text()
        assert ANSWER in chat.inner_text() and THOUGHT not in chat.inner_text()  # folded: not shown
        assert ANSWER not in thought.inner_text()  # the answer is its own bubble, under the block
        page.screenshot(path=SHOTS / "chat-thinking-folded.png", full_page=True)
        thought.locator("[role=button]").first.click()  # unfolds
        page.wait_for_function("t => document.querySelector('#chatbot')?.innerText.includes(t)", arg=THOUGHT)
        assert THOUGHT in thought.inner_text()
        page.screenshot(path=SHOTS / "chat-thinking-open.png", full_page=True)

        page.reload()  # the chat the address names, its reply saved with its thought: folded again
        page.locator("#conv-list.loaded").wait_for(state="attached", timeout=60_000)
        chat.locator(".thought-group").first.wait_for(timeout=30_000)
        assert ANSWER in chat.inner_text() and THOUGHT not in chat.inner_text()

        # The long chat with a context length of 64 tokens: only the last question is sent, and the reply says so.
        page.locator("#conv-list label", has_text="Long chat").click()
        chat.get_by_text("The third answer").wait_for(timeout=30_000)
        page.get_by_text("Generation", exact=True).click()
        box = page.locator("#context-length input")
        box.fill("64")
        box.press("Tab")
        send(page, "And now?")
        said = chat.get_by_text("earlier messages not sent (context length 64)")
        said.wait_for(timeout=STREAM_TIMEOUT_MS)
        assert "6 earlier messages not sent" in chat.locator(".reply-stats").last.inner_text()
        page.reload()
        page.locator("#conv-list.loaded").wait_for(state="attached", timeout=60_000)
        said.wait_for(timeout=30_000)
        page.get_by_text("Generation", exact=True).click()
        assert page.locator("#context-length input").input_value() == "64"  # kept with the chat


HARMONY_REPLY = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"


def test_gpt_oss_s_analysis_channel_is_the_folded_thought_above_its_final_channel(browser, tiny_model_dir, tmp_path):
    """A tiny GPT-OSS whose tokenizer has harmony's markers as special tokens, as the real one has, writing a scripted
    harmony reply: the analysis channel is the folded block, the final channel the answer — before, the markers were
    left out of the reply's text and the chat showed "analysis…assistantfinal…" as one answer."""
    from tests.tiny import with_special_tokens
    from tests.tool_templates import HARMONY_TEMPLATE
    from ui.tool_calls import HARMONY

    model = with_special_tokens(tiny_model_dir("gpt_oss"), tmp_path / "gpt-oss", list(HARMONY.markers))
    (model / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    data = tmp_path / "data"
    data.mkdir()
    with new_chat(browser, data, model, tmp_path / "net.log", HARMONY_REPLY) as (page, chat):
        send(page, "Hi there.")
        chat.locator(".reply-stats").first.wait_for(timeout=STREAM_TIMEOUT_MS)
        thought = chat.locator(".thought-group")
        assert thought.count() == 1 and "Thinking" in thought.inner_text(), chat.inner_text()
        assert ANSWER in chat.inner_text() and THOUGHT not in chat.inner_text()  # folded: not shown
        assert "analysis" not in chat.inner_text() and "final" not in chat.inner_text()  # no channel names
        thought.locator("[role=button]").first.click()  # unfolds
        page.wait_for_function("t => document.querySelector('#chatbot')?.innerText.includes(t)", arg=THOUGHT)
        assert ANSWER not in thought.inner_text()
