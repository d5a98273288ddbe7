"""Chat display helpers: what the model sees stays the stored text; the stats line is display-only."""

from __future__ import annotations

import threading

import gradio as gr
import pytest

from store.chats import Message
from tests.fake_runtime import FakeRuntime
from ui.chat_view import display, stats_line


def _msg(role: str, content: str, stats: dict | None = None, position: int = 0) -> Message:
    return Message(1, 1, position, role, content, stats, 0.0)


def test_stats_line_under_replies_only():
    stats = {"tokens_per_s": 12.34, "ttft_s": 0.25, "hit_rate": 0.875, "finish_reason": "cancelled"}
    assert stats_line(stats) == "12.3 tok/s · TTFT 250 ms · expert hit rate 88% · stopped"
    assert stats_line(None) == ""
    assert stats_line(stats | {"finish_reason": "length"}).endswith(
        "length limit reached (raise Max new tokens under Generation for longer replies)"
    )
    shown = display([_msg("system", "be brief"), _msg("user", "hi", stats), _msg("assistant", "hello", stats)])
    assert [m["role"] for m in shown] == ["user", "assistant"]  # the system prompt is not a bubble
    assert shown[0]["content"] == "hi"
    assert shown[1]["content"].startswith("hello\n\n<span class='reply-stats'>12.3 tok/s")


def test_a_failed_reply_shows_its_sentence_inline_and_keeps_the_partial_text(tmp_path):
    from fmoe_local.config import RuntimeConfig, Sampling
    from fmoe_local.runtime_types import Finished, TextDelta
    from fmoe_local.stats import RequestStats
    from store import open_store
    from ui.chat_flow import reply
    from ui.session import Session

    sentence = "Could not load expert 3 of MoE layer 1: disk error. Download the model again."

    class FailingRuntime(FakeRuntime):
        chat_template = None  # no harmony channels: the reply is read as it is written

        def events(self, messages, sampling, stop):
            yield TextDelta("The sea", 5)
            yield Finished("The sea", [5], RequestStats(finish_reason="error"), "error", error=sentence)

    store = open_store(tmp_path)
    try:
        conv = store.chats.create("sea")
        store.chats.append(conv.id, "user", "Tell me about the sea.")
        session = Session(store=store, config=RuntimeConfig())
        session.runtime = FailingRuntime()
        *_, shown = list(reply(session, conv.id, "", Sampling()))
        assert shown[-1] == {"role": "assistant", "content": f"⚠️ {sentence}"}  # a bubble, not an exception
        assert shown[-2]["content"].startswith("The sea")
        assert [m.content for m in store.chats.messages(conv.id)] == ["Tell me about the sea.", "The sea"]
    finally:
        store.close()


@pytest.fixture
def app(tmp_path):
    """The whole UI on a store with one conversation and no model loaded; `fn(api_name)` is an event's handler."""
    from fmoe_local.config import RuntimeConfig
    from store import open_store
    from ui import build
    from ui.session import Session

    store = open_store(tmp_path)
    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    conv = store.chats.create("about the sea")
    store.chats.append(conv.id, "user", "Tell me about the sea.")
    demo = build(session)

    def fn(api_name: str):
        return next(f for f in demo.fns.values() if f.api_name == api_name).fn

    yield session, conv, fn
    session.runtime = None  # a test's fake runtime: nothing of its own to close
    session.close()  # removes the chat exports
    store.close()


def _notice_text(update) -> str:
    assert isinstance(update, gr.Markdown) or isinstance(update, dict), update
    value = update.value if isinstance(update, gr.Markdown) else update.get("value", "")
    return value or ""


def test_problems_are_a_sentence_in_the_chat_not_an_error_over_the_components(app):
    session, conv, fn = app
    *kept, said = next(fn("send")("   ", conv.id, "", 0.7, 0.9, 0, 16, 1.0, 0.0, 0.0, 0))  # nothing typed
    assert "Type a message first." in _notice_text(said)
    assert all(k == gr.skip() for k in kept)  # the chat, its list and the input stay as they are
    *kept, said = next(fn("send")("Hello", conv.id, "", 0.7, 0.9, 0, 16, 1.0, 0.0, 0.0, 0))  # no model loaded
    assert "No model is loaded yet" in _notice_text(said)
    assert [m.content for m in session.store.chats.messages(conv.id)] == ["Tell me about the sea."]
    session.store.chats.delete(conv.id)  # gone behind the page's back (another tab)
    _, said = fn("rename_chat")(conv.id, "ships")
    assert "no longer exists" in _notice_text(said)


def test_deleting_a_chat_asks_first_and_keep_it_deletes_nothing(app):
    session, conv, fn = app
    pending, delete, confirm, keep, said = fn("delete_chat")(conv.id)
    assert pending == conv.id and session.store.chats.get(conv.id)  # asked, not deleted
    assert confirm.value == "Yes, delete “about the sea”" and confirm.visible and keep.visible
    assert delete.visible is False
    pending, delete, confirm, _, conv_id, chatbot, *_ = fn("confirm_delete_chat")(conv.id)
    assert (conv_id, chatbot, pending) == (None, [], None) and delete.visible
    assert session.store.chats.list() == []


