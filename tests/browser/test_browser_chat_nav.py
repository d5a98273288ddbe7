"""Real browser, the chat's settings and navigation as LM Studio / Open WebUI users expect them: each chat keeps its
own Generation settings (a reload shows them; another chat shows its own), the page's address names the chat shown
(reload, back and forward return to it, not to the most recently updated one), Escape stops a reply, exported chats
import as new chats (a wrong file gets a sentence), and the light/dark choice is remembered."""

from __future__ import annotations

import json
import re

import pytest

from store.settings import GENERATION_KEYS
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


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    from store import open_store

    SHOTS.mkdir(parents=True, exist_ok=True)
    data = tmp_path_factory.mktemp("chat-nav")
    with open_store(data) as store:
        store.settings.set(max_new_tokens=4)  # the saved defaults: short replies in new chats
        alpha = store.chats.create("Alpha", generation={**store.settings.load().generation(), "temperature": 0.3})
        store.chats.append(alpha.id, "user", "Alpha question?")
        store.chats.append(alpha.id, "assistant", "Alpha answer.", {"tokens_per_s": 9.0, "finish_reason": "stop"})
        beta = store.chats.create("Beta")  # the newest: a bare address opens it
        store.chats.append(beta.id, "user", "Beta question?")
        store.chats.append(beta.id, "assistant", "Beta answer.", {"tokens_per_s": 9.0, "finish_reason": "stop"})
        exported = json.loads(store.chats.export_all_json())
    exported["conversations"] = [c for c in exported["conversations"] if c["conversation"]["title"] == "Alpha"]
    exported["conversations"][0]["conversation"]["title"] = "Alpha, imported"
    files = data.parent / "files"
    files.mkdir(exist_ok=True)
    (files / "chats.json").write_text(json.dumps(exported), encoding="utf-8")
    (files / "notes.json").write_text('{"format": "notes", "items": []}', encoding="utf-8")  # JSON, not an export
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        # 50 ms a token: a 300-token reply streams for 15 s, long enough to press Escape while it runs
        app = App(data, tiny_model_dir("mixtral"), data.parent / "net.log", token_delay_s=0.05)
        try:
            page = open_page(browser, app.url, [])
            yield {"page": page, "alpha": alpha.id, "beta": beta.id, "files": files}
            page.close()
        finally:
            app.stop()
            browser.close()


def address(page) -> str | None:
    found = re.search(r"[?&]chat=([^&#]+)", page.url)
    return found.group(1) if found else None


def wait_address(page, chat: int | str) -> None:
    page.wait_for_function("id => new URLSearchParams(location.search).get('chat') === id", arg=str(chat))


def slider(page, elem_id: str):
    return page.locator(f"#{elem_id} input[type=number]")


def show_generation(page) -> None:
    """The chat's Generation panel open (a click on its title toggles it)."""
    if not slider(page, "temperature").is_visible():
        page.get_by_text("Generation", exact=True).click()


def kept(page, action, value) -> None:
    """Do `action` (a change of one Generation control to `value`) and wait for the server's answer to the event that
    keeps it with the chat (its request: the chat and the panel's values, `value` among them)."""

    def keeping(response) -> bool:
        try:
            data = json.loads(response.request.post_data or "{}").get("data")
        except ValueError:
            return False
        return isinstance(data, list) and len(data) == 1 + len(GENERATION_KEYS) and value in data

    with page.expect_response(keeping, timeout=30_000):
        action()


def set_slider(page, elem_id: str, value: float) -> None:
    box = slider(page, elem_id)
    box.fill(str(value))
    kept(page, lambda: box.press("Enter"), value)


def shown_chat(page, text: str) -> None:
    page.locator("#chatbot").get_by_text(text).wait_for(timeout=30_000)


def test_each_chat_keeps_its_own_settings_across_a_reload(env):
    page = env["page"]
    wait_address(page, env["beta"])  # the bare address opened the newest chat and now names it
    page.locator("#conv-list").get_by_text("Alpha", exact=True).click()
    shown_chat(page, "Alpha answer.")
    page.get_by_text("Generation", exact=True).click()
    page.wait_for_function("() => document.querySelector('#temperature input[type=number]')?.value === '0.3'")
    set_slider(page, "temperature", 1.1)
    set_slider(page, "top-k", 12)
    kept(page, lambda: page.locator("#system textarea").fill("Answer like a pirate."), "Answer like a pirate.")
    page.reload()
    page.locator("#conv-list.loaded").wait_for(state="attached", timeout=60_000)
    shown_chat(page, "Alpha answer.")  # the address's chat, not the newest
    page.get_by_text("Generation", exact=True).click()
    page.wait_for_function("() => document.querySelector('#temperature input[type=number]')?.value === '1.1'")
    assert slider(page, "top-k").input_value() == "12"
    assert page.locator("#system textarea").input_value() == "Answer like a pirate."
    page.screenshot(path=SHOTS / "chat-own-settings.png", full_page=True)
    page.locator("#conv-list").get_by_text("Beta", exact=True).click()  # another chat: its own (the defaults)
    shown_chat(page, "Beta answer.")
    page.wait_for_function("() => document.querySelector('#temperature input[type=number]')?.value === '0.7'")
    assert slider(page, "top-k").input_value() == "0" and page.locator("#system textarea").input_value() == ""
    assert slider(page, "max-tokens").input_value() == "4"


