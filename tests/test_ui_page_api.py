"""Values that reach the app through the page's own API (the endpoints the page calls: /gradio_api/call/send and
the rest, which any program on this computer can call too) are checked as the page's fields are, by the store's one
check of every setting; and a saved value that fails that check is never used: the default stands in and the page
says so (docs/security.md, rows 30a–30c)."""

from __future__ import annotations

import json
import math

import gradio as gr
import pytest

from fmoe_local.config import RuntimeConfig
from store import open_store
from store.settings import AppSettings
from tests.fake_runtime import FakeRuntime

NAN, INF = float("nan"), float("inf")


class HiRuntime(FakeRuntime):
    """Answers "Hi." to anything and keeps the Sampling of every request (the API's and the chat's)."""

    chat_template = None  # no thinking format: the reply is content

    def __init__(self) -> None:
        super().__init__()
        self.sampled: list = []

    def events(self, prompt, sampling, stop):
        from fmoe_local.runtime_types import Finished, TextDelta
        from fmoe_local.stats import RequestStats

        self.sampled.append(sampling)
        yield TextDelta("Hi.", 1)
        yield Finished("Hi.", [1], RequestStats(tokens=1, finish_reason="stop"), "stop")


@pytest.fixture
def page(tmp_path):
    """The whole UI with a fake model loaded and one conversation (a question and its reply); `fn(api_name)`."""
    from ui import build
    from ui.session import Session

    store = open_store(tmp_path)
    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    conv = store.chats.create("sea")
    store.chats.append(conv.id, "user", "Tell me about the sea.")
    store.chats.append(conv.id, "assistant", "Once upon", {"finish_reason": "length", "tokens": 2})
    demo = build(session)
    session.runtime = HiRuntime()  # after the page is built: its header would describe a real model

    def fn(api_name: str):
        return next(f for f in demo.fns.values() if f.api_name == api_name).fn

    yield session, conv.id, fn
    session.runtime = None
    store.close()


def _stored(session) -> dict:
    with session.store.settings._s.lock:
        return dict(session.store.settings._s.db.execute("SELECT key, value_json FROM settings").fetchall())


def _notice(update) -> str:
    return update.value if isinstance(update, gr.Markdown) else update.get("value", "")


def gen(
    system, temperature, top_p, max_tokens, top_k=0, repetition=1.0, frequency=0.0, presence=0.0, context=0
) -> tuple:
    """The Generation panel's values in its order (store.settings.GENERATION_KEYS)."""
    return system, temperature, top_p, top_k, max_tokens, repetition, frequency, presence, context


GENERATION = [  # (system, temperature, top_p, max tokens, …) as a script may send them, and the sentence each gets
    (gen("", NAN, 0.9, 16), "A temperature of nan is not possible. Use a number from 0 to 2"),
    (gen("", INF, 0.9, 16), "A temperature of inf is not possible"),
    (gen("", 0.7, NAN, 16), "A top-p of nan is not possible. Use a number from 0.05 to 1."),
    (gen("", 0.7, 0.9, NAN), "Set max new tokens to a whole number from 1 to 4,096: nan is not one."),
    (gen("", 0.7, 0.9, 2.5), "Set max new tokens to a whole number from 1 to 4,096: 2.5 is not one."),
    (gen("", 0.7, 0.9, 10**9), "Max new tokens of 1000000000 is not possible. Use a whole number from 1 to 4,096."),
    (gen("", "hot", 0.9, 16), "Set the temperature to a number from 0 to 2: 'hot' is not one."),
    (gen("x" * 100_001, 0.7, 0.9, 16), "The system prompt is 100,001 characters long; it can be at most 100,000."),
    (gen("", 0.7, 0.9, 16, top_k=-1), "A top-k of -1 is not possible. Use a whole number from 0 (no limit) to 200."),
    (gen("", 0.7, 0.9, 16, top_k=2.5), "Set top-k to a whole number from 0 to 200: 2.5 is not one."),
    (gen("", 0.7, 0.9, 16, repetition=NAN), "A repetition penalty of nan is not possible."),
    (gen("", 0.7, 0.9, 16, frequency=3), "A frequency penalty of 3 is not possible. Use a number from -2 to 2"),
    (gen("", 0.7, 0.9, 16, presence=INF), "A presence penalty of inf is not possible."),
]


@pytest.mark.parametrize(("values", "sentence"), GENERATION)
def test_send_refuses_a_generation_value_the_page_would_not_offer_and_saves_nothing(page, values, sentence):
    """Before: a NaN temperature sent to /gradio_api/call/send was saved; after a restart every Send failed and /v1
    requests without a temperature got a 400. A fraction of a token was cut silently (int(2.5))."""
    session, conv_id, fn = page
    before = _stored(session)
    *kept, said = next(fn("send")("Hello", conv_id, *values))
    assert sentence in _notice(said) and _notice(said).startswith("⚠️")
    assert all(k == gr.skip() for k in kept)  # the chat, its list and the input stay as they are
    assert _stored(session) == before and "NaN" not in json.dumps(before)  # nothing saved
    assert session.store.chats.get(conv_id).generation is None  # the chat's own neither
    assert [m.content for m in session.store.chats.messages(conv_id)] == ["Tell me about the sea.", "Once upon"]
    assert session.runtime.sampled == []  # nothing generated


