"""Real browser, the chat's actions as LM Studio / Open WebUI users expect them: deleting a chat asks first (and
Gradio's trash icon, which only blanked the view, is gone), a problem is a sentence in the chat that leaves every
component usable (no red "Error" pills over the chat list, the chat and the input), a reply cut by the token limit
can be continued in the same message, Regenerate keeps the earlier reply ("< 1/2 >", kept across a reload), and
any message of the user's can be edited."""

from __future__ import annotations

import pytest

from tests.browser.test_browser_app import (
    CHROMIUM,
    CHROMIUM_ARGS,
    SHOTS,
    STREAM_TIMEOUT_MS,
    App,
    open_page,
    send,
    set_max_tokens,
)

# A real browser against a real app: minutes on a busy 2-core machine, not the default 120 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
sync_api = pytest.importorskip("playwright.sync_api")

ERROR_PILLS = "#chatbot .error, #conv-list .error, #chat-input .error"


@pytest.fixture(scope="module")
def page(tiny_model_dir, tmp_path_factory):
    from store import open_store

    SHOTS.mkdir(parents=True, exist_ok=True)
    data = tmp_path_factory.mktemp("chat-actions")
    with open_store(data) as store:
        store.settings.set(max_new_tokens=4)  # the defaults of every chat here: short replies
        cut = store.chats.create("Cut reply")
        store.chats.append(cut.id, "user", "Tell me a long story.")
        store.chats.append(cut.id, "assistant", "Once upon a time", {"tokens_per_s": 7.0, "finish_reason": "length"})
        two = store.chats.create("Two answers")
        store.chats.append(two.id, "user", "What is the sea?")
        store.chats.append(two.id, "assistant", "First answer.", {"tokens_per_s": 8.0, "finish_reason": "stop"})
        edit = store.chats.create("Edit me")
        for question in ("First question?", "Second question?"):
            store.chats.append(edit.id, "user", question)
            store.chats.append(edit.id, "assistant", f"Answer to {question}", {"finish_reason": "stop"})
        for title in ("Keep me", "Delete me"):  # "Delete me" is the newest: the page opens it
            conv = store.chats.create(title)
            store.chats.append(conv.id, "user", f"{title}, please.")
            store.chats.append(conv.id, "assistant", "Sure.", {"tokens_per_s": 9.0, "finish_reason": "stop"})
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        app = App(data, tiny_model_dir("mixtral"), data.parent / "net.log")
        try:
            page = open_page(browser, app.url, [])
            set_max_tokens(page, 4)
            yield page
            page.close()
        finally:
            app.stop()
            browser.close()


def test_deleting_a_chat_asks_first_and_the_trash_icon_is_gone(page):
    chat, listed = page.locator("#chatbot"), page.locator("#conv-list")
    chat.get_by_text("Delete me, please.").wait_for(timeout=30_000)
    assert chat.locator("button[aria-label='Clear']").filter(visible=True).count() == 0
    page.get_by_text("Rename, delete, export").click()
    page.locator("#delete-chat").click()
    confirm = page.locator("#confirm-delete")
    confirm.get_by_text("Yes, delete “Delete me”").wait_for(timeout=30_000)
    assert listed.get_by_text("Delete me").count() == 1  # asked, nothing deleted yet
    page.screenshot(path=SHOTS / "chat-delete-asks.png", full_page=True)
    page.locator("#keep-chat").click()
    page.locator("#delete-chat").wait_for(timeout=30_000)
    assert listed.get_by_text("Delete me").count() == 1
    page.locator("#delete-chat").click()
    confirm.click()
    listed.get_by_text("Delete me").wait_for(state="detached", timeout=30_000)
    assert listed.get_by_text("Keep me").count() == 1


def test_a_problem_is_said_in_the_chat_and_the_chat_stays_usable(page):
    page.locator("#new-chat").click()
    page.locator("#chat-input textarea").fill("   ")
    page.locator("#send").click()
    page.locator("#chat-notice").get_by_text("Type a message first.").wait_for(timeout=30_000)
    page.wait_for_function("() => document.querySelector('#send')?.disabled === false", timeout=30_000)
    assert page.locator(ERROR_PILLS).count() == 0
    page.screenshot(path=SHOTS / "chat-inline-problem.png", full_page=True)
    send(page, "Say something about the sea.")
    page.locator("#chatbot").get_by_text("tok/s").first.wait_for(timeout=STREAM_TIMEOUT_MS)
    assert page.locator("#chat-notice").get_by_text("Type a message first.").count() == 0  # cleared by Send