def test_export_all_chats_gives_one_json_file_of_every_conversation(app):
    import json

    session, conv, fn = app
    session.store.chats.create("empty one")
    file, said = fn("export_all_chats")()
    path = file.value["path"] if isinstance(file.value, dict) else file.value  # gradio keeps a FileData dict
    assert file.visible and path.endswith(".json") and _notice_text(said) == ""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    titles = {c["conversation"]["title"]: [m["content"] for m in c["messages"]] for c in doc["conversations"]}
    assert titles == {"about the sea": ["Tell me about the sea."], "empty one": []}


class ScriptedRuntime(FakeRuntime):
    """Streams the given replies in turn (each as two deltas) and records what the model was asked to read."""

    chat_template = None  # no harmony channels: the reply is read as it is written

    def __init__(self, *replies: tuple[str, str]) -> None:
        import threading

        super().__init__()
        self.replies = list(replies)  # (text, finish reason)
        self.seen: list[list[dict]] = []
        self.second_word = threading.Event()  # cleared: each reply waits after its first delta until it is set
        self.second_word.set()

    def events(self, messages, sampling, stop):
        from fmoe_local.runtime_types import Finished, TextDelta
        from fmoe_local.stats import RequestStats

        self.seen.append(messages)
        text, reason = self.replies.pop(0)
        half = len(text) // 2
        yield TextDelta(text[:half], 1)
        self.second_word.wait(10)
        yield TextDelta(text[half:], 2)
        yield Finished(text, [1, 2], RequestStats(tokens=2, finish_reason=reason), reason)


@pytest.fixture
def chat(tmp_path):
    """A session on a real store with a scripted runtime; one conversation with a question and a cut reply."""
    from fmoe_local.config import RuntimeConfig
    from store import open_store
    from ui.session import Session

    store = open_store(tmp_path)
    session = Session(store=store, config=RuntimeConfig())
    conv = store.chats.create("story")
    store.chats.append(conv.id, "user", "Tell me a story.")
    store.chats.append(conv.id, "assistant", "Once upon", {"finish_reason": "length", "tokens": 2})
    yield session, conv.id
    store.close()


def test_continue_appends_to_the_cut_reply_and_the_model_reads_it_as_unfinished(chat):
    from fmoe_local.config import Sampling
    from ui import chat_flow

    session, conv_id = chat
    session.runtime = ScriptedRuntime((" a time.", "stop"))
    session.runtime.second_word.clear()
    replies = chat_flow.continue_reply(session, conv_id, "", Sampling())
    assert next(replies)[-1]["content"] == "Once upon a t"  # the same bubble grows
    session.runtime.second_word.set()
    *_, shown = list(replies)
    assert session.runtime.seen[0][-1] == {"role": "assistant", "content": "Once upon"}
    stored = session.store.chats.messages(conv_id)
    assert [m.content for m in stored] == ["Tell me a story.", "Once upon a time."]
    assert len(shown) == 2 and not chat_flow.can_continue(stored[-1])
    with pytest.raises(chat_flow.Problem, match="cut by the length limit"):
        next(chat_flow.continue_reply(session, conv_id, "", Sampling()))


def test_regenerate_keeps_the_old_reply_and_the_chosen_one_is_what_the_next_turn_reads(chat):
    from fmoe_local.config import Sampling
    from ui import chat_flow

    session, conv_id = chat
    session.runtime = ScriptedRuntime(("Long ago.", "stop"), ("The end.", "stop"))
    list(chat_flow.regenerate(session, conv_id, "", Sampling()))
    assert session.runtime.seen[0] == [{"role": "user", "content": "Tell me a story."}]  # not the old reply
    stored = session.store.chats.messages(conv_id)
    assert chat_flow.versions_label(stored) == "2/2" and stored[-1].content == "Long ago."
    shown = chat_flow.choose(session, conv_id, -1)
    assert shown[-1]["content"].startswith("Once upon")
    assert chat_flow.versions_label(session.store.chats.messages(conv_id)) == "1/2"
    session.store.chats.append(conv_id, "user", "Go on.")
    list(chat_flow.reply(session, conv_id, "", Sampling()))
    assert session.runtime.seen[1][1] == {"role": "assistant", "content": "Once upon"}  # the chosen version


def test_editing_an_earlier_message_drops_what_followed_and_replies_again(chat):
    from fmoe_local.config import Sampling
    from ui import chat_flow

    session, conv_id = chat
    session.store.chats.append(conv_id, "user", "Another one.")
    session.store.chats.append(conv_id, "assistant", "Sure.")
    session.runtime = ScriptedRuntime(("A poem.", "stop"))
    list(chat_flow.edit(session, conv_id, 0, "Tell me a poem.", "", Sampling()))
    stored = session.store.chats.messages(conv_id)
    assert [m.content for m in stored] == ["Tell me a poem.", "A poem."]
    assert session.runtime.seen == [[{"role": "user", "content": "Tell me a poem."}]]
    with pytest.raises(chat_flow.Problem, match="Only your own messages"):
        next(chat_flow.edit(session, conv_id, 1, "x", "", Sampling()))  # index 1 is the reply


