"""Real browser, the chat's actions as LM Studio / Open WebUI users expect them: deleting a chat asks first (and
Gradio's trash icon, which only blanked the view, is gone), and a problem is a sentence in the chat that leaves
every component usable (no red "Error" pills over the chat list, the chat and the input)."""

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
        for title in ("Keep me", "Delete me"):  # "Delete me" is the newest: the page opens it
            conv = store.chats.create(title)
            store.chats.append(conv.id, "user", f"{title}, please.")
            store.chats.append(conv.id, "assistant", "Sure.", {"tokens_per_s": 9.0, "finish_reason": "stop"})
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        app = App(data, tiny_model_dir("mixtral"), data.parent / "net.log", port=7921)
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
    page.wait_for_function("() => document.querySelector('#send').disabled === false", timeout=30_000)
    assert page.locator(ERROR_PILLS).count() == 0
    page.screenshot(path=SHOTS / "chat-inline-problem.png", full_page=True)
    send(page, "Say something about the sea.")
    page.locator("#chatbot").get_by_text("tok/s").first.wait_for(timeout=STREAM_TIMEOUT_MS)
    assert page.locator("#chat-notice").get_by_text("Type a message first.").count() == 0  # cleared by Send
