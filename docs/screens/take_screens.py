"""Screenshots of each screen with the demo model, from a fresh data folder: from the repo root,
`PYTHONPATH=$PWD python docs/screens/take_screens.py docs/screens` (needs Debian chromium at /usr/bin/chromium)."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
data = Path(tempfile.mkdtemp())
env = dict(os.environ, PYTHONPATH=os.getcwd())
proc = subprocess.Popen(
    [sys.executable, "app.py", "--no-browser", "--data-dir", str(data), "--port", "7961"],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=env,
)
url, loaded = "", False
for line in proc.stdout:
    print(line, end="")
    if "serving on" in line:
        url = line.split("serving on", 1)[1].strip()
    loaded = loaded or line.startswith(("fmoe-local: Loaded ", "fmoe-local: Could not load "))
    if url and loaded:
        break  # the start-up load runs on its own thread: its outcome may come before or after the server
try:
    with sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path="/usr/bin/chromium", args=["--no-sandbox", "--headless", "--disable-gpu"]
        )
        page = b.new_page(viewport={"width": 1360, "height": 900})
        page.goto(url)
        page.get_by_role("tab", name="Chat").wait_for()
        time.sleep(3)
        page.locator("#chat-input textarea").fill("Hello! What can you do?")
        page.locator("#send").click()
        page.wait_for_function("() => document.querySelector('#send').disabled === false", timeout=120_000)
        time.sleep(1)
        page.screenshot(path=out / "chat.png", full_page=True)
        for tab in ("Models", "Settings", "Stats"):
            page.get_by_role("tab", name=tab).click()
            time.sleep(3)
            if tab == "Models":  # a picked catalog model shows its table per expert format
                page.locator("#catalog").get_by_text("DeepSeek-V2-Lite Chat").click()
                time.sleep(2)
            page.screenshot(path=out / f"{tab.lower()}.png", full_page=True)
        b.close()
finally:
    proc.terminate()
    proc.wait(30)