class SlowRuntime(FakeRuntime):
    """Tokens every 10 ms until its request's stop flag is set, or 40 of them, like the real runtime."""

    chat_template = None  # no harmony channels: the reply is read as it is written

    def __init__(self) -> None:
        import threading

        super().__init__()
        self.release = threading.Event()

    def events(self, messages, sampling, stop):
        from fmoe_local.runtime_types import Finished, TextDelta
        from fmoe_local.stats import RequestStats

        text = ""
        for n in range(1, 41):
            if stop.is_set():
                yield Finished(text, [7] * (n - 1), RequestStats(tokens=n - 1, finish_reason="cancelled"), "cancelled")
                return
            self.release.wait(0.01)
            text += " on"
            yield TextDelta(" on", 7)
        yield Finished(text, [7] * 40, RequestStats(tokens=40, finish_reason="length"), "length")


def _saved_reply(session, conv_id: int, count: int):
    import time

    deadline = time.monotonic() + 10
    while len(session.store.chats.messages(conv_id)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return session.store.chats.messages(conv_id)[-1]


def test_a_reply_whose_page_went_away_runs_to_its_end_and_is_saved_in_its_chat(chat):
    from fmoe_local.config import Sampling
    from ui import chat_flow

    session, conv_id = chat
    session.runtime = SlowRuntime()
    # The server closes the page's stream at a yield (a reload, a closed tab, another chat opened): the reply
    # belongs to its chat, not to the page, and goes on.
    session.store.chats.append(conv_id, "user", "Go on.")
    replies = chat_flow.reply(session, conv_id, "", Sampling())
    for _ in range(3):
        next(replies)
    replies.close()
    last = _saved_reply(session, conv_id, 4)
    assert last.role == "assistant" and last.content == " on" * 40 and last.stats["finish_reason"] == "length"
    # The server cannot close it and simply stops reading: the same (before: nothing was saved until the
    # generator was collected).
    session.store.chats.append(conv_id, "user", "Again.")
    abandoned = chat_flow.reply(session, conv_id, "", Sampling())
    next(abandoned)
    last = _saved_reply(session, conv_id, 6)
    assert last.content == " on" * 40 and last.stats["finish_reason"] == "length"
    assert not session.chat_replies  # a saved reply leaves nothing for Stop to reach


def test_a_message_whose_page_reloads_at_once_still_gets_its_reply(app):
    session, conv, fn = app
    session.runtime = SlowRuntime()
    # The page reloads right after Send drew the message: Gradio closes the handler at its first yield. Before, the
    # reply was submitted only after that yield: the message was stored and never answered (found under load, where
    # the browser test reloaded in that window).
    sent = fn("send")("Go on.", conv.id, "", 0.7, 0.9, 0, 40, 1.0, 0.0, 0.0, 0)
    next(sent)
    sent.close()
    last = _saved_reply(session, conv.id, 3)
    assert last.role == "assistant" and last.content == " on" * 40 and last.stats["finish_reason"] == "length"


def test_a_stop_pressed_before_the_reply_started_stops_it(app):
    from ui.chat import ChatHandlers, PageView

    session, conv, _ = app
    session.runtime = SlowRuntime()
    handlers, view = ChatHandlers(session), PageView()
    # Send draws "Generating…" at once and its handler waits for a worker: on a busy machine Stop is pressed before
    # the reply exists. Before, that Stop found nothing to stop and the reply ran to its end.
    handlers.ask(view)
    handlers.stop(view)
    list(handlers.send("Go on.", conv.id, "", 0.7, 0.9, 0, 40, 1.0, 0.0, 0.0, 0, view))
    last = _saved_reply(session, conv.id, 3)
    assert last.role == "assistant" and last.stats["finish_reason"] == "cancelled", last.content
    handlers.ask(view)  # the next Send is not stopped by the old Stop
    list(handlers.send("Again.", conv.id, "", 0.7, 0.9, 0, 40, 1.0, 0.0, 0.0, 0, view))
    assert _saved_reply(session, conv.id, 5).stats["finish_reason"] == "length"


def test_the_chat_s_stop_also_ends_a_reply_whose_page_was_reloaded(chat):
    from fmoe_local.config import Sampling
    from ui import chat_flow

    session, conv_id = chat
    session.runtime = runtime = SlowRuntime()
    runtime.release.clear()
    # A reload left this reply writing on its own; the new page sends a message to another chat, which waits.
    session.store.chats.append(conv_id, "user", "Go on.")
    abandoned = chat_flow.reply(session, conv_id, "", Sampling())
    next(abandoned)
    other = session.store.chats.create("Other")
    session.store.chats.append(other.id, "user", "Hello?")
    newest = chat_flow.reply(session, other.id, "", Sampling())
    waiting = next(newest)
    assert "Waiting for its turn" in waiting[-1]["content"]  # said plainly, not a silent spinner
    assert waiting[-2] == {"role": "assistant", "content": "…"}  # the reply's own bubble, not an empty one
    session.stop_chat()  # before: only the newest reply's flag was reachable, the reloaded one ran to 40 tokens
    list(newest)
    for conv, count in ((conv_id, 4), (other.id, 2)):
        last = _saved_reply(session, conv, count)
        assert last.role == "assistant" and last.stats["finish_reason"] == "cancelled", (conv, last.content)


def test_a_reply_goes_on_in_its_own_chat_while_the_page_reads_and_writes_in_others(chat):
    """Issue 30: switching chats while a reply streams. The reply lands in its chat, never in the one shown; a reply
    sent meanwhile in another chat waits its turn and says so; going back to the first chat streams it from its
    first word (or shows it finished)."""
    from fmoe_local.config import Sampling
    from ui import chat_flow

    session, conv_id = chat
    session.runtime = runtime = SlowRuntime()
    session.store.chats.append(conv_id, "user", "Go on.")
    first = chat_flow.reply(session, conv_id, "", Sampling())
    assert next(first)[-1]["content"].startswith(" on")  # nothing ahead of it: no waiting notice
    first.close()  # the page opens another chat: it stops following, the reply goes on
    other = session.store.chats.create("Other")
    session.store.chats.append(other.id, "user", "Hello?")
    assert session.chat_reply(other.id) is None  # reading another chat: nothing of the reply there
    with pytest.raises(chat_flow.Problem, match="still answering"):
        next(chat_flow.reply(session, conv_id, "", Sampling()))  # one reply at a time in a chat
    second = chat_flow.reply(session, other.id, "", Sampling())
    back = list(chat_flow.follow(session, session.chat_reply(conv_id)))  # back to the first chat: to its end
    assert back and back[-1][-1]["content"].startswith(" on" * 40)
    assert all(m["content"] != "Hello?" for shown in back for m in shown)  # never the other chat's bubbles
    *_, shown = list(second)
    assert shown[-1]["content"].startswith(" on" * 40)
    stored = {c: [m.content for m in session.store.chats.messages(c)] for c in (conv_id, other.id)}
    assert stored[conv_id][-2:] == ["Go on.", " on" * 40]
    assert stored[other.id] == ["Hello?", " on" * 40]
    assert runtime.turn.acquire(timeout=5)  # both done; nothing left running
    assert not session.chat_replies


class _Watched(threading.Condition):
    """A PageView's condition that says when a thread starts waiting on it."""

    def __init__(self, waiting: threading.Event) -> None:
        super().__init__()
        self.waiting = waiting

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def test_a_redraw_checked_before_another_chat_is_shown_reaches_the_page_before_that_chat():
    """The browser test once found the streaming reply drawn over the Old chat it had just opened: the stream had
    checked that its chat was shown and yielded its redraw, the Old chat's handler then changed the view and its
    output was queued first, and the redraw, queued next, landed over it. Gradio resumes a stream only after queueing
    its last output (queueing.py's process_events): showing the Old chat now waits for that."""
    from ui.chat import PageView, showing, while_shown

    queued = []  # the page's message queue, in the order Gradio fills it
    view = PageView(conv_id=1)
    moved = threading.Event()  # the Old chat's handler returned, or waits for the redraw
    view.redraws = _Watched(moved)
    stream = while_shown(view, 1, iter([["chat 1, a word"], ["chat 1, two words"]]))
    redraw = next(stream)  # Gradio's step, on one of its threads: chat 1 is shown; the redraw is not queued yet

    def open_old_chat() -> None:  # the Old chat's select handler, on another of Gradio's threads
        showing(view, 2)
        queued.append("chat 2")
        moved.set()

    opener = threading.Thread(target=open_old_chat)
    opener.start()
    assert moved.wait(timeout=10)
    queued.append(redraw)  # Gradio queues the redraw, then resumes the stream
    after = next(stream)
    opener.join(timeout=10)
    assert queued == [["chat 1, a word"], "chat 2"]  # before: ["chat 2", ["chat 1, a word"]], the redraw on top
    assert after is None and view.conv_id == 2  # and the stream draws nothing more


def test_a_stream_closed_mid_redraw_holds_no_switch_and_a_redraw_never_queued_holds_it_a_bounded_time(monkeypatch):
    """Gradio closes a stream's generator however its event ends: its redraw is no longer in flight. One Gradio never
    resumes holds showing another chat at most REDRAW_WAIT_S."""
    import copy

    from ui import chat
    from ui.chat import PageView, showing, while_shown

    view = PageView(conv_id=1)
    stream = while_shown(view, 1, iter([["chat 1"], ["chat 1 again"]]))
    next(stream)
    assert view.in_flight == [1]
    stream.close()
    assert view.in_flight == []
    stuck = while_shown(view, 1, iter([["chat 1"]]))
    next(stuck)  # never resumed
    monkeypatch.setattr(chat, "REDRAW_WAIT_S", 0.0)
    showing(view, 2)
    assert view.conv_id == 2 and view.in_flight == [1]
    page = copy.deepcopy(view)  # what gr.State gives each page: its own lock, and none of this page's redraws
    assert page.conv_id == 2 and page.in_flight == [] and page.redraws is not view.redraws


def test_a_regenerated_reply_draws_nothing_over_a_chat_opened_before_its_handler_ran(chat):
    """Regenerate (Continue, an edit) pressed, then another chat opened before the reply's handler ran (a busy
    machine): before, its first redraw was sent unchecked and landed over the chat opened."""
    from ui import chat_flow
    from ui.chat import ChatHandlers, PageView

    session, conv_id = chat
    session.runtime = SlowRuntime()
    other = session.store.chats.create("Other")
    view = PageView(conv_id=other.id)  # what opening the other chat left
    outputs = list(ChatHandlers(session).regenerate(conv_id, "", 0.7, 0.9, 0, 40, 1.0, 0.0, 0.0, 0, view))
    assert outputs == [(gr.skip(), gr.skip())]
    reply = session.chat_reply(conv_id)  # the reply itself goes on, and is saved in its chat
    if reply is not None:
        list(chat_flow.follow(session, reply))
    assert session.store.chats.messages(conv_id)[-1].content == " on" * 40


def test_a_sent_message_draws_nothing_over_a_chat_opened_while_its_reply_started(chat, monkeypatch):
    """Send, then another chat opened while the reply was starting (a busy machine): before, Send's first outputs
    were sent unchecked — the sent chat drawn over the one opened, and the page's chat id set back to it."""
    from ui import chat_flow
    from ui.chat import ChatHandlers, PageView, showing

    session, conv_id = chat
    session.runtime = SlowRuntime()
    other = session.store.chats.create("Other")
    view = PageView()
    start_reply = chat_flow.start_reply

    def opened_meanwhile(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - start_reply's own arguments
        reply = start_reply(*args, **kwargs)
        showing(view, other.id)  # what opening the other chat does, on another of Gradio's threads
        return reply

    monkeypatch.setattr(chat_flow, "start_reply", opened_meanwhile)
    outputs = list(ChatHandlers(session).send("Go on.", conv_id, "", 0.7, 0.9, 0, 40, 1.0, 0.0, 0.0, 0, view))
    assert len(outputs) == 1
    chatbot, shown_id, textbox, chat_list, address, _ = outputs[0]
    assert (chatbot, shown_id, address) == (gr.skip(), gr.skip(), gr.skip())  # the opened chat stays drawn
    assert textbox == "" and "value" not in chat_list.constructor_args  # the message left; the selection stays
    assert view.conv_id == other.id and view.in_flight == []
    reply = session.chat_reply(conv_id)  # the reply itself goes on, and is saved in its chat
    if reply is not None:
        list(chat_flow.follow(session, reply))
    assert [m.content for m in session.store.chats.messages(conv_id)][-2:] == ["Go on.", " on" * 40]


def test_a_chat_opened_as_its_reply_is_saved_shows_the_reply(chat):
    """Opening a chat reads its stored messages, then a second step follows its running reply. A reply that saved
    and ended between the two was in neither: before, the page showed the question alone until reloaded."""
    from fmoe_local.config import Sampling
    from ui import chat_flow
    from ui.chat import ChatHandlers, PageView, shown_chat

    session, conv_id = chat
    session.runtime = SlowRuntime()
    handlers, view = ChatHandlers(session), PageView()
    session.store.chats.append(conv_id, "user", "Go on.")
    reply = chat_flow.start_reply(session, conv_id, "", Sampling(greedy=True, max_new_tokens=4))
    opened = shown_chat(session, conv_id)[1]  # the opening handler's read: the reply is not saved yet
    list(chat_flow.follow(session, reply))  # it saves and ends before the page's next step
    handlers.select(conv_id, view)
    drawn = [out for out in handlers.follow(conv_id, view) if out[0] != gr.skip()]
    assert opened[-1]["role"] == "user" and len(drawn) == 1
    saved = session.store.chats.messages(conv_id)[-1]
    assert saved.role == "assistant" and drawn[0][0][-1]["content"].startswith(saved.content)  # its stats after it
    assert drawn[0][1] == gr.skip()  # Send's state is `ended`'s to set, after this step


def test_a_reply_the_database_cannot_store_stays_on_the_page_with_what_to_do(chat, monkeypatch):
    import sqlite3

    from fmoe_local.config import Sampling
    from ui import chat_flow

    session, conv_id = chat
    session.runtime = ScriptedRuntime(("The whole reply.", "stop"))
    session.store.chats.append(conv_id, "user", "Again?")

    def disk_full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(session.store.chats, "append", disk_full)
    *_, shown = list(chat_flow.reply(session, conv_id, "", Sampling()))  # before: raised, the text was gone
    assert shown[-2]["content"].startswith("The whole reply.")
    assert "could not be saved (database or disk is full)" in shown[-1]["content"]
    assert "free some space" in shown[-1]["content"]
    assert not session.chat_replies


def test_a_reply_cut_by_a_model_load_is_kept_as_interrupted_and_only_the_user_s_stop_is_stopped(
    ui_session, monkeypatch
):
    import fmoe_local.runtime as runtime_module
    from fmoe_local.config import Sampling
    from fmoe_local.demo import demo_model_dir
    from ui import chat_flow

    def cut_only_by_its_stop_flag(model, prompt_ids, sampling, eos_ids, stop, **_):  # the rules, a KV cache
        # Three tokens, then the reply waits for its stop flag: it cannot end on its own before the load lands.
        for _ in range(3):
            yield 100
        stop.wait(30)

    monkeypatch.setattr(runtime_module, "generate_ids", cut_only_by_its_stop_flag)
    s = ui_session
    s.load(demo_model_dir())
    conv = s.store.chats.create("sea")
    s.store.chats.append(conv.id, "user", "Tell me about the sea.")
    replies = chat_flow.reply(s, conv.id, "", Sampling(max_new_tokens=200))
    next(replies)
    job = s.start_load(demo_model_dir())  # Load pressed in another tab (or an API client's load_model)
    *_, shown = list(replies)
    assert job.finished.wait(60) and s.runtime is not None
    last = s.store.chats.messages(conv.id)[-1]
    assert last.role == "assistant" and last.content  # what was written is kept
    assert last.stats["finish_reason"] == "interrupted"  # before: "cancelled", shown as the user's "stopped"
    assert "the model was unloaded or reloaded mid-reply (Regenerate for a whole reply)" in shown[-1]["content"]
    assert "stopped" not in shown[-1]["content"] and not chat_flow.can_continue(last)
    # The user's own Stop, on the model loaded since, is still a stopped reply.
    s.store.chats.append(conv.id, "user", "And the ships?")
    replies = chat_flow.reply(s, conv.id, "", Sampling(max_new_tokens=200))
    next(replies)
    s.stop_chat()
    *_, shown = list(replies)
    last = s.store.chats.messages(conv.id)[-1]
    assert last.stats["finish_reason"] == "cancelled" and shown[-1]["content"].endswith("stopped</span>")
    assert not s.chat_replies


def test_a_reply_the_model_s_context_cut_says_so_and_offers_no_continue(ui_session, monkeypatch):
    import fmoe_local.generate as generate
    from fmoe_local.config import Sampling
    from fmoe_local.demo import demo_model_dir
    from fmoe_local.engine import ContextTooLong
    from ui import chat_flow

    s = ui_session
    s.load(demo_model_dir())
    engine = s.runtime.engine
    # A model that never ends on its own: the reply runs into the context whatever the tokenizer makes of the text.
    never_eos = next(t for t in range(10, 100) if t not in engine.eos_ids)
    monkeypatch.setattr(generate, "sample_next", lambda logits, sampling, generator: never_eos)

    def length(words: list[str]) -> int:
        try:
            return len(engine.tokenize_prompt([{"role": "user", "content": " ".join(words)}]))
        except ContextTooLong:
            return 10**6

    words = ("the ocean is wide and deep " * 200).split()
    while length(words) > engine.context_length - 20:  # a conversation 20 tokens short of the context
        words = words[:-10]
    conv = s.store.chats.create("long")
    s.store.chats.append(conv.id, "user", " ".join(words))
    *_, shown = list(chat_flow.reply(s, conv.id, "", Sampling(max_new_tokens=512)))
    last = s.store.chats.messages(conv.id)[-1]
    assert last.role == "assistant" and last.stats["finish_reason"] == "context"
    assert "the model's context is full (start a new chat to go on)" in shown[-1]["content"]
    assert "Max new tokens" not in shown[-1]["content"]  # before: "raise Max new tokens", which cannot help
    assert not chat_flow.can_continue(last)  # the Chat tab hides Continue
    with pytest.raises(chat_flow.Problem, match="context is full, so it cannot be continued. Start a new chat."):
        next(chat_flow.continue_reply(s, conv.id, "", Sampling(max_new_tokens=4096)))


def test_sending_on_a_full_disk_says_so_in_a_sentence(app):
    """Before: Send on a full disk showed "That did not work (OperationalError: database or disk is full)"."""
    session, conv, fn = app
    session.runtime = ScriptedRuntime(("Never shown.", "stop"))
    conn = session.store.db.db.conn
    # SQLite's own limit on the file's pages: the database cannot grow, exactly as when the disk has no room.
    conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")
    *kept, said = next(fn("send")("A long message. " * 4000, conv.id, "", 0.7, 0.9, 0, 16, 1.0, 0.0, 0.0, 0))
    text = _notice_text(said)
    assert "Nothing was saved: the disk holding fmoe-local.db is full. Free some space" in text, text
    assert "OperationalError" not in text
    assert [m.content for m in session.store.chats.messages(conv.id)] == ["Tell me about the sea."]
    conn.execute("PRAGMA max_page_count = 1073741823")  # room again: the same Send works
    assert session.store.chats.append(conv.id, "user", "short").content == "short"


def _generation_shown(shown: tuple) -> dict:
    """The Generation values of a chat_outputs tuple (conv_id, chatbot, list, title, address, *values, notice)."""
    from store.settings import GENERATION_KEYS

    return dict(zip(GENERATION_KEYS, shown[5:-1], strict=True))


def test_each_chat_shows_and_keeps_its_own_generation_settings(app):
    from ui.chat import guarded, keep_generation, open_address, save_default

    session, conv, fn = app
    chats, settings = session.store.chats, session.store.settings
    other = chats.create("other", generation={**settings.load().generation(), "temperature": 1.3, "top_k": 7})
    shown = fn("open_chat")(other.id)
    assert _generation_shown(shown)["temperature"] == 1.3 and _generation_shown(shown)["top_k"] == 7
    assert shown[4] == str(other.id)  # the address follows
    values = dict(_generation_shown(shown), temperature=0.2, system_prompt="Be brief.")
    said = keep_generation(session, other.id, *values.values())  # a control changed: kept with the chat at once
    assert _notice_text(said) == ""
    assert chats.get(other.id).generation["temperature"] == 0.2
    assert _generation_shown(open_address(session, str(other.id)))["system_prompt"] == "Be brief."  # a reload
    assert _generation_shown(fn("open_chat")(conv.id))["temperature"] == settings.load().temperature  # not 0.2
    new = fn("new_chat")()
    assert new[0] is None and new[4] == "new" and _generation_shown(new) == settings.load().generation()
    said = save_default(session, *values.values())
    assert "new chats start from these" in _notice_text(said)
    assert _generation_shown(fn("new_chat")())["temperature"] == 0.2
    refused = guarded(keep_generation, 1)(session, other.id, *dict(values, top_k=-3).values())  # as wired
    assert "A top-k of -3 is not possible" in _notice_text(refused[-1]) and chats.get(other.id).generation["top_k"] == 7


def test_the_address_opens_its_chat_or_says_why_not(app):
    from ui.chat import open_address

    session, conv, _ = app
    newer = session.store.chats.create("newer")
    assert open_address(session, str(conv.id))[0] == conv.id  # not the most recently updated one
    assert open_address(session, "")[0] == newer.id
    new = open_address(session, "new")
    assert (new[0], new[1]) == (None, [])
    for wanted, said in [
        ("999", "Conversation 999 no longer exists"),
        ("1e9", "names no chat"),
        ("9" * 40, "names no"),
    ]:
        shown = open_address(session, wanted)
        assert shown[0] == newer.id and said in _notice_text(shown[-1])


def test_import_adds_the_exported_chats_and_refuses_other_files_in_a_sentence(app, tmp_path):
    from store.chat_import import MAX_IMPORT_BYTES

    session, conv, fn = app
    exported = tmp_path / "chats.json"
    exported.write_text(session.store.chats.export_all_json(), encoding="utf-8")
    shown = fn("import_chats")(str(exported))
    assert shown[0] != conv.id and "Imported 1 chat" in _notice_text(shown[-1])
    assert session.store.chats.messages(shown[0])[0].content == "Tell me about the sea."
    assert session.store.chats.messages(conv.id)[0].content == "Tell me about the sea."  # the original is untouched
    markdown = tmp_path / "chat.md"
    markdown.write_text("# about the sea\n", encoding="utf-8")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_IMPORT_BYTES + 1)
    for path, said in [(markdown, "not JSON text"), (big, "at most 5 MB")]:
        *kept, notice = fn("import_chats")(str(path))
        assert said in _notice_text(notice) and all(k == gr.skip() for k in kept)
    assert len(session.store.chats.list()) == 2


def test_a_thought_the_template_opened_is_saved_with_its_marker_and_the_next_turn_reads_only_the_answer(chat):
    from fmoe_local.config import Sampling
    from ui import chat_flow

    session, conv_id = chat
    session.runtime = ScriptedRuntime(("They want more.\n</think>\n\nThe end.", "stop"), ("Fine.", "stop"))
    session.runtime.opening = "<|im_start|>assistant\n<think>\n"  # as Qwen3-Thinking's template opens a reply
    session.runtime.second_word.clear()
    replies = chat_flow.regenerate(session, conv_id, "", Sampling())
    first = next(replies)  # half the reply: all thinking so far, folded, no answer bubble yet
    assert first[-1]["metadata"]["title"] == "Thinking" and first[-1]["content"] == "They want more."  # "<" held
    session.runtime.second_word.set()
    *_, shown = list(replies)
    assert [b.get("metadata", {}).get("title") for b in shown] == [None, "Thinking", None]
    assert shown[-1]["content"].startswith("The end.") and "They want" not in shown[-1]["content"]
    stored = session.store.chats.messages(conv_id)
    assert stored[-1].content == "<think>\nThey want more.\n</think>\n\nThe end."  # survives a reload as it is
    session.store.chats.append(conv_id, "user", "Another.")
    list(chat_flow.reply(session, conv_id, "", Sampling()))
    assert session.runtime.seen[1][1] == {"role": "assistant", "content": "The end."}  # the thought is not re-read
    # An edit counts the thought's block among the bubbles: "Another." is the fourth bubble.
    session.runtime.replies.append(("Sure.", "stop"))
    list(chat_flow.edit(session, conv_id, 3, "Another one.", "", Sampling()))
    assert [m.content for m in session.store.chats.messages(conv_id)][-2:] == ["Another one.", "<think>\nSure."]


def test_a_reply_cut_inside_its_thought_is_continued_with_the_thought_read_whole(chat):
    from fmoe_local.config import Sampling
    from ui import chat_flow

    session, conv_id = chat
    cut = {"finish_reason": "length", "tokens": 2}
    session.store.chats.add_alternative(conv_id, 1, "<think>\nFirst, a king", cut)
    session.runtime = ScriptedRuntime((" and a queen.\n</think>\n\nOnce upon a time.", "stop"))
    session.runtime.opening = "<think>\n"  # a fresh reply would get the marker; a continued one has its own
    *_, shown = list(chat_flow.continue_reply(session, conv_id, "", Sampling()))
    assert session.runtime.seen[0][-1] == {"role": "assistant", "content": "<think>\nFirst, a king"}
    stored = session.store.chats.messages(conv_id)[-1]
    assert stored.content == "<think>\nFirst, a king and a queen.\n</think>\n\nOnce upon a time."
    assert shown[-2]["content"] == "First, a king and a queen." and shown[-1]["content"].startswith("Once upon a")


class CountingRuntime(ScriptedRuntime):
    """Counts a prompt as one token per word plus one per message, and reads at most `most` tokens."""

    def __init__(self, *replies: tuple[str, str], most: int | None = None) -> None:
        super().__init__(*replies)
        self.context_length, self.counted = most, 0

    def check(self, prompt, tools=None, variables=None):
        self.counted += 1
        return sum(1 + len(m["content"].split()) for m in prompt)


@pytest.fixture
def long_chat(tmp_path):
    """Three turns of 3 + 3 words each (7 tokens a turn as CountingRuntime counts), then a fourth question."""
    from fmoe_local.config import RuntimeConfig
    from store import open_store
    from ui.session import Session

    store = open_store(tmp_path)
    session = Session(store=store, config=RuntimeConfig())
    conv = store.chats.create("long")
    for turn in ("one", "two", "three"):
        store.chats.append(conv.id, "user", f"question {turn} here")
        store.chats.append(conv.id, "assistant", f"answer {turn} there")
    store.chats.append(conv.id, "user", "the last question")
    yield session, conv.id
    store.close()


def test_a_chats_context_length_leaves_out_the_oldest_turns_keeps_the_system_prompt_and_says_so(long_chat):
    from fmoe_local.config import Sampling
    from ui import chat_flow

    session, conv_id = long_chat
    session.runtime = CountingRuntime(("Fine.", "stop"), ("Again.", "stop"), most=4096)
    # system (3) + the last two turns (7 + 4) = 21 tokens fit in 22; the turn before them would make 29.
    session.runtime.second_word.clear()
    replies = chat_flow.reply(session, conv_id, "be brief now", Sampling(), 22)
    streaming = next(replies)  # said under the reply while it streams
    session.runtime.second_word.set()
    *_, shown = list(replies)
    seen = session.runtime.seen[0]
    assert [m["content"] for m in seen] == [
        "be brief now", "question three here", "answer three there", "the last question"
    ]  # fmt: skip
    said = streaming[-1]["content"]
    assert "4 earlier messages were not sent to the model: this chat's context length is 22 tokens" in said
    assert "4 earlier messages not sent (context length 22)" in shown[-1]["content"]  # the saved reply's stats line
    stored = session.store.chats.messages(conv_id)[-1]
    assert (stored.stats["left_out"], stored.stats["context_length"]) == (4, 22)
    # 0: everything is sent, and nothing is said.
    *_, shown = list(chat_flow.regenerate(session, conv_id, "be brief now", Sampling(), 0))
    assert len(session.runtime.seen[1]) == 8 and "not sent" not in shown[-1]["content"]


def test_a_context_length_the_model_cannot_read_or_too_short_for_the_last_message_is_a_sentence(long_chat):
    from fmoe_local.config import Sampling
    from ui import chat_flow

    session, conv_id = long_chat
    session.runtime = CountingRuntime(("Fine.", "stop"), most=2048)
    with pytest.raises(chat_flow.Problem, match="context length is 4,096 tokens, but fake-moe reads at most 2,048"):
        next(chat_flow.reply(session, conv_id, "", Sampling(), 4096))
    with pytest.raises(chat_flow.Problem, match="The last message alone take"):
        next(chat_flow.reply(session, conv_id, "", Sampling(), 3))
    assert session.runtime.seen == []  # nothing was asked of the model


def test_the_context_length_is_kept_with_the_chat_and_refused_above_the_models_maximum(app):
    from ui.chat import guarded, keep_generation

    session, conv, fn = app
    values = dict(_generation_shown(fn("open_chat")(conv.id)), context_length=1024)
    assert _notice_text(keep_generation(session, conv.id, *values.values())) == ""
    assert session.store.chats.get(conv.id).generation["context_length"] == 1024
    assert _generation_shown(fn("open_chat")(conv.id))["context_length"] == 1024  # what a reload shows
    session.runtime = CountingRuntime(most=512)
    said = guarded(keep_generation, 1)(session, conv.id, *dict(values, context_length=2048).values())[-1]
    assert "is 2,048 tokens, but fake-moe reads at most 512. Set it to at most 512 under" in _notice_text(said)
    assert session.store.chats.get(conv.id).generation["context_length"] == 1024  # not kept
    refused = guarded(keep_generation, 1)(session, conv.id, *dict(values, context_length=-5).values())[-1]
    assert "A context length of -5 tokens is not possible" in _notice_text(refused)