@pytest.mark.parametrize("api_name", ["regenerate", "continue"])
@pytest.mark.parametrize(("values", "sentence"), GENERATION[:3])
def test_regenerate_and_continue_refuse_the_same_values(page, api_name, values, sentence):
    """Before: they handed the NaN to the model as it was (they save nothing, so the save's check never ran)."""
    session, conv_id, fn = page
    handler = fn(api_name)
    _, said = next(handler(conv_id, *values))
    assert sentence in _notice(said)
    assert session.runtime.sampled == []
    assert [m.content for m in session.store.chats.messages(conv_id)] == ["Tell me about the sea.", "Once upon"]


def test_values_the_page_allows_still_send_and_are_kept_typed_with_the_chat(page):
    session, conv_id, fn = page
    defaults = session.store.settings.load()
    values = gen("Be brief.", 0, 0.5, 8.0, top_k=40.0, repetition=1.1, frequency=0.5, presence=-0.5)  # as sliders send
    *_, last = list(fn("send")("Hello", conv_id, *values))
    sampled = session.runtime.sampled[-1]
    assert sampled.greedy and sampled.max_new_tokens == 8 and sampled.top_k == 40
    assert (sampled.repetition_penalty, sampled.frequency_penalty, sampled.presence_penalty) == (1.1, 0.5, -0.5)
    own = session.store.chats.get(conv_id).generation
    assert own == {
        "system_prompt": "Be brief.", "temperature": 0.0, "top_p": 0.5, "top_k": 40, "max_new_tokens": 8,
        "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": -0.5, "context_length": 0,
    }  # fmt: skip
    assert isinstance(own["max_new_tokens"], int) and isinstance(own["top_k"], int)
    assert session.store.settings.load() == defaults  # a chat's values are not the defaults of the next chat


def test_rename_and_search_have_a_budget(page):
    session, conv_id, fn = page
    _, said = fn("rename_chat")(conv_id, "t" * 201)
    assert "A title can be at most 200 characters long" in _notice(said)
    assert session.store.chats.get(conv_id).title == "sea"
    _, said = fn("search_chats")("q" * 1_001, conv_id)
    assert "Search for at most 1,000 characters" in _notice(said)


@pytest.mark.parametrize(
    ("distance", "capacity", "sentence"),
    [
        (NAN, 10, "Set the prefetch distance to a whole number of layers: nan is not one."),  # was int(nan): Error
        (2.5, 10, "Set the prefetch distance to a whole number of layers: 2.5 is not one."),  # was cut to 2
        (2, 2.5, "Set the store capacity to a whole number of expert maps: 2.5 is not one."),  # was cut to 2
        (2, INF, "Set the store capacity to a whole number of expert maps: inf is not one."),
    ],
)
def test_apply_settings_refuses_what_its_fields_would_not_take(page, distance, capacity, sentence):
    session, _, fn = page
    session.runtime = None  # saved for the next load: the store's check is all there is
    before = _stored(session)
    info, said = fn("apply_settings")(0.5, distance, "fmoe", capacity)
    assert info == gr.skip() and said.startswith("⚠️") and sentence in said
    assert _stored(session) == before


def _write_raw(store, **values_json: str) -> None:
    store.db.db["settings"].upsert_all([{"key": k, "value_json": v} for k, v in values_json.items()], pk="key")


def test_saved_values_that_fail_the_check_are_not_used_and_the_page_says_so(tmp_path):
    """Before: a saved NaN temperature was loaded as it was (NaN passed `temperature < 0`): the page's slider got
    NaN and every Send failed, /v1 requests without a temperature got a 400."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from ui import build
    from ui.openai_api import build_router
    from ui.session import Session

    store = open_store(tmp_path)
    # What the attack left, and what another version or a hand edit could: each a JSON value this version refuses.
    _write_raw(store, temperature="NaN", top_p="Infinity", cache_gb="-Infinity", max_new_tokens="9" * 400)
    _write_raw(store, system_prompt="[" * 100_000 + "]" * 100_000, policy='"lru"')  # nested past recursion
    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    try:
        loaded, defaults = store.settings.load(), AppSettings()
        assert (loaded.temperature, loaded.top_p, loaded.cache_gb, loaded.max_new_tokens) == (
            defaults.temperature,
            defaults.top_p,
            defaults.cache_gb,
            defaults.max_new_tokens,
        )
        assert loaded.system_prompt == "" and loaded.policy == "lru"  # the usable one is kept
        demo = build(session)
        top = next(f for f in demo.fns.values() if f.name == "follow_header").fn("")[0]  # the page's header
        assert "Saved settings that cannot be used are back to their defaults" in top
        assert "A temperature of nan is not possible" in top and "A top-p of inf is not possible" in top
        assert set(store.settings.refused()) == set()  # put right on disk: said once, not at every start
        on_load = next(f for f in demo.fns.values() if f.name == "on_load").fn  # the chat's: the first wired
        shown = on_load("")
        system, temperature, top_p, _, max_tokens = shown[5:10]  # after the chat, its list, title and address
        assert (system, temperature, top_p, max_tokens) == ("", defaults.temperature, defaults.top_p, 512)
        session.runtime = HiRuntime()
        app = FastAPI()
        app.include_router(build_router(session))
        answer = TestClient(app).post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 200, answer.text
        assert session.runtime.sampled[-1].temperature == defaults.temperature
        assert not math.isnan(session.runtime.sampled[-1].top_p)
    finally:
        session.runtime = None
        store.close()
