"""gradio_client against the real app (ui.build + Session + store) serving a tiny model on loopback.

One app per module: starting Gradio costs seconds on a busy CI box. Tests run in file order and share the
conversation state of one client, like one browser tab would.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import time
from pathlib import Path

import pytest

from tests.ports import unused_port

pytestmark = pytest.mark.slow

gradio_client = pytest.importorskip("gradio_client")


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    from app import LOOPBACK
    from fmoe_local.config import RuntimeConfig
    from store import open_store
    from ui import build
    from ui.session import Session

    data = tmp_path_factory.mktemp("appdata")
    store = open_store(data)
    model = tiny_model_dir("mixtral")
    session = Session(store=store, config=RuntimeConfig(device="cpu", cache_experts=6))
    message = session.load(model)
    assert session.runtime is not None, message
    demo = build(session)
    demo.queue(default_concurrency_limit=1)
    demo.launch(server_name=LOOPBACK, server_port=unused_port(), prevent_thread_lock=True, quiet=True)
    client = gradio_client.Client(demo.local_url, verbose=False)
    yield session, client, model
    client.close()
    demo.close()
    session.close()
    store.close()


def _text(message: dict) -> str:
    """A Chatbot message's text: Gradio 6 sends content as a list of typed parts."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def _send(client, text: str, max_tokens: int = 6):
    # Inputs as the browser sends them: message, then the Generation panel's values (store.settings.GENERATION_KEYS):
    # system prompt, temperature (0 = greedy), top-p, top-k, max tokens, repetition, frequency and presence penalties,
    # the context length (0: all).
    return client.predict(text, *_generation(max_tokens), api_name="/send")


def _generation(max_tokens: int) -> tuple:
    return "", 0.0, 0.9, 0, max_tokens, 1.0, 0.0, 0.0, 0


def test_send_streams_a_reply_and_stores_it(served):
    session, client, _ = served
    job = client.submit("Write a short poem about the sea.", *_generation(6), api_name="/send")
    outputs = list(job)  # every streamed update
    chatbot = job.result()[0]
    assert len(outputs) >= 3  # the placeholder, then token by token
    assert [m["role"] for m in chatbot] == ["user", "assistant"]
    assert "tok/s" in _text(chatbot[1]) and "expert hit rate" in _text(chatbot[1])
    conv = session.store.chats.list()[0]
    stored = session.store.chats.messages(conv.id)
    assert [m.role for m in stored] == ["user", "assistant"]
    assert stored[1].content and "tok/s" not in stored[1].content  # the stats line is display-only
    assert stored[1].stats["tokens"] == 6
    assert session.last_stats is not None and session.last_stats.tokens == 6


def test_second_turn_sees_history_and_regenerate_replaces_reply(served):
    session, client, _ = served
    chatbot = _send(client, "And another one.")[0]
    assert [m["role"] for m in chatbot] == ["user", "assistant"] * 2
    conv = session.store.chats.list()[0]
    before = session.store.chats.messages(conv.id)
    chatbot = client.predict(*_generation(6), api_name="/regenerate")[0]
    after = session.store.chats.messages(conv.id)
    assert len(after) == len(before) == 4
    assert after[-1].content == before[-1].content  # greedy, so the same text
    assert len(after[-1].alternatives) == 2 and after[-1].chosen == 1  # a new reply; the earlier one is kept
    assert len(chatbot) == 4


def test_stop_ends_a_long_reply_early(served):
    session, client, _ = served
    job = client.submit("Tell me a very long story.", *_generation(400), api_name="/send")
    deadline = time.monotonic() + 120
    while len(job.outputs()) < 3 and time.monotonic() < deadline:  # a few tokens have streamed
        time.sleep(0.05)
    client.predict(api_name="/stop")
    job.result(timeout=120)
    conv = session.store.chats.list()[0]
    last = session.store.chats.messages(conv.id)[-1]
    assert last.role == "assistant"
    assert last.stats["finish_reason"] == "cancelled"
    assert last.stats["tokens"] < 400


def test_conversation_list_new_search_rename_delete(served):
    session, client, _ = served
    first = session.store.chats.list()[0]
    client.predict(api_name="/new_chat")
    _send(client, "What is an expert cache?")
    convs = session.store.chats.list()
    assert len(convs) == 2 and convs[0].title == "What is an expert cache?"
    # State inputs (the open conversation) stay server-side too: the client passes only visible inputs.
    found, _ = client.predict("poem", api_name="/search_chats")
    assert [c[1] for c in found["choices"]] == [first.id]
    # Switching back shows the first conversation's history.
    # The State output stays server-side; then the list, the title, the address and the chat's Generation values.
    chatbot, _, title, address, system, *_ = client.predict(first.id, api_name="/open_chat")
    assert (title, address, system) == (first.title, str(first.id), "")
    assert _text(chatbot[0]) == "Write a short poem about the sea."
    client.predict("Sea poems", api_name="/rename_chat")
    assert session.store.chats.get(first.id).title == "Sea poems"
    exported, _ = client.predict(api_name="/export_chat")  # an update that also makes the file visible
    text = Path(exported["value"]).read_text(encoding="utf-8")
    assert text.startswith("# Sea poems") and "Write a short poem about the sea." in text
    client.predict(api_name="/delete_chat")  # asks first
    assert len(session.store.chats.list()) == 2
    client.predict(api_name="/confirm_delete_chat")
    assert [c.id for c in session.store.chats.list()] == [convs[0].id]


