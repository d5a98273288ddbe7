"""Real browser, the built-in demo model: no screen and no API answer calls it "weights" (its folder's name), and
the API lists it as "demo" and answers requests that name it so."""

from __future__ import annotations

import pytest

from tests.browser.test_browser_app import CHROMIUM, CHROMIUM_ARGS, App, open_page

# A real browser against a real app: minutes on a busy 2-core machine, not the default 120 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
sync_api = pytest.importorskip("playwright.sync_api")


def test_the_demo_model_is_called_demo_not_weights(tmp_path):
    from fmoe_local.demo import demo_model_dir

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        app = App(tmp_path / "data", demo_model_dir(), tmp_path / "net.log")
        try:
            page = open_page(browser, app.url, [])
            page.locator("#app-title").get_by_text("Demo model").wait_for(timeout=30_000)
            shown = {"Chat": "#chatbot", "Settings": "#model-info", "Models": "#machine"}
            for tab, element in shown.items():
                page.get_by_role("tab", name=tab).click()
                page.wait_for_function(
                    "s => document.querySelector(s)?.innerText.trim().length > 0", arg=element, timeout=30_000
                )
                assert "weights" not in page.locator("body").inner_text(), tab
            models = page.request.get(f"{app.url}v1/models").json()
            assert [m["id"] for m in models["data"]] == ["demo"]
            body = {"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
            reply = page.request.post(f"{app.url}v1/chat/completions", data=body)
            assert reply.status == 200 and reply.json()["model"] == "demo"
            page.close()
        finally:
            app.stop()
        browser.close()