def test_the_address_names_the_chat_for_reload_back_and_forward(env):
    page = env["page"]
    page.locator("#conv-list").get_by_text("Alpha", exact=True).click()
    shown_chat(page, "Alpha answer.")
    wait_address(page, env["alpha"])
    page.locator("#conv-list").get_by_text("Beta", exact=True).click()
    shown_chat(page, "Beta answer.")
    wait_address(page, env["beta"])
    page.go_back()
    shown_chat(page, "Alpha answer.")
    assert address(page) == str(env["alpha"])
    assert page.locator("#conv-list input:checked").input_value() == str(env["alpha"])
    page.go_forward()
    shown_chat(page, "Beta answer.")
    page.go_back()
    shown_chat(page, "Alpha answer.")
    page.reload()  # Alpha, though Beta is the most recently updated
    page.locator("#conv-list.loaded").wait_for(state="attached", timeout=60_000)
    shown_chat(page, "Alpha answer.")
    assert page.locator("#chatbot").get_by_text("Beta answer.").count() == 0
    page.locator("#new-chat").click()
    wait_address(page, "new")
    page.go_back()
    shown_chat(page, "Alpha answer.")


def inputs_of(request) -> list | None:  # noqa: ANN001 - a Playwright request
    """The event's input values a request to the app carries (`data`), None for any other request."""
    try:
        data = json.loads(request.post_data or "{}").get("data")
    except (ValueError, AttributeError):
        return None
    return data if isinstance(data, list) and data else None


class HeldRequest:
    """Holds the page's first request to the app whose inputs (`data`, the event's input values) `matches`
    unanswered, so that event is still pending in the page while the test goes on; `release` lets it through."""

    URL = "**/gradio_api/**"

    def __init__(self, page, matches) -> None:  # noqa: ANN001 - matches: (list) -> bool
        self.page, self.matches, self.routes = page, matches, []
        page.route(self.URL, self.route)

    def route(self, route) -> None:
        data = inputs_of(route.request)
        if not self.routes and data is not None and self.matches(data):
            self.routes.append(route)
        else:
            route.continue_()

    def held(self) -> None:
        """Returns once the request is held (the route handler runs while Playwright waits on the page)."""
        for _ in range(300):
            if self.routes:
                return
            self.page.wait_for_timeout(100)
        raise AssertionError("the page never sent the request to hold")

    def release(self) -> None:
        self.routes[0].continue_()
        self.page.unroute(self.URL, self.route)


def test_an_address_stepped_to_while_the_last_one_is_still_opening_is_shown(env):
    """Gradio drops an event fired while its previous run is pending (trigger_mode "once"): back or forward pressed
    while the chat before was still opening was ignored, and the page kept showing that chat under the new address
    (seen in CI, under load). The history is Alpha, a new chat, Beta; back twice, the second before the first has
    opened the new chat: Alpha is shown."""
    page, alpha, beta = env["page"], env["alpha"], env["beta"]
    listed = page.locator("#conv-list")
    listed.get_by_text("Alpha", exact=True).click()
    shown_chat(page, "Alpha answer.")
    page.locator("#new-chat").click()
    wait_address(page, "new")
    listed.get_by_text("Beta", exact=True).click()
    shown_chat(page, "Beta answer.")
    wait_address(page, beta)
    opening = HeldRequest(page, lambda data: data[0] == "new")  # the opening of the address `new`
    page.go_back()
    opening.held()
    page.go_back()
    wait_address(page, alpha)
    opening.release()
    shown_chat(page, "Alpha answer.")  # without a second opening the new chat stays: neither answer is shown
    assert listed.locator("input:checked").input_value() == str(alpha)


def test_a_setting_changed_twice_while_the_first_change_is_kept_keeps_the_second(env):
    """Gradio drops an event fired while its previous run is pending (trigger_mode "once"): a Generation value
    changed again while the first change was still being kept was never sent, and the chat kept the first value."""
    page = env["page"]
    page.locator("#conv-list").get_by_text("Beta", exact=True).click()
    shown_chat(page, "Beta answer.")
    show_generation(page)
    box, at = slider(page, "temperature"), 1 + GENERATION_KEYS.index("temperature")  # after the chat's id

    def keeps(value: float):  # noqa: ANN202 - a predicate on a request's inputs: the panel's values kept
        return lambda data: len(data) == 1 + len(GENERATION_KEYS) and data[at] == value

    first = HeldRequest(page, keeps(0.9))
    box.fill("0.9")
    box.press("Enter")
    first.held()
    box.fill("1.2")
    with page.expect_response(lambda r: inputs_of(r.request) is not None and keeps(1.2)(inputs_of(r.request))):
        box.press("Enter")  # sent once the held change has been answered
        first.release()
    page.reload()
    page.locator("#conv-list.loaded").wait_for(state="attached", timeout=60_000)
    shown_chat(page, "Beta answer.")  # the newest chat, and the address's
    show_generation(page)
    page.wait_for_function("() => document.querySelector('#temperature input[type=number]')?.value === '1.2'")