def bubbles(page, role: str):
    return page.locator(f"#chatbot .message-row.{'bot' if role == 'assistant' else 'user'}-row")


def test_continue_goes_on_with_the_same_message(page):
    page.wait_for_function("() => document.querySelector('#send')?.disabled === false", timeout=STREAM_TIMEOUT_MS)
    page.locator("#conv-list").get_by_text("Cut reply").click()
    chat = page.locator("#chatbot")
    # This chat's own text first: the previous test's chat also ends with a cut reply, so "length limit reached"
    # alone can match it before the switch lands, and Continue would then rightly go on with that chat.
    chat.get_by_text("Once upon a time").wait_for(timeout=60_000)
    chat.get_by_text("length limit reached").wait_for(timeout=60_000)
    page.locator("#continue").click(timeout=60_000)
    chat.get_by_text("7.0 tok/s").wait_for(state="detached", timeout=STREAM_TIMEOUT_MS)  # the new stats line
    page.wait_for_function("() => document.querySelector('#send')?.disabled === false", timeout=STREAM_TIMEOUT_MS)
    assert bubbles(page, "assistant").count() == 1  # appended to the reply, not a new one
    assert bubbles(page, "assistant").first.inner_text().startswith("Once upon a time")
    page.screenshot(path=SHOTS / "chat-continued.png", full_page=True)


def test_regenerate_keeps_the_earlier_reply_and_the_choice_survives_a_reload(page):
    page.locator("#conv-list").get_by_text("Two answers").click()
    page.locator("#chatbot").get_by_text("First answer.").wait_for(timeout=30_000)
    page.locator("#regenerate").click()
    label = page.locator("#alt-label")
    label.get_by_text("2/2").wait_for(timeout=STREAM_TIMEOUT_MS)
    assert bubbles(page, "assistant").count() == 1
    page.locator("#alt-prev").click()
    label.get_by_text("1/2").wait_for(timeout=30_000)
    page.locator("#chatbot").get_by_text("First answer.").wait_for(timeout=30_000)
    page.screenshot(path=SHOTS / "chat-alternatives.png", full_page=True)
    page.reload()
    page.locator("#conv-list.loaded").wait_for(state="attached", timeout=60_000)
    page.locator("#conv-list").get_by_text("Two answers").click()
    label.get_by_text("1/2").wait_for(timeout=30_000)  # kept in the store, the chosen one too
    page.locator("#chatbot").get_by_text("First answer.").wait_for(timeout=30_000)
    page.locator("#alt-next").click()
    label.get_by_text("2/2").wait_for(timeout=30_000)
    set_max_tokens(page, 4)  # the reload brought back the saved value; keep replies short


def test_an_earlier_message_can_be_edited_and_the_chat_goes_on_from_it(page):
    page.locator("#conv-list").get_by_text("Edit me").click()
    first = bubbles(page, "user").filter(has_text="First question?")
    first.wait_for(timeout=30_000)
    first.hover()
    page.locator("#chatbot").get_by_role("button", name="Edit").first.click()  # user messages only: the first
    box = page.locator("#chatbot textarea")
    box.fill("A changed question?")
    page.locator("#chatbot").get_by_role("button", name="Submit").click()
    chat = page.locator("#chatbot")
    chat.get_by_text("Second question?", exact=True).wait_for(state="detached", timeout=STREAM_TIMEOUT_MS)
    page.wait_for_function("() => document.querySelector('#send')?.disabled === false", timeout=STREAM_TIMEOUT_MS)
    chat.get_by_text("tok/s").first.wait_for(timeout=STREAM_TIMEOUT_MS)
    assert bubbles(page, "user").count() == 1 and "A changed question?" in bubbles(page, "user").first.inner_text()
    assert bubbles(page, "assistant").count() == 1
    page.screenshot(path=SHOTS / "chat-edited.png", full_page=True)
