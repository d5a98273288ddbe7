"""Chat tab: the conversation list (from SQLite), the chat itself, generation settings.

Scope: components and their events. Conversations live in the store; the chatbot only displays them, so what
the model sees is always the stored text (the stats line under a reply is display-only). It does NOT load
models (Models tab) or change the runtime's settings (Settings tab). A reply belongs to its chat (chat_flow.py): the
page follows it while it shows that chat, and switching chats, starting one or reading another leaves it running;
going back shows it streaming. The runtime answers one request at a time: a reply sent meanwhile says it waits.
A problem is said in the notice line under the chat (`guarded`); deleting a chat asks first. The last reply
offers Continue when the token limit cut it and "< 1/2 >" when Regenerate made other versions; every message of
the user's has Gradio's edit pencil (the chat goes on from the edited message).

Each chat has its own Generation settings (system prompt, sampling, context length): opening a chat shows them, changing one keeps
it with the chat, and a new chat starts from the saved defaults ("Save as default"). The page's address names the
chat shown (`?chat=ID`, `?chat=new`), so a reload and the browser's back and forward open that chat; the address is
the page's own (history.pushState), read by the load event and on popstate. Escape presses Stop. Chats exported as
JSON are imported as new chats (store/chat_import.py checks the file).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass

import gradio as gr

from fmoe_local.config import Sampling
from store.chat_import import MAX_IMPORT_BYTES, ImportRefused, check_size, parse_export
from store.chats import ChatNotFoundError
from store.errors import StoreError
from store.settings import (
    CONTEXT_LENGTH_RANGE,
    GENERATION_KEYS,
    MAX_NEW_TOKENS_RANGE,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    SYSTEM_PROMPT_CHARS,
    TEMPERATURE_RANGE,
    TOP_K_RANGE,
    TOP_P_RANGE,
)
from ui import chat_flow
from ui.chat_flow import Problem
from ui.chat_view import conversation_choices, display, warning
from ui.export import chat_markdown
from ui.render import literal
from ui.session import Session

log = logging.getLogger(__name__)

TITLE_CHARS = 48  # a new chat's title: the start of its first message
RENAME_CHARS = 200  # a title typed (or sent to rename_chat): what the list can show, with room to spare
SEARCH_CHARS = 1_000  # a search: longer than any title, enough for a sentence from a message
ADDRESS_CHARS = 18  # a chat id in the page's address: what SQLite's integer ids can be, and no longer

# The page's scripts (Gradio runs them in the browser). The address names the chat shown: a new one is pushed (the
# first, on a fresh page, replaces the bare address) so back and forward step through the chats opened.
ADDRESS_JS = """(id) => {
  if (!id) return;
  const url = new URL(location.href);
  const now = url.searchParams.get("chat");
  if (now === id) return;
  url.searchParams.set("chat", id);
  if (now === null) history.replaceState(null, "", url); else history.pushState(null, "", url);
}"""
# () → the chat the address names (read on load and after back/forward); installs the page's keys once.
READ_ADDRESS_JS = """() => {
  if (!window.fmoeChatKeys) {
    window.fmoeChatKeys = true;
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && !e.isComposing) document.querySelector("#stop")?.click();
    });
    window.addEventListener("popstate", () => document.querySelector("#chat-nav")?.click());
  }
  return new URLSearchParams(location.search).get("chat") || "";
}"""


@dataclass
class ChatTab:
    conv_id: gr.State
    search: gr.Textbox
    conv_list: gr.Radio
    new_chat: gr.Button
    rename_box: gr.Textbox
    rename: gr.Button
    delete: gr.Button
    confirm_delete: gr.Button
    keep_chat: gr.Button
    pending_delete: gr.State
    pending_edit: gr.State
    export: gr.Button
    export_all: gr.Button
    export_file: gr.File
    chatbot: gr.Chatbot
    notice: gr.Markdown
    textbox: gr.Textbox
    send: gr.Button
    stop: gr.Button
    regenerate: gr.Button
    continue_reply: gr.Button
    alt_prev: gr.Button
    alt_label: gr.Button
    alt_next: gr.Button
    import_file: gr.UploadButton
    address: gr.Textbox  # the chat the page's address names (hidden; its changes update the address)
    nav: gr.Button  # pressed by the page's script on back/forward (hidden)
    system: gr.Textbox
    temperature: gr.Slider
    top_p: gr.Slider
    top_k: gr.Slider
    max_tokens: gr.Slider
    repetition_penalty: gr.Slider
    frequency_penalty: gr.Slider
    presence_penalty: gr.Slider
    context_length: gr.Number
    save_default: gr.Button
    view: gr.State  # the page's PageView

    @property
    def generation(self) -> list:
        """The Generation panel's controls, in GENERATION_KEYS' order."""
        return [
            self.system, self.temperature, self.top_p, self.top_k, self.max_tokens, self.repetition_penalty,
            self.frequency_penalty, self.presence_penalty, self.context_length,
        ]  # fmt: skip


@dataclass
class PageView:
    """The chat one page shows, as the reply streams see it: gr.State gives each page its own copy, and a handler
    that shows another chat changes this object in place, which a stream already running reads at its next word
    (gr.State's value is passed by reference; a returned value would replace it instead).

    Threads: the page's handlers run on Gradio's worker threads, each step of a stream on whichever one Gradio hands
    it, so there is no owner; `conv_id` and the redraws in flight change only under `redraws` (the condition's
    lock), through `showing` and `while_shown`. A redraw is in flight from the check that its chat is shown until
    Gradio resumes its stream, which it does only after putting that output in the page's message queue
    (queueing.py's process_events); until then another chat's output could be queued first and the redraw would
    land over it, so `showing` names the new chat, then waits (at most REDRAW_WAIT_S) for those redraws to be
    queued before its handler returns its own output. `stop_asked` is one flag, set and read without the lock."""

    conv_id: int | None = None
    # Stop pressed since this page last asked for a reply. The reply it asked for may not have started yet (Send
    # draws at once; its handler waits for a worker, seconds on a busy machine): it is stopped as soon as it starts.
    stop_asked: bool = False

    def __post_init__(self) -> None:
        # Not fields: Gradio puts a State's dataclass value through dataclasses.asdict, which cannot copy a lock.
        self.redraws = threading.Condition()
        self.in_flight: list[int] = []  # the chat of each redraw in flight, one entry per redraw

    def __deepcopy__(self, memo: dict) -> PageView:
        # gr.State deep-copies its value for each page: each page gets its own lock, and no redraw of another's.
        return PageView(self.conv_id, self.stop_asked)


# How long showing another chat waits for the redraws checked before it to be queued. Gradio queues one right after
# the Chatbot's postprocess, and closes a stream however its event ends (queueing.py's reset_iterators), which ends
# its redraw in flight too: the bound is for a server too busy to queue it in time, never an unbounded wait. 5 s, not
# 2: a full test run on the 2-core machine with other work beside it twice showed a new chat holding another chat's
# messages (session 24; whether this bound ran out was not logged then: the test now says so when it fails).
REDRAW_WAIT_S = 5.0


def showing(view: PageView | None, conv_id: int | None) -> None:
    """The page's view now names chat `conv_id`; returns once the redraws of other chats that were checked before
    are in the page's message queue, so the output of the handler calling this comes after them (PageView)."""
    if view is None:
        return
    with view.redraws:
        view.conv_id = conv_id
        if not view.redraws.wait_for(lambda: all(c == conv_id for c in view.in_flight), timeout=REDRAW_WAIT_S):
            # Still not queued (a server that busy): the chat is shown anyway, and that redraw may land over it.
            log.warning(
                "redraws of chats %s not queued within %s s: showing chat %s", view.in_flight, REDRAW_WAIT_S, conv_id
            )


def while_shown(view: PageView | None, conv_id: int, chatbots):  # noqa: ANN001, ANN201 - Chatbot message lists
    """The reply's redraws while the page shows its chat; once it shows another, one None (the handler then yields
    only gr.skip(): Gradio applies an event's last yield again when it ends, which would draw this chat over the
    one shown) and the page stops drawing it. A reply that ends while shown ends on its last redraw: that is the
    event's result an API caller (gradio_client) receives. The reply goes on and is saved in its own chat
    (chat_flow.py). Each redraw is in flight (PageView) from its check until Gradio resumes this generator."""
    if view is None:
        yield from chatbots
        return
    for chatbot in chatbots:
        with view.redraws:  # never yield holding it: `showing` needs it to return
            shown = view.conv_id == conv_id
            if shown:
                view.in_flight.append(conv_id)
        if not shown:
            yield None
            return
        try:
            yield chatbot
        finally:  # resumed (its output is queued), or closed: either way nothing more of it is coming
            with view.redraws:
                view.in_flight.remove(conv_id)
                view.redraws.notify_all()


def _first_redraw(view: PageView | None, conv_id: int, outputs: tuple, elsewhere: tuple):  # noqa: ANN202 - generator
    """Yields a handler's first `outputs` as one redraw of chat `conv_id` (checked and in flight, as `while_shown`'s),
    or `elsewhere` where the page shows another chat by then; returns whether the chat was shown."""
    for drawn in while_shown(view, conv_id, [outputs]):
        yield elsewhere if drawn is None else drawn
        if drawn is None:
            return False
    return True


def _drawn(chatbot: list[dict] | None):  # noqa: ANN202 - the Chatbot's value, or gr.skip()
    return gr.skip() if chatbot is None else chatbot


def build(session: Session) -> ChatTab:
    settings = session.store.settings.load()
    conv_id = gr.State(None)
    view = gr.State(PageView())
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=220, elem_id="chat-sidebar"):
            new_chat = gr.Button("+ New chat", variant="primary", elem_id="new-chat")
            search = gr.Textbox(placeholder="Search chats…", show_label=False, elem_id="chat-search")
            conv_list = gr.Radio(choices=[], label="Conversations", elem_id="conv-list")
            with gr.Accordion("Rename, delete, export", open=False):
                rename_box = gr.Textbox(show_label=False, placeholder="New title", elem_id="rename-box")
                with gr.Row():
                    rename = gr.Button("Rename", size="sm", elem_id="rename")
                    delete = gr.Button("Delete", size="sm", variant="stop", elem_id="delete-chat")
                # Deleting asks first: the button names the chat, Keep it cancels (nothing is deleted until then).
                confirm_delete = gr.Button(size="sm", variant="stop", visible=False, elem_id="confirm-delete")
                keep_chat = gr.Button("Keep it", size="sm", visible=False, elem_id="keep-chat")
                pending_delete = gr.State(None)
                pending_edit = gr.State(None)  # (shown index, new text) of an edit, from the event to its reply
                with gr.Row():
                    export = gr.Button("Export as Markdown", size="sm", elem_id="export-chat")
                    export_all = gr.Button("Export all chats (JSON)", size="sm", elem_id="export-all")
                export_file = gr.File(label="Exported chat", visible=False, elem_id="export-file")
                import_file = gr.UploadButton(
                    "Import chats (JSON)", size="sm", file_types=[".json"], type="filepath", elem_id="import-chats"
                )
            address = gr.Textbox(
                show_label=False, container=False, elem_id="chat-address", elem_classes=["fmoe-hidden"]
            )
            nav = gr.Button("Open the address's chat", elem_id="chat-nav", elem_classes=["fmoe-hidden"])
        with gr.Column(scale=4):
            chatbot = gr.Chatbot(
                height=520,
                elem_id="chatbot",
                show_label=False,
                buttons=["copy"],
                editable="user",  # a pencil under every message of yours: edit it, and the chat goes on from there
                feedback_options=None,
                placeholder="Ask anything. Replies stream from the model running on this computer.",
            )
            # Problems are said here, in a sentence; the components keep working (no error pill replaces them).
            notice = gr.Markdown("", visible=False, elem_id="chat-notice")
            with gr.Row():
                textbox = gr.Textbox(
                    placeholder="Message (Enter sends, Shift+Enter for a new line)",
                    show_label=False,
                    # One starting line is what makes Gradio send on Enter (Shift+Enter for a new line).
                    lines=1,
                    max_lines=10,
                    scale=6,
                    elem_id="chat-input",
                )
                with gr.Column(scale=1, min_width=110):
                    send = gr.Button("Send", variant="primary", elem_id="send")
                    stop = gr.Button("Stop", variant="stop", elem_id="stop")
            with gr.Row():
                regenerate = gr.Button("↻ Regenerate", size="sm", elem_id="regenerate")
                # Shown only for a reply the token limit cut: goes on with the same message.
                continue_reply = gr.Button("Continue »", size="sm", visible=False, elem_id="continue")
                # The last reply's versions (Regenerate keeps the earlier ones), as Open WebUI's "< 1/2 >".
                alt_prev = gr.Button("<", size="sm", scale=0, min_width=40, visible=False, elem_id="alt-prev")
                alt_label = gr.Button(
                    "", size="sm", min_width=60, interactive=False, visible=False, elem_id="alt-label"
                )
                alt_next = gr.Button(">", size="sm", scale=0, min_width=40, visible=False, elem_id="alt-next")
            with gr.Accordion("Generation", open=False, elem_id="generation"):
                # The ranges are the store's check (store.settings): what a script may send is what these offer.
                system = gr.Textbox(
                    label="System prompt", value=settings.system_prompt, lines=2, max_length=SYSTEM_PROMPT_CHARS,
                    elem_id="system",
                )  # fmt: skip
                with gr.Row():
                    temperature = gr.Slider(
                        *TEMPERATURE_RANGE, value=settings.temperature, step=0.05, label="Temperature",
                        elem_id="temperature",
                    )  # fmt: skip
                    top_p = gr.Slider(*TOP_P_RANGE, value=settings.top_p, step=0.05, label="Top-p", elem_id="top-p")
                    top_k = gr.Slider(
                        *TOP_K_RANGE, value=settings.top_k, step=1, label="Top-k (0: no limit)", elem_id="top-k"
                    )
                    max_tokens = gr.Slider(
                        *MAX_NEW_TOKENS_RANGE, value=settings.max_new_tokens, step=1, label="Max new tokens",
                        elem_id="max-tokens",
                    )  # fmt: skip
                with gr.Row():
                    repetition_penalty = gr.Slider(
                        *REPETITION_PENALTY_RANGE, value=settings.repetition_penalty, step=0.01,
                        label="Repetition penalty (1: off)", elem_id="repetition-penalty",
                    )  # fmt: skip
                    frequency_penalty = gr.Slider(
                        *PENALTY_RANGE, value=settings.frequency_penalty, step=0.05, label="Frequency penalty",
                        elem_id="frequency-penalty",
                    )  # fmt: skip
                    presence_penalty = gr.Slider(
                        *PENALTY_RANGE, value=settings.presence_penalty, step=0.05, label="Presence penalty",
                        elem_id="presence-penalty",
                    )  # fmt: skip
                with gr.Row():
                    # Tokens of history sent: the oldest turns are left out beyond it (chat_flow.fit), and the reply
                    # says so. Checked against the loaded model's own maximum when a reply is asked for.
                    context_length = gr.Number(
                        value=settings.context_length, precision=0, minimum=CONTEXT_LENGTH_RANGE[0],
                        maximum=CONTEXT_LENGTH_RANGE[1], label="Context length (tokens of the chat sent; 0: all)",
                        elem_id="context-length",
                    )  # fmt: skip
                save_default = gr.Button("Save as default for new chats", size="sm", elem_id="save-default")
    return ChatTab(
        conv_id=conv_id, search=search, conv_list=conv_list, new_chat=new_chat, rename_box=rename_box, rename=rename,
        delete=delete, confirm_delete=confirm_delete, keep_chat=keep_chat, pending_delete=pending_delete,
        pending_edit=pending_edit, export=export, export_all=export_all, export_file=export_file, chatbot=chatbot,
        notice=notice, textbox=textbox, send=send, stop=stop, regenerate=regenerate, continue_reply=continue_reply,
        alt_prev=alt_prev, alt_label=alt_label, alt_next=alt_next, import_file=import_file, address=address, nav=nav,
        system=system, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
        repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        context_length=context_length, save_default=save_default, view=view,
    )  # fmt: skip


def notice(sentence: str = "") -> gr.Markdown:
    return gr.Markdown(value=warning(sentence) if sentence else "", visible=bool(sentence))


def done(sentence: str) -> gr.Markdown:
    """The notice line saying that something asked for was done (no warning sign)."""
    return gr.Markdown(value=literal(sentence), visible=True)


def sentence_of(exc: Exception) -> str:
    """What the user reads for a failed action: our own sentences as they are, anything else named and logged."""
    if isinstance(exc, Problem | StoreError | LookupError):
        return str(exc)
    log.exception("chat action failed")
    return f"That did not work ({type(exc).__name__}: {exc}). The chat is still usable: try again."


def guarded(fn, outputs: int):  # noqa: ANN001, ANN201 - wraps an event handler
    """The handler with its failures shown in the notice (its last output), the other outputs left as they are.
    A raised gr.Error would put a red "Error" pill over every output instead: the chat list, the chat, the input."""

    def failed(exc: Exception) -> tuple:
        return (*[gr.skip()] * (outputs - 1), notice(sentence_of(exc)))

    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def stream(*args):
            try:
                yield from fn(*args)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a sentence in the chat
                yield failed(exc)

        return stream

    @functools.wraps(fn)
    def plain(*args):
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a sentence in the chat
            return failed(exc)

    return plain


# --- named handlers: each takes the session first (wire binds it) and the event's inputs ---------------------------


def generation(session: Session, values: tuple | list) -> tuple[dict, Sampling]:
    """The Generation values as they came (from the page, or from a script calling its API: a NaN, a string, a
    fraction of a token), in GENERATION_KEYS' order, checked by the store's one check of every setting before anything
    uses them: the values a chat keeps and the Sampling of a reply. A refused value is a Problem: a sentence naming
    it."""
    if len(values) != len(GENERATION_KEYS):
        raise Problem(f"Send the {len(GENERATION_KEYS)} Generation values ({', '.join(GENERATION_KEYS)}), in order.")
    try:
        checked = session.store.settings.check(**dict(zip(GENERATION_KEYS, values, strict=True)))
    except ValueError as exc:
        raise Problem(str(exc)) from exc
    return checked.generation(), checked.sampling()


def chat_generation(session: Session, conv_id: int | None, values: tuple | list) -> tuple[str, Sampling, int]:
    """The values checked and kept as chat `conv_id`'s own (a chat not yet sent keeps them at its first Send): the
    system prompt, the Sampling of a reply and the chat's context length."""
    own, sampling = generation(session, values)
    if conv_id is not None:
        session.store.chats.set_generation(conv_id, own)
    return own["system_prompt"], sampling, own["context_length"]


def keep_generation(session: Session, conv_id: int | None, *values) -> gr.Markdown:
    """A Generation control changed: the chat keeps the new values at once (a reload shows them). Values the chat
    already has change nothing: the system prompt's change event also fires when opening a chat shows its prompt, and
    a chat that follows the defaults must not be pinned to them by being opened."""
    own, _ = generation(session, values)
    if session.runtime is not None:  # said as it is set, not only at the next reply
        chat_flow.check_context(session.runtime, own["context_length"])
    if conv_id is not None:
        conv = session.store.chats.get(conv_id)
        if own != session.store.settings.for_chat(conv.generation).generation():
            session.store.chats.set_generation(conv_id, own)
    return notice()


def save_default(session: Session, *values) -> gr.Markdown:
    """The Generation values become the saved defaults new chats start from (the chats there are keep their own)."""
    own, _ = generation(session, values)
    session.store.settings.set(**own)
    return done("Saved: new chats start from these Generation settings; each chat keeps its own.")


def shown_chat(session: Session, conv_id: int | None, said: gr.Markdown | None = None, relist: bool = True) -> tuple:
    """What the page shows of chat `conv_id` (None: a new chat, with the saved defaults), in CHAT_OUTPUTS' order:
    the chat, the list (`relist`; else left as it is), the title to rename, the address, its Generation values, and
    the notice line ("loaded" on the list marks that a page's load event has landed: browser tests wait for it)."""
    chats = session.store.chats
    listed = gr.Radio(choices=conversation_choices(session), value=conv_id, elem_classes=["loaded"]) if relist else None
    if conv_id is None:
        own, shown, title, address = session.store.settings.load(), [], "", "new"
    else:
        conv = chats.get(conv_id)
        own, shown, title = (
            session.store.settings.for_chat(conv.generation),
            display(chats.messages(conv.id)),
            conv.title,
        )
        address = str(conv.id)
    kept = own.generation()
    values = [kept[key] for key in GENERATION_KEYS]
    return conv_id, shown, listed or gr.skip(), title, address, *values, said or notice()


def open_address(session: Session, wanted: str | None) -> tuple:
    """The chat the page's address names (`?chat=ID`; `new`: a new chat), else the most recently updated one: on a
    page's load and after back or forward. A chat that no longer exists is said, and the newest one shown."""
    wanted = wanted.strip() if isinstance(wanted, str) else ""
    if wanted == "new":
        return shown_chat(session, None)
    said = None
    if wanted:
        if not (wanted.isascii() and wanted.isdigit() and len(wanted) <= ADDRESS_CHARS):
            said = notice("The page's address names no chat (it ends in ?chat= and a number). Pick one from the list.")
        else:
            try:
                return shown_chat(session, session.store.chats.get(int(wanted)).id)
            except ChatNotFoundError as exc:
                said = notice(str(exc))
    newest = session.store.chats.list(limit=1)
    return shown_chat(session, newest[0].id if newest else None, said)


def import_chats(session: Session, path: str | None) -> tuple:
    """Chats from a JSON export added as new chats (never over one there is); the first of them is shown."""
    if not isinstance(path, str) or not path:
        raise Problem("Pick the JSON file that “Export all chats (JSON)” wrote.")
    try:
        check_size(os.path.getsize(path))  # before reading a byte of it
        with open(path, "rb") as file:
            imported = parse_export(file.read(MAX_IMPORT_BYTES + 1))
    except ImportRefused as exc:
        raise Problem(str(exc)) from exc
    if not imported:
        raise Problem("This export holds no chat, so there is nothing to import.")
    ids = session.store.chats.import_chats(imported)
    count = f"{len(ids)} chats" if len(ids) > 1 else "1 chat"
    return shown_chat(session, ids[0], done(f"Imported {count} (added beside yours; none was replaced)."))


def _with_view(values: tuple) -> tuple[tuple, PageView | None]:
    """The Generation values and the page's PageView, which the page sends after them (a handler called directly,
    as the tests do, sends none)."""
    if values and isinstance(values[-1], PageView):
        return values[:-1], values[-1]
    return values, None


def busy() -> gr.Button:
    """Send while the shown chat's reply streams: it says so and cannot be pressed."""
    return gr.Button(value="Generating…", interactive=False)


def idle() -> gr.Button:
    return gr.Button(value="Send", interactive=True)


def asking(visible: bool, label: str = "") -> tuple:
    """(Delete, the confirming button, Keep it): the question is shown, or the plain Delete again."""
    confirm = gr.Button(value=label, visible=True) if visible else gr.Button(visible=False)
    return gr.Button(visible=not visible), confirm, gr.Button(visible=visible)


def shows(view: PageView | None, shown: tuple) -> tuple:
    """`shown` (shown_chat's outputs), the page's PageView now naming its chat: a reply streaming into another chat
    stops drawing itself here (`while_shown`)."""
    showing(view, shown[0])
    return shown


def chat_outputs(tab: ChatTab) -> list:
    """What `shown_chat` fills, in its order."""
    return [tab.conv_id, tab.chatbot, tab.conv_list, tab.rename_box, tab.address, *tab.generation, tab.notice]


CHAT_OUTPUTS = 6 + len(GENERATION_KEYS)  # len(chat_outputs(tab))
ADDRESS_OUTPUT = 4  # chat_outputs(tab).index(tab.address)


class ChatHandlers:
    """The chat tab's event handlers, one method per event, each taking the event's inputs in the order `wire`
    connects them (the page's PageView last where a handler changes or follows the chat shown). Problems are raised
    as `Problem` sentences; `wire` wraps each handler in `guarded`, which shows them in the notice line."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.chats = session.store.chats

    # --- replies: each streams Chatbot message lists while the page shows its chat -----------------------------

    def send(self, text, conv_id, *values):  # noqa: ANN001, ANN201 - the event's inputs; a generator of outputs
        values, view = _with_view(values)
        if not isinstance(text, str) or not text.strip():
            raise Problem("Type a message first.")
        text = text.strip()
        own, sampling = generation(self.session, values)
        runtime = chat_flow.runtime_of(self.session)
        chat_flow.check_context(runtime, own["context_length"])  # before the message is kept
        if conv_id is not None and self.session.chat_reply(conv_id) is not None:
            raise Problem(chat_flow.STILL_ANSWERING)
        if conv_id is None:
            model = self.session.model_id or runtime.info.name
            conv_id = self.chats.create(title=text[:TITLE_CHARS], model=model, generation=own).id
        else:
            self.chats.set_generation(conv_id, own)
        self.chats.append(conv_id, "user", text)
        showing(view, conv_id)
        choices = conversation_choices(self.session)
        shown = display(self.chats.messages(conv_id))
        # This chat's first outputs, or, where another chat was opened since `showing` (the reply starting takes a
        # while on a busy machine), only what is true on any page: the message left the textbox, and the chat list
        # holds this chat (its selection is the chat opened).
        chat = (conv_id, "", gr.Radio(choices=choices, value=conv_id), str(conv_id), notice())
        elsewhere = (gr.skip(), "", gr.Radio(choices=choices), gr.skip(), notice())
        try:  # submitted before the first yield: the page may be gone by the next one (a reload), the reply not
            reply = chat_flow.start_reply(self.session, conv_id, own["system_prompt"], sampling, own["context_length"])
        except Exception:
            # The message as sent, then why no reply.
            yield from _first_redraw(view, conv_id, (shown, *chat), (gr.skip(), *elsewhere))
            raise
        if view is not None and view.stop_asked:  # Stop came before this reply existed (`stop`: flag, then cancel)
            reply.handle.cancel()
        pending = shown + [{"role": "assistant", "content": "…"}]
        if (yield from _first_redraw(view, conv_id, (pending, *chat), (gr.skip(), *elsewhere))):
            # The next redraw selects this chat in the list again, as a plain value. Gradio's page applies a stream's
            # diffs in place to the outputs it keeps, which are the objects of an output it may not have drawn yet
            # (messages that reach the page before it has registered their event, on a stream another event keeps
            # open, are handled in one go): the skip right after the list's update deleted its choices, and the list
            # lacked the chat just sent. From a value the diff replaces the output whole.
            listed = conv_id
            for chatbot in while_shown(view, conv_id, chat_flow.follow(self.session, reply)):
                yield (
                    _drawn(chatbot),
                    gr.skip(),
                    gr.skip(),
                    gr.skip() if chatbot is None else listed,
                    gr.skip(),
                    gr.skip(),
                )
                listed = gr.skip()

    def regenerate(self, conv_id, *values):  # noqa: ANN001, ANN201
        values, view = _with_view(values)
        system, sampling, context = chat_generation(self.session, conv_id, values)
        replies = chat_flow.regenerate(self.session, conv_id, system, sampling, context)
        yield from self._streamed(view, conv_id, replies)

    def continue_reply(self, conv_id, *values):  # noqa: ANN001, ANN201
        values, view = _with_view(values)
        system, sampling, context = chat_generation(self.session, conv_id, values)
        replies = chat_flow.continue_reply(self.session, conv_id, system, sampling, context)
        yield from self._streamed(view, conv_id, replies)

    def take_edit(self, conv_id, data: gr.EditData):  # noqa: ANN001, ANN201
        """The edit event's own step: only it receives the event's data; the reply (`edit`) runs later in the chain."""
        if conv_id is not None:
            self.session.stop_chat(conv_id)  # the reply being generated answers the old text: end it
        return (data.index, data.value if isinstance(data.value, str) else str(data.value))

    def edit(self, pending, conv_id, *values):  # noqa: ANN001, ANN201
        values, view = _with_view(values)
        if pending is None:
            raise Problem("That edit was already applied. Edit the message again to change it.")
        index, text = pending
        system, sampling, context = chat_generation(self.session, conv_id, values)
        replies = chat_flow.edit(self.session, conv_id, index, text, system, sampling, context)
        yield from self._streamed(view, conv_id, replies)

    def _streamed(self, view: PageView | None, conv_id: int | None, replies):  # noqa: ANN001, ANN202
        first = next(replies)  # a Problem (nothing to regenerate, no model) is raised before the notice is cleared
        if view is not None and view.stop_asked and conv_id is not None:  # Stop came before the reply existed
            self.session.stop_chat(conv_id)
        # The first redraw is checked too: another chat may have been opened since the button was pressed.
        said = notice()  # cleared with the first redraw, left alone after it
        for chatbot in while_shown(view, conv_id, itertools.chain([first], replies)):
            yield (_drawn(chatbot), said) if chatbot is not None else (gr.skip(), gr.skip())
            said = gr.skip()

    def follow(self, conv_id, view=None):  # noqa: ANN001, ANN201
        """The shown chat's reply still being written (after opening the chat, a reload): streamed until it ends.
        With none running, the chat as stored now, once: a reply saved between the opening handler's read of the
        chat and this step (a reply saves, then ends) was in neither, and the page showed the question alone."""
        reply = self.session.chat_reply(conv_id) if conv_id is not None else None
        if reply is not None:
            replies, send = chat_flow.follow(self.session, reply), busy()
        elif conv_id is not None:
            replies, send = [display(self.chats.messages(conv_id))], gr.skip()
        else:
            replies, send = [], gr.skip()
        for chatbot in while_shown(view, conv_id, replies):
            yield (_drawn(chatbot), send) if chatbot is not None else (gr.skip(), gr.skip())
        yield gr.skip(), gr.skip()  # the event's last output, which Gradio applies again when it ends: nothing

    def ask(self, view: PageView | None = None) -> gr.Button:
        """Send (Regenerate, Continue, an edit) pressed, before its handler runs: Send shows that a reply is coming,
        and a Stop from now on is for that reply."""
        if view is not None:
            view.stop_asked = False
        return busy()

    def stop(self, view: PageView | None = None) -> None:
        # The flag first, the replies next; a reply handler registers its reply first, reads the flag next: whichever
        # order the two run in, a reply asked for before this Stop is stopped.
        if view is not None:
            view.stop_asked = True
        self.session.stop_chat()

    def ended(self, conv_id) -> tuple:  # noqa: ANN001
        """After a reply's chain, in one step: when Send is back, Continue and "< 1/2 >" already match the reply that
        just ended. Send follows the shown chat's state, not the event that ended: a chain ending late cannot free
        Send under a new reply."""
        return (busy() if self.session.chat_reply(conv_id) is not None else idle()), *self.controls(conv_id)

    def controls(self, conv_id) -> tuple:  # noqa: ANN001
        """Continue for a reply cut by the token limit, "< 1/2 >" when the last reply has versions."""
        stored = self.chats.messages(conv_id) if conv_id is not None else []
        label = chat_flow.versions_label(stored)
        cut = bool(stored) and chat_flow.can_continue(stored[-1])
        alt = gr.Button(visible=bool(label))
        return gr.Button(visible=cut), alt, gr.Button(value=label, visible=bool(label)), alt

    def previous_version(self, conv_id) -> tuple:  # noqa: ANN001
        return chat_flow.choose(self.session, conv_id, -1), notice()

    def next_version(self, conv_id) -> tuple:  # noqa: ANN001
        return chat_flow.choose(self.session, conv_id, 1), notice()

    # --- which chat is shown: each returns shown_chat's outputs -------------------------------------------------

    def new_chat(self, view=None) -> tuple:  # noqa: ANN001
        return shows(view, shown_chat(self.session, None))

    def on_load(self, address, view=None) -> tuple:  # noqa: ANN001
        """The page's load, and back/forward: the chat the address names. An address that already names the chat
        shown is left as it is: back pressed twice quickly opens the first address, then (its event runs again once
        it ends) the second, which the page read into `address` meanwhile; the first's output must not put its
        older address back, or the second opening would open it again and push it into the history."""
        shown = shows(view, open_address(self.session, address))
        at = ADDRESS_OUTPUT
        return (*shown[:at], gr.skip(), *shown[at + 1 :]) if shown[at] == address else shown

    def select(self, conv_id, view=None) -> tuple:  # noqa: ANN001
        if conv_id is None:
            return (gr.skip(),) * CHAT_OUTPUTS
        return shows(view, shown_chat(self.session, int(conv_id), relist=False))

    def import_file(self, path, view=None) -> tuple:  # noqa: ANN001
        return shows(view, import_chats(self.session, path))

    # --- the list: search, rename, delete, export -------------------------------------------------------------

    def search(self, query, conv_id) -> tuple:  # noqa: ANN001
        query = query if isinstance(query, str) else ""
        if len(query) > SEARCH_CHARS:
            raise Problem(f"Search for at most {SEARCH_CHARS:,} characters: a few words from the chat are enough.")
        return gr.Radio(choices=conversation_choices(self.session, query), value=conv_id), notice()

    def rename(self, conv_id, title) -> tuple:  # noqa: ANN001
        if conv_id is None:
            raise Problem("Pick a conversation to rename first.")
        if not isinstance(title, str) or not title.strip():
            raise Problem("Type the new title first.")
        if len(title.strip()) > RENAME_CHARS:
            raise Problem(f"A title can be at most {RENAME_CHARS} characters long. Type a shorter one.")
        self.chats.rename(conv_id, title.strip())
        return gr.Radio(choices=conversation_choices(self.session), value=conv_id), notice()

    def delete(self, conv_id) -> tuple:  # noqa: ANN001
        """Asks first: the confirming button names the chat (nothing is deleted until it is pressed)."""
        if conv_id is None:
            raise Problem("Pick a conversation to delete first.")
        conv = self.chats.get(conv_id)
        return conv.id, *asking(True, f"Yes, delete “{conv.title or 'Untitled'}”"), notice()

    def confirm_delete(self, pending, view=None) -> tuple:  # noqa: ANN001
        if pending is None:  # a second click on an answered question: nothing is pending any more
            return (None, *asking(False), *(gr.skip(),) * (CHAT_OUTPUTS - 1), notice())
        self.session.stop_chat(pending)  # a reply still being written there has nowhere to go
        self.chats.delete(pending)
        return None, *asking(False), *shows(view, shown_chat(self.session, None))

    def keep_chat(self) -> tuple:
        return None, *asking(False)

    def export(self, conv_id) -> tuple:  # noqa: ANN001
        if conv_id is None:
            raise Problem("Pick a conversation to export first.")
        title = self.chats.get(conv_id).title or "chat"
        safe = "".join(c if c.isalnum() or c in " -_" else "_" for c in title).strip()[:40] or "chat"
        path = self.session.export_path(f"{safe}.md")
        path.write_text(chat_markdown(self.chats, conv_id), encoding="utf-8")
        return gr.File(value=str(path), visible=True), notice()

    def export_all(self) -> tuple:
        stamp = time.strftime("%Y-%m-%d")
        path = self.session.export_path(f"fmoe-local-chats-{stamp}.json")
        path.write_text(self.chats.export_all_json(), encoding="utf-8")
        return gr.File(value=str(path), visible=True), notice()

    # --- the Generation panel ---------------------------------------------------------------------------------

    def keep_generation(self, conv_id, *values) -> gr.Markdown:  # noqa: ANN001
        return keep_generation(self.session, conv_id, *values)

    def save_default(self, *values) -> gr.Markdown:  # noqa: ANN002
        return save_default(self.session, *values)


def wire(session: Session, tab: ChatTab, demo: gr.Blocks) -> list:
    """Attach the events; returns the events after which a reply has finished (the Stats tab chains on them).

    While the shown chat's reply streams, Send says so and cannot be pressed; each reply's chain ends in `ended`,
    which re-enables it however the reply ended. Opening, starting or deleting another chat stops the page drawing
    the reply (`while_shown`), never the reply itself, and shows that chat's state instead."""
    h, t = ChatHandlers(session), tab
    gen = t.generation
    shown = chat_outputs(t)
    # Gradio's default ("once") drops an event fired while its previous run is still pending, so a chat opened (or
    # an address stepped to, a search typed, a setting moved) in that moment was ignored and the page kept showing
    # the one before. Events whose last run must win are run again once the pending one ends.
    latest = dict(trigger_mode="always_last")
    quick = dict(queue=False, api_visibility="private", **latest)
    # No concurrency slot: the runtime queues requests itself, and a chat has one reply at a time (chat_flow.start).
    free = dict(concurrency_limit=None)
    held, ctrl = [t.send], [t.continue_reply, t.alt_prev, t.alt_label, t.alt_next]

    def on(event, fn, inputs, outputs, **kwargs):  # noqa: ANN001, ANN202
        return event(guarded(fn, len(outputs)), inputs, outputs, **kwargs)

    def reply(trigger, fn, inputs, outputs, **kwargs):  # noqa: ANN001, ANN202 - Send held, then the reply
        asked = trigger(h.ask, [t.view], held, queue=False, api_visibility="private")  # one reply per press
        # Every press that got past `ask` runs: a Send streams until its reply's next redraw sees another chat shown
        # (a reply waiting for its turn: until it starts), and "once" dropped a message sent in another chat meanwhile.
        return on(asked.then, fn, inputs, outputs, **kwargs, **free, trigger_mode="multiple")

    send_out = [t.chatbot, t.conv_id, t.textbox, t.conv_list, t.address, t.notice]
    send_in, reply_in = [t.textbox, t.conv_id, *gen, t.view], [t.conv_id, *gen, t.view]
    sent = reply(t.send.click, h.send, send_in, send_out, api_name="send")
    submitted = reply(t.textbox.submit, h.send, send_in, send_out, api_visibility="private")
    regen = reply(t.regenerate.click, h.regenerate, reply_in, [t.chatbot, t.notice], api_name="regenerate")
    cont = reply(t.continue_reply.click, h.continue_reply, reply_in, [t.chatbot, t.notice], api_name="continue")
    # Editing a question ends the reply being generated (it would answer the old text), then answers the new one.
    taken = t.chatbot.edit(h.take_edit, [t.conv_id], [t.pending_edit], **quick).then
    edit_in = [t.pending_edit, t.conv_id, *gen, t.view]
    edited = reply(taken, h.edit, edit_in, [t.chatbot, t.notice], api_visibility="private")
    replies = [sent, submitted, regen, cont, edited]
    for event in replies:
        event.then(h.ended, [t.conv_id], [*held, *ctrl], **quick)
    t.stop.click(h.stop, [t.view], None, api_name="stop", concurrency_limit=None)
    for button, choose in ((t.alt_prev, h.previous_version), (t.alt_next, h.next_version)):
        flipped = on(button.click, choose, [t.conv_id], [t.chatbot, t.notice], api_visibility="private")
        flipped.then(h.controls, [t.conv_id], ctrl, **quick)

    followers = []

    def then_follow(event):  # noqa: ANN001, ANN202 - another chat is shown: follow its reply if one runs
        following = event.then(
            h.follow, [t.conv_id, t.view], [t.chatbot, *held], api_visibility="private", **free, **latest
        )
        followers.append(following)
        return following.then(h.ended, [t.conv_id], [*held, *ctrl], **quick)

    opened = on(t.new_chat.click, h.new_chat, [t.view], shown, api_name="new_chat")
    opened.then(h.ended, [t.conv_id], [*held, *ctrl], **quick)  # a new chat has no reply to follow
    then_follow(on(t.conv_list.input, h.select, [t.conv_list, t.view], shown, api_name="open_chat", **latest))
    # The address follows the chat shown; back and forward (the page's script presses the hidden nav) open its chat.
    # The script only reads the address (into `address`); the handler then gets it with the page's PageView.
    t.address.change(None, [t.address], None, js=ADDRESS_JS, **quick)
    read = t.nav.click(None, None, [t.address], js=READ_ADDRESS_JS, **quick)
    then_follow(on(read.then, h.on_load, [t.address, t.view], shown, api_visibility="private", **latest))
    # Each control's change is kept with the chat at once; Save as default makes the values new chats start from. The
    # system prompt's input event sends the text as it was before the last keystroke (Gradio 6): its change event.
    on(t.system.change, h.keep_generation, [t.conv_id, *gen], [t.notice], **quick)
    for control in gen[1:]:
        on(control.input, h.keep_generation, [t.conv_id, *gen], [t.notice], **quick)
    on(t.save_default.click, h.save_default, gen, [t.notice], api_name="save_default")
    imported = on(t.import_file.upload, h.import_file, [t.import_file, t.view], shown, api_name="import_chats")
    imported.then(h.ended, [t.conv_id], [*held, *ctrl], **quick)  # imported chats have no reply to follow
    # change, not input: Gradio's input event is not fired for a deletion, so a search cleared with Backspace kept
    # the list it had filtered.
    on(t.search.change, h.search, [t.search, t.conv_id], [t.conv_list, t.notice], api_name="search_chats", **latest)
    on(t.rename.click, h.rename, [t.conv_id, t.rename_box], [t.conv_list, t.notice], api_name="rename_chat")
    question = [t.delete, t.confirm_delete, t.keep_chat]
    on(t.delete.click, h.delete, [t.conv_id], [t.pending_delete, *question, t.notice], api_name="delete_chat")
    confirm_out = [t.pending_delete, *question, *shown]
    deleted = on(t.confirm_delete.click, h.confirm_delete, [t.pending_delete, t.view], confirm_out,
                 api_name="confirm_delete_chat")  # fmt: skip
    deleted.then(h.ended, [t.conv_id], [*held, *ctrl], **quick)
    t.keep_chat.click(h.keep_chat, None, [t.pending_delete, *question], api_visibility="private")
    on(t.export.click, h.export, [t.conv_id], [t.export_file, t.notice], api_name="export_chat")
    on(t.export_all.click, h.export_all, None, [t.export_file, t.notice], api_name="export_all_chats")
    read = demo.load(None, None, [t.address], js=READ_ADDRESS_JS, **quick)
    then_follow(on(read.then, h.on_load, [t.address, t.view], shown, api_visibility="private"))  # a reply still written
    return replies + followers
