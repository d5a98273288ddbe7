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

ONE_EXPERT_KB = 24  # tiny Mixtral: 3 × 64 × 32 fp32 weights; its cache size is typed in KB


def _apply_cache(page, size: str) -> None:
    page.get_by_role("tab", name="Settings").click()
    box = page.locator("#cache-size input[type=number]")
    box.fill(size)
    box.press("Enter")
    page.locator("#apply-settings").click()


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    """One browser, and one app for the module until the restart test restarts it (an app start is 14–18 s of CPU:
    docs/bench.md, "fewerstarts"): `env["app"]` is the one running. Neither test changes a setting (both are refused:
    what they test), so each sees the start-up settings."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    data = tmp_path_factory.mktemp("browser-settings")
    model, net_log = tiny_model_dir("mixtral"), data.parent / "net.log"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        env = {"browser": browser, "data": data, "model": model, "net_log": net_log}
        env["app"] = App(data, model, net_log)
        try:
            yield env
        finally:
            env["app"].stop()
            browser.close()


def test_the_cache_size_is_shown_in_kb_and_experts_and_999_or_minus_1_are_refused_not_clamped(env):
    """…and the expert format's choice fits its field."""
    page = open_page(env["browser"], env["app"].url, [])
    try:
        page.get_by_role("tab", name="Settings").click()
        field = page.locator("#cache-size")
        field.get_by_text("Expert cache (KB)").wait_for(timeout=30_000)  # not 0.000732421875 GB
        page.locator("#cache-experts").get_by_text("768 KB = 32 experts of 24 KB each").wait_for(timeout=30_000)
        for typed, sentence in (("999", "more than all of this model's experts"), ("-1", "at least one expert")):
            _apply_cache(page, typed)
            page.locator("#settings-status").get_by_text(sentence).wait_for(timeout=30_000)
            assert field.locator("input[type=number]").input_value() == typed  # refused, never clamped
            assert page.locator("#settings-status .error, #model-info .error").count() == 0
        page.screenshot(path=SHOTS / "settings-cache-refused.png", full_page=True)
        # The expert format's choice is read whole (Auto's long label was cut off); its help line says the rest.
        chosen = page.locator("#expert-format input")
        assert chosen.input_value() == "Auto: the checkpoint's own form"
        assert chosen.evaluate("e => e.scrollWidth <= e.clientWidth"), "the format's label is cut off"
        page.locator("#expert-format").get_by_text("a 4-bit download stays 4-bit").wait_for(timeout=30_000)
        assert "(32 experts)" in page.locator("#app-title").inner_text()  # nothing changed
    finally:
        page.close()


def test_impossible_cache_size_is_refused_and_the_chat_and_a_restart_still_work(env):
    browser, app = env["browser"], env["app"]
    page = open_page(browser, app.url, [])
    try:
        too_small = str(ONE_EXPERT_KB / 2)  # half an expert
        for _ in range(2):  # the second Apply used to pass and save the bad value
            _apply_cache(page, too_small)
            page.get_by_text("must hold at least one expert").first.wait_for(timeout=30_000)
        page.screenshot(path=SHOTS / "settings-refused.png", full_page=True)
        page.get_by_role("tab", name="Chat").click()
        set_max_tokens(page, 4)
        send(page, "Say something about the sea.")
        page.locator("#chatbot").get_by_text("tok/s").first.wait_for(timeout=STREAM_TIMEOUT_MS)
        assert "Generation failed" not in page.locator("#chatbot").inner_text()
    finally:
        page.close()
    app.stop()
    env["app"] = app = App(env["data"], env["model"], env["net_log"], port=app.port)  # the same address again
    assert not any("No model" in line for line in app.lines), "".join(app.lines)
    page = open_page(browser, app.url, [])
    try:
        send(page, "And about the ships?")
        page.locator("#chatbot").get_by_text("tok/s").first.wait_for(timeout=STREAM_TIMEOUT_MS)
    finally:
        page.close()
