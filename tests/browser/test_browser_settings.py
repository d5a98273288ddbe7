"""Real browser: an impossible cache size is refused with a sentence and changes nothing — the chat still replies,
a second Apply is refused too (it used to "succeed" and save the bad value), and after a restart the model loads."""

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

# A real browser against a real app started twice: minutes on a busy 2-core machine, not the default 120 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
sync_api = pytest.importorskip("playwright.sync_api")

ONE_EXPERT_GB = 24576 / 1024**3  # tiny Mixtral: 3 × 64 × 32 fp32 weights


def _apply_cache(page, gb: str) -> None:
    page.get_by_role("tab", name="Settings").click()
    box = page.locator("#cache-gb input[type=number]")
    box.fill(gb)
    box.press("Enter")
    page.locator("#apply-settings").click()


def test_impossible_cache_size_is_refused_and_the_chat_and_a_restart_still_work(tiny_model_dir, tmp_path):
    SHOTS.mkdir(parents=True, exist_ok=True)
    data, net_log = tmp_path / "data", tmp_path / "net.log"
    model = tiny_model_dir("mixtral")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        app = App(data, model, net_log, port=7890)
        try:
            page = open_page(browser, app.url, [])
            too_small = f"{ONE_EXPERT_GB / 2:.7f}"  # the slider allows it: half an expert
            for _ in range(2):  # the second Apply used to pass and save the bad value
                _apply_cache(page, too_small)
                page.get_by_text("must hold at least one expert").first.wait_for(timeout=30_000)
            page.screenshot(path=SHOTS / "settings-refused.png", full_page=True)
            page.get_by_role("tab", name="Chat").click()
            set_max_tokens(page, 4)
            send(page, "Say something about the sea.")
            page.locator("#chatbot").get_by_text("tok/s").first.wait_for(timeout=STREAM_TIMEOUT_MS)
            assert "Generation failed" not in page.locator("#chatbot").inner_text()
            page.close()
        finally:
            app.stop()
        app = App(data, model, net_log, port=7890)
        try:
            assert not any("No model" in line for line in app.lines), "".join(app.lines)
            page = open_page(browser, app.url, [])
            send(page, "And about the ships?")
            page.locator("#chatbot").get_by_text("tok/s").first.wait_for(timeout=STREAM_TIMEOUT_MS)
            page.close()
        finally:
            app.stop()
        browser.close()
