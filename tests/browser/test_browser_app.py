"""Real browser (Debian's chromium via Playwright) against the real entry point (`python app.py`) on a tiny model.

The app runs in a subprocess with tests/browser/netguard on PYTHONPATH: every non-loopback connection or name
lookup it attempts is logged and refused, and the browser's own requests are checked to stay on loopback.
Screenshots go to artifacts/screenshots/ (look at them after a change to the UI).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests import machine_verdicts
from tests.ports import unused_port

# A real browser against a real app started twice: minutes on a busy 2-core machine, not the default 120 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "artifacts" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
STREAM_TIMEOUT_MS = 120_000


if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):  # in CI the browser tests must run: fail loudly rather than skip
        pytest.fail(
            "Debian's chromium is not installed; CI must install it (apt-get install -y chromium)", pytrace=False
        )
    pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")


class App:
    """`python app.py` in a subprocess; `url` once it serves."""

    def __init__(
        self,
        data_dir: Path,
        model: Path,
        net_log: Path,
        port: int | None = None,
        token_delay_s: float = 0.0,
        reply: str = "",
        hold: Path | None = None,
    ) -> None:
        """`port`: one the OS picked unless given (a restart may ask for the first start's `self.port` again);
        `reply`: every reply is this text (tests/browser/netguard/scripted_reply.py), not the tiny model's;
        `hold`: a reply started while this file exists keeps writing and cannot end until the test deletes it
        (tests/browser/netguard/slow_tokens.py)."""
        self.port = unused_port() if port is None else port
        self.data_dir = data_dir
        machine_verdicts.seed(data_dir)  # read back, as at a user's later starts
        env = dict(os.environ)
        if reply:
            env["FMOE_TEST_REPLY"], env["FMOE_TEST_REPLY_MODEL"] = reply, str(model)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "browser" / "netguard"), str(ROOT)])
        env["FMOE_NET_LOG"] = str(net_log)
        if token_delay_s:
            env["FMOE_TEST_TOKEN_DELAY_S"] = str(token_delay_s)  # tests/browser/netguard/slow_tokens.py
        if hold is not None:
            env["FMOE_TEST_TOKEN_HOLD"] = str(hold)
        args = [
            sys.executable,
            str(ROOT / "app.py"),
            "--no-browser",
            "--data-dir",
            str(data_dir),
            "--port",
            str(self.port),
        ]
        args += ["--model", str(model)]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
        )
        self.lines: list[str] = []
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            loaded = False
            for line in self.proc.stdout:
                self.lines.append(line)
                if "serving on" in line:
                    self.url = line.split("serving on", 1)[1].strip()
                # The start-up load runs on a thread of its own: its outcome may come before or after the server.
                loaded = loaded or line.startswith(("fmoe-local: Loaded ", "fmoe-local: Could not load "))
                if self.url and loaded:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(180) or not self.url:
            self.stop()
            raise AssertionError("app did not start:\n" + "".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        machine_verdicts.keep(self.data_dir)


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    SHOTS.mkdir(parents=True, exist_ok=True)
    data = tmp_path_factory.mktemp("browser-data")
    net_log = data.parent / "net.log"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield {"browser": browser, "data": data, "model": tiny_model_dir("mixtral"), "net_log": net_log}
        browser.close()


def open_page(browser, url: str, seen: list[str]):
    page = browser.new_page(viewport={"width": 1360, "height": 960})
    page.on("request", lambda request: seen.append(request.url))
    page.goto(url)
    page.get_by_role("tab", name="Chat").wait_for()
    # The page's load events (the newest chat, the saved generation settings) must land before the test types,
    # or they overwrite what it typed.
    page.locator("#conv-list.loaded").wait_for(state="attached", timeout=60_000)
    return page


def bot_messages(page):
    return page.locator("#chatbot .message.bot, #chatbot [data-testid='bot']")


def set_max_tokens(page, n: int, open_panel: bool = True) -> None:
    """Keep replies short (or long) through the chat's Generation panel."""
    if open_panel:
        page.get_by_text("Generation", exact=True).click()
    box = page.locator("#max-tokens input[type=number]")
    # The slider takes the typed value on Enter; a Send before that would still read the old one. Typed again if
    # it did not take: in clean CI runs a value typed right after the panel opened was now and then not taken.
    for attempt in range(3):
        box.fill(str(n))
        box.press("Enter")
        try:
            page.wait_for_function(
                "n => document.querySelector('#max-tokens input[type=range]')?.value === String(n)",
                arg=n,
                timeout=10_000,
            )
            return
        except sync_api.TimeoutError:
            if attempt == 2:
                raise


def send(page, text: str) -> None:
    page.locator("#chat-input textarea").fill(text)
    page.locator("#send").click()


def test_chat_stop_switch_restart_and_settings(env):
    browser, seen = env["browser"], []
    app = App(env["data"], env["model"], env["net_log"], token_delay_s=0.05)  # a reply of 400 tokens takes 20 s
    try:
        assert_loopback_only(app)
        page = open_page(browser, app.url, seen)
        page.get_by_role("tab", name="Chat").click()
        set_max_tokens(page, 8)  # short replies, except where a long one is wanted

        send(page, "Write a short poem about the sea.")
        page.locator("#chatbot").get_by_text("tok/s").first.wait_for(timeout=STREAM_TIMEOUT_MS)
        assert page.locator("#chatbot").get_by_text("Write a short poem about the sea.").count() == 1
        page.screenshot(path=SHOTS / "chat-reply.png", full_page=True)

        # Stop during a long reply: the reply ends early and says so. The model may still end a reply on its own
        # (a sampled end-of-sequence token) before the press lands; then the same question is asked again.
        set_max_tokens(page, 400, open_panel=False)
        send(page, "Tell me a very long story.")
        endings = []
        for attempt in range(3):
            if attempt:  # the old reply stays on screen until the new one's first token replaces it
                page.locator("#regenerate").click()
                page.wait_for_function(
                    "() => document.querySelectorAll('#chatbot .reply-stats').length === 1", timeout=STREAM_TIMEOUT_MS
                )
            page.wait_for_function(
                "() => document.querySelector('#chatbot')?.innerText.split('Tell me a very long story.')[1]?.trim().length > 6",
                timeout=STREAM_TIMEOUT_MS,
            )
            # Dispatched at once: a plain click first waits for the button to stop moving, and the chat re-renders
            # it with every streamed token, so on a busy machine the reply could go on long before the click landed.
            page.locator("#stop").dispatch_event("click")
            page.wait_for_function(
                "() => document.querySelectorAll('#chatbot .reply-stats').length === 2", timeout=STREAM_TIMEOUT_MS
            )
            endings.append(page.locator("#chatbot .reply-stats").last.inner_text())
            if "stopped" in endings[-1]:
                break
        assert "stopped" in endings[-1], f"Stop never ended a reply; the replies ended with: {endings}"
        page.screenshot(path=SHOTS / "chat-stopped.png", full_page=True)

        # A second conversation, then back to the first: its history is there.
        page.locator("#new-chat").click()
        page.wait_for_function("() => document.querySelector('#chatbot')?.innerText.includes('poem') === false")
        set_max_tokens(page, 4, open_panel=False)  # a new chat starts from the saved defaults
        # Enter sends (as the input's placeholder says).
        page.locator("#chat-input textarea").fill("What is an expert cache?")
        page.locator("#chat-input textarea").press("Enter")
        page.locator("#chatbot").get_by_text("tok/s").first.wait_for(timeout=STREAM_TIMEOUT_MS)
        page.locator("#conv-list").get_by_text("Write a short poem about the sea.").click()
        page.locator("#chatbot").get_by_text("Tell me a very long story.").wait_for()
        assert page.locator("#chatbot").get_by_text("What is an expert cache?").count() == 0
        page.screenshot(path=SHOTS / "chat-switched.png", full_page=True)

        # Settings: change the cache size and see it applied (in experts) without a reload.
        page.get_by_role("tab", name="Settings").click()
        info = page.locator("#model-info").inner_text()
        assert "6 experts" in info or "experts" in info
        cache_input = page.locator("#cache-size input[type=number]")
        cache_input.fill("72")  # KB, the unit the tiny model's sizes are shown in: three experts of 24 KB
        cache_input.press("Enter")
        page.locator("#apply-settings").click()
        page.locator("#settings-status").get_by_text("Applied without reloading").wait_for(timeout=60_000)
        assert "(3 experts)" in page.locator("#settings-status").inner_text()
        page.locator("#app-title").get_by_text("(3 experts)").wait_for(timeout=30_000)
        page.screenshot(path=SHOTS / "settings-applied.png", full_page=True)

        page.get_by_role("tab", name="Stats").click()
        page.locator("#heatmap img, #heatmap canvas, #heatmap svg").first.wait_for(timeout=60_000)
        page.screenshot(path=SHOTS / "stats.png", full_page=True)
        page.get_by_role("tab", name="Models").click()
        page.get_by_text("OLMoE 1B-7B Instruct").wait_for()
        page.screenshot(path=SHOTS / "models.png", full_page=True)

        # A catalog row shows its formats and explains each; the format choice stays the loaded model's (a row is a
        # model to download, not the one Load takes).
        chosen = page.locator("#load-format input:checked").input_value()
        page.locator("#catalog").get_by_text("Mixtral 8x7B Instruct").click()
        page.locator("#fit-detail").get_by_role("columnheader", name="On this computer").wait_for(timeout=30_000)
        assert page.locator("#load-format input:checked").input_value() == chosen
        assert "4-bit (nf4)" in page.locator("#fit-detail").inner_text()  # one row per format, each labelled
        assert "slightly different answers" in page.locator("#fit-detail").inner_text()
        page.screenshot(path=SHOTS / "models-formats.png", full_page=True)
        # Type the running model's folder, pick 4-bit and load it: the note under the formats names the typed
        # folder's model (not the one picked in the list), and the header then says which format is in use.
        name = env["model"].name
        other_tab = open_page(browser, app.url, seen)  # open before the load: its header must follow on its own
        page.get_by_label("…or load a model folder from disk").fill(str(env["model"]))
        page.locator("#format-note").get_by_text(f"For {name}: Load uses Auto.").wait_for()  # its own last choice
        page.locator("#load-format").get_by_text("4-bit: ~4× smaller, slightly different answers").click()
        page.locator("#format-note").get_by_text(f"For {name}: Load uses 4-bit (nf4).").wait_for()
        page.locator("#load-folder").click()
        page.locator("#models-status").get_by_text("experts in 4-bit (nf4)").wait_for(timeout=120_000)
        page.locator("#app-title").get_by_text("experts in 4-bit (nf4)").wait_for(timeout=30_000)
        other_tab.locator("#app-title").get_by_text("experts in 4-bit (nf4)").wait_for(timeout=30_000)
        other_tab.close()
        assert page.locator("#models-status .error, #load-format .error").count() == 0
        page.screenshot(path=SHOTS / "models-loaded-nf4.png", full_page=True)
        page.close()
    finally:
        app.stop()

    # After a restart the conversations and their messages are still there.
    app = App(env["data"], env["model"], env["net_log"])
    try:
        page = open_page(browser, app.url, seen)
        page.get_by_role("tab", name="Chat").click()
        page.locator("#conv-list").get_by_text("Write a short poem about the sea.").click()
        page.locator("#chatbot").get_by_text("Tell me a very long story.").wait_for()
        page.locator("#conv-list").get_by_text("What is an expert cache?").click()
        page.locator("#chatbot").get_by_text("What is an expert cache?").wait_for()
        page.screenshot(path=SHOTS / "after-restart.png", full_page=True)
        # The chosen format was saved: the restart loads 4-bit again (from the copy the first load made).
        assert "experts in 4-bit (nf4)" in page.locator("#app-title").inner_text()
        page.close()
    finally:
        app.stop()

    attempts = env["net_log"].read_text() if env["net_log"].exists() else ""
    assert attempts == "", f"the app tried to reach the network:\n{attempts}"
    hosts = {urlparse(u).hostname for u in seen if u.startswith("http")}
    assert hosts <= {"127.0.0.1", "localhost"}, hosts


def _non_loopback_ip() -> str | None:
    """This machine's address on its default route (no packet is sent: UDP connect only picks a route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1, never routed anywhere real
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def assert_loopback_only(app: App) -> None:
    """Served on 127.0.0.1, refused on this machine's network address (no --listen)."""
    port = urlparse(app.url).port
    assert urlparse(app.url).hostname == "127.0.0.1"
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    ip = _non_loopback_ip()
    if ip is not None:  # a machine without a network address has nothing to refuse
        with pytest.raises(OSError):
            socket.create_connection((ip, port), timeout=5).close()