def test_a_search_typed_on_while_the_last_one_runs_lists_the_last_one(env):
    """The same for the chat list's search: more typed while a search was still running was never searched, and the
    list kept the shorter search's chats. And a search deleted lists every chat again."""
    page = env["page"]
    listed, search = page.locator("#conv-list"), page.locator("#chat-search textarea")
    held = HeldRequest(page, lambda data: data[0] == "a")  # both chats hold an "a"
    search.press_sequentially("a")
    held.held()
    search.press_sequentially("lpha")  # only Alpha is found by "alpha"
    held.release()
    listed.get_by_text("Beta", exact=True).wait_for(state="detached", timeout=30_000)
    assert listed.get_by_text("Alpha", exact=True).count() == 1
    search.press("Control+a")
    search.press("Backspace")  # a search deleted lists every chat again (Gradio's input event missed a deletion)
    listed.get_by_text("Beta", exact=True).wait_for(timeout=30_000)


def test_escape_stops_a_reply(env):
    page = env["page"]
    page.locator("#new-chat").click()
    wait_address(page, "new")
    set_max_tokens(page, 300, open_panel=not slider(page, "max-tokens").is_visible())
    send(page, "Tell me a very long story.")
    page.wait_for_function(
        "() => document.querySelector('#chatbot')?.innerText.split('Tell me a very long story.')[1]?.trim().length > 6",
        timeout=STREAM_TIMEOUT_MS,
    )
    page.keyboard.press("Escape")
    stats = page.locator("#chatbot .reply-stats")
    stats.first.wait_for(timeout=STREAM_TIMEOUT_MS)
    assert "stopped" in stats.first.inner_text()  # 300 tokens take 15 s: only the key could end it this early
    page.wait_for_function("() => document.querySelector('#send')?.disabled === false", timeout=STREAM_TIMEOUT_MS)
    assert address(page) not in (None, "new")  # the first Send made the chat, and the address names it


def test_import_adds_exported_chats_and_refuses_another_file_in_a_sentence(env):
    page = env["page"]
    page.get_by_text("Rename, delete, export").click()

    def upload(path) -> None:
        with page.expect_file_chooser() as chooser:
            page.locator("#import-chats").click()
        chooser.value.set_files(str(path))

    upload(env["files"] / "notes.json")
    page.locator("#chat-notice").get_by_text("not a chat export of fmoe-local").wait_for(timeout=30_000)
    page.screenshot(path=SHOTS / "chat-import-refused.png", full_page=True)
    upload(env["files"] / "chats.json")
    page.locator("#chat-notice").get_by_text("Imported 1 chat").wait_for(timeout=30_000)
    shown_chat(page, "Alpha answer.")
    listed = page.locator("#conv-list")
    assert listed.get_by_text("Alpha, imported").count() == 1 and listed.get_by_text("Alpha", exact=True).count() == 1
    assert address(page) not in (None, "new", str(env["alpha"]))  # a new chat, beside the original
    page.get_by_text("Generation", exact=True).click()  # its settings came with it
    page.wait_for_function("() => document.querySelector('#temperature input[type=number]')?.value === '0.3'")
    page.screenshot(path=SHOTS / "chat-imported.png", full_page=True)


def test_the_light_or_dark_choice_is_remembered(env):
    page = env["page"]
    page.locator("#theme-choice").get_by_text("Dark", exact=True).click()
    page.wait_for_function("() => document.body.classList.contains('dark')")
    page.screenshot(path=SHOTS / "chat-dark.png", full_page=True)
    page.reload()
    page.locator("#conv-list.loaded").wait_for(state="attached", timeout=60_000)
    page.wait_for_function("() => document.body.classList.contains('dark')")
    assert page.locator("#theme-choice input:checked").input_value() == "Dark"
    page.locator("#theme-choice").get_by_text("Light", exact=True).click()
    page.wait_for_function("() => !document.body.classList.contains('dark')")
    page.reload()
    page.locator("#conv-list.loaded").wait_for(state="attached", timeout=60_000)
    page.wait_for_timeout(1000)  # the load's script has run (the list is loaded after it): Light stays
    assert not page.evaluate("() => document.body.classList.contains('dark')")