def test_settings_apply_without_reload_and_are_saved(served):
    session, client, _ = served
    runtime = session.runtime
    info = runtime.info
    three = 3 * info.expert_bytes / 1024  # room for three experts, in KB: the unit a tiny model's cache is shown in
    _, status = client.predict(three, 2, "lru", 50, api_name="/apply_settings")
    assert session.runtime is runtime  # not reloaded
    assert runtime.info.cache_experts == 3 and runtime.info.policy == "lru"
    assert "Applied without reloading" in status and "3 experts" in status
    saved = session.store.settings.load()
    assert saved.policy == "lru" and saved.prefetch_distance == 2 and saved.store_capacity == 50
    _, status = client.predict(three, 4, "fmoe", 50, api_name="/apply_settings")
    assert "prefetch distance can be 1 to 3" in status and runtime.info.policy == "lru"  # refused, nothing changed


def test_model_list_load_and_delete(served, tmp_path):
    session, client, model = served
    dest = session.models_dir / "acme--tiny-moe"
    shutil.copytree(model, dest)
    (dest / ".fmoe-download.json").write_text(json.dumps({"repo_id": "acme/tiny-moe"}))
    listed = client.predict(api_name="/list_models")
    assert [m["repo_id"] for m in listed] == ["acme/tiny-moe"]
    status = client.predict(str(dest), api_name="/load_model")
    assert status.startswith("Loaded acme--tiny-moe")
    assert session.model_dir == dest
    assert session.store.settings.load().last_model == str(dest)
    with pytest.raises(gradio_client.exceptions.AppError, match="not a model folder"):
        client.predict(str(tmp_path), api_name="/load_folder")
    client.predict(str(dest), api_name="/delete_model")
    assert not dest.exists() and session.runtime is None
    said = _send(client, "Anyone there?")[-1]  # in the chat's notice line, not an error over the components
    assert "No model is loaded" in said["value"]


def test_wizard_downloads_from_the_hub_then_loads(served, tmp_path):
    from tests.test_ui_downloads import FakeHub

    session, client, model = served
    files = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    files["README.md"] = b"not needed"
    hub = FakeHub(files)
    session.endpoint = hub.url
    try:
        job = client.submit("acme/tiny-moe", "", api_name="/download")
        updates = list(job)  # the sentences, without the page's progress bar
        progress = job.result()
    finally:
        hub.close()
        session.endpoint = None
    assert "Downloaded acme/tiny-moe" in progress, progress
    assert any("Downloading acme/tiny-moe" in u for u in updates)
    dest = session.models_dir / "acme--tiny-moe"
    assert not (dest / "README.md").exists()
    assert [m["repo_id"] for m in client.predict(api_name="/list_models")] == ["acme/tiny-moe"]
    assert client.predict(str(dest), api_name="/load_model").startswith("Loaded acme--tiny-moe")
    chatbot = _send(client, "Hello again")[0]
    assert "tok/s" in _text(chatbot[-1])


def test_wizard_says_when_offline(served):
    session, client, _ = served
    with socket.socket() as s:  # a port nobody listens on: connection refused, like no network
        s.bind(("127.0.0.1", 0))
        session.endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    try:
        progress = client.predict("acme/other-moe", "", api_name="/download")
    finally:
        session.endpoint = None
    assert "offline" in progress
    # A script hears a download that cannot start as an error (the page says it as a sentence instead).
    with pytest.raises(gradio_client.exceptions.AppError, match="owner/name"):
        client.predict("not a repo", "", api_name="/download")


def test_a_nan_temperature_sent_to_the_send_endpoint_is_refused_and_not_saved(served):
    # The attack as a script on this computer made it (gradio_client will not encode a NaN; JSON parsers take one,
    # and Gradio's slider lets it through). Before: it was saved, and after a restart every Send failed and /v1
    # requests without a temperature got a 400.
    import httpx

    session, client, _ = served
    before = session.store.settings.load()
    url = f"{client.src.rstrip('/')}/gradio_api/call/send"
    body = '{"data": ["Hello?", "", NaN, 0.9, 0, 6, 1.0, 0.0, 0.0, 0]}'
    event = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60).json()
    answer = httpx.get(f"{url}/{event['event_id']}", timeout=120).text
    assert "A temperature of nan is not possible" in answer, answer
    assert session.store.settings.load() == before
    assert all(c.generation is None or math.isfinite(c.generation["temperature"]) for c in session.store.chats.list())
