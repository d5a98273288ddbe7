"""Chat tab: the conversation list (from SQLite), the chat itself, generation settings.

Scope: components and their events. Conversations live in the store; the chatbot only displays them, so what
the model sees is always the stored text (the stats line under a reply is display-only). It does NOT load
models (Models tab) or change the runtime's settings (Settings tab). One request at a time: the send and
regenerate events share one concurrency slot, Stop has its own so that it is never queued behind a reply.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from fmoe_local.config import Sampling
from ui.render import safe_markdown
from ui.session import Session

NO_MODEL = "No model is loaded yet. Open the Models tab to download one or load a model folder."
TITLE_CHARS = 48


@dataclass
class ChatTab:
    conv_id: gr.State
    search: gr.Textbox
    conv_list: gr.Radio
    new_chat: gr.Button
    rename_box: gr.Textbox
    rename: gr.Button
    delete: gr.Button
    export: gr.Button
    export_file: gr.File
    chatbot: gr.Chatbot
    textbox: gr.Textbox
    send: gr.Button
    stop: gr.Button
    regenerate: gr.Button
    edit_last: gr.Button
    system: gr.Textbox
    temperature: gr.Slider
    top_p: gr.Slider
    max_tokens: gr.Slider


def stats_line(stats: dict | None) -> str:
    if not stats:
        return ""
    parts = [f"{stats.get('tokens_per_s', 0):.1f} tok/s", f"TTFT {1000 * stats.get('ttft_s', 0):.0f} ms"]
    parts.append(f"expert hit rate {100 * stats.get('hit_rate', 0):.0f}%")
    if stats.get("finish_reason") == "cancelled":
        parts.append("stopped")
    elif stats.get("finish_reason") == "length":
        parts.append("length limit reached (raise Max new tokens under Generation for longer replies)")
    return " · ".join(parts)


def display(messages) -> list[dict]:
    """Stored messages → Chatbot messages, with the stats line under each reply."""
    out = []
    for m in messages:
        if m.role == "system":
            continue
        content = safe_markdown(m.content)
        line = stats_line(m.stats) if m.role == "assistant" else ""
        if line:
            # A reply cut inside a code block would swallow the stats line as code: close the block first.
            content = f"{content}{close_fences(content)}\n\n<span class='reply-stats'>{line}</span>"
        out.append({"role": m.role, "content": content})
    return out


def close_fences(markdown: str) -> str:
    """The fence that closes a code block left open at the end of `markdown` ("" when none is open)."""
    open_fence = ""
    for line in markdown.splitlines():
        stripped = line.strip()
        fence = stripped[:3] if stripped[:3] in ("```", "~~~") else ""
        if fence and not open_fence:
            open_fence = stripped[: len(stripped) - len(stripped.lstrip(fence[0]))]
        elif fence and stripped.startswith(open_fence) and set(stripped) == {open_fence[0]}:
            open_fence = ""
    return f"\n{open_fence}" if open_fence else ""


def conversation_choices(session: Session, query: str = "") -> list[tuple[str, int]]:
    if query.strip():
        convs = [hit.conversation for hit in session.store.chats.search(query)]
    else:
        convs = session.store.chats.list()
    return [(c.title or "Untitled", c.id) for c in convs]


def build(session: Session) -> ChatTab:
    settings = session.store.settings.load()
    conv_id = gr.State(None)
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
                export = gr.Button("Export as Markdown", size="sm", elem_id="export-chat")
                export_file = gr.File(label="Exported chat", visible=False, elem_id="export-file")
        with gr.Column(scale=4):
            chatbot = gr.Chatbot(
                height=520,
                elem_id="chatbot",
                show_label=False,
                buttons=["copy"],
                feedback_options=None,
                placeholder="Ask anything. Replies stream from the model running on this computer.",
            )
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
                edit_last = gr.Button("✎ Edit last message", size="sm", elem_id="edit-last")
            with gr.Accordion("Generation", open=False):
                system = gr.Textbox(label="System prompt", value=settings.system_prompt, lines=2, elem_id="system")
                with gr.Row():
                    temperature = gr.Slider(0.0, 2.0, value=settings.temperature, step=0.05, label="Temperature")
                    top_p = gr.Slider(0.05, 1.0, value=settings.top_p, step=0.05, label="Top-p")
                    max_tokens = gr.Slider(
                        1, 4096, value=settings.max_new_tokens, step=1, label="Max new tokens", elem_id="max-tokens"
                    )
    return ChatTab(
        conv_id, search, conv_list, new_chat, rename_box, rename, delete, export, export_file, chatbot, textbox, send, stop,
        regenerate, edit_last, system, temperature, top_p, max_tokens,
    )  # fmt: skip


def _generate(session: Session, conv_id: int, system: str, sampling: Sampling):
    """Stream a reply to the stored conversation; yields (chatbot, done). Saves the reply (even a stopped one)."""
    from fmoe_local.runtime import Finished, TextDelta

    stored = session.store.chats.messages(conv_id)
    after = stored[-1].position if stored else -1  # the reply belongs after this message, or nowhere
    messages = ([{"role": "system", "content": system}] if system.strip() else []) + [
        {"role": m.role, "content": m.content} for m in stored
    ]
    shown = display(stored)
    text = ""
    for event in session.runtime.stream(messages, sampling):
        if isinstance(event, TextDelta):
            text += event.text
            yield shown + [{"role": "assistant", "content": safe_markdown(text)}], False
        elif isinstance(event, Finished):
            if event.reason == "error":
                # Inline, under what was generated before the failure; the chat stays usable (Regenerate, Send).
                if event.text.strip():
                    session.store.chats.append(conv_id, "assistant", event.text, event.stats, after=after)
                notice = {"role": "assistant", "content": f"⚠️ {safe_markdown(event.error)}"}
                yield display(session.store.chats.messages(conv_id)) + [notice], True
                return
            session.record(event.stats)
            session.store.chats.append(conv_id, "assistant", event.text, event.stats, after=after)
            yield display(session.store.chats.messages(conv_id)), True


def wire(session: Session, tab: ChatTab, demo: gr.Blocks) -> list:
    """Attach the events; returns the events after which a reply has finished (the Stats tab chains on them)."""
    chats = session.store.chats

    def sampling(temperature: float, top_p: float, max_tokens: float) -> Sampling:
        return Sampling(
            max_new_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p), greedy=temperature == 0
        )

    def send(text, conv_id, system, temperature, top_p, max_tokens):
        text = (text or "").strip()
        if not text:
            raise gr.Error("Type a message first.")
        if session.runtime is None:
            raise gr.Error(session.load_error or NO_MODEL)
        session.store.settings.set(
            temperature=float(temperature), top_p=float(top_p), max_new_tokens=int(max_tokens), system_prompt=system
        )
        if conv_id is None:
            conv_id = chats.create(title=text[:TITLE_CHARS], model=session.model_id).id
        chats.append(conv_id, "user", text)
        choices = gr.Radio(choices=conversation_choices(session), value=conv_id)
        shown = display(chats.messages(conv_id))
        yield shown + [{"role": "assistant", "content": "…"}], conv_id, "", choices
        for chatbot, _ in _generate(session, conv_id, system, sampling(temperature, top_p, max_tokens)):
            yield chatbot, conv_id, gr.skip(), gr.skip()

    def regenerate(conv_id, system, temperature, top_p, max_tokens):
        if session.runtime is None:
            raise gr.Error(session.load_error or NO_MODEL)
        stored = chats.messages(conv_id) if conv_id is not None else []
        if not any(m.role == "user" for m in stored):
            raise gr.Error("Nothing to regenerate yet. Send a message first.")
        while stored and stored[-1].role == "assistant":
            stored.pop()
        chats.truncate(conv_id, keep=len(stored))
        for chatbot, _ in _generate(session, conv_id, system, sampling(temperature, top_p, max_tokens)):
            yield chatbot

    def stop():
        if session.runtime is not None:
            session.runtime.stop()

    def edit_last(conv_id):
        if session.runtime is not None:
            session.runtime.stop()  # editing the question ends its reply (which is then not stored)
        stored = chats.messages(conv_id) if conv_id is not None else []
        users = [m for m in stored if m.role == "user"]
        if not users:
            raise gr.Error("There is no message of yours to edit yet.")
        last = users[-1]
        chats.truncate(conv_id, keep=last.position)
        return display(chats.messages(conv_id)), last.content

    def new_chat():
        return None, [], gr.Radio(choices=conversation_choices(session), value=None), ""

    def select(conv_id):
        if conv_id is None:
            return gr.skip(), gr.skip(), gr.skip()
        conv = chats.get(int(conv_id))
        return int(conv_id), display(chats.messages(conv.id)), conv.title

    def search(query, conv_id):
        return gr.Radio(choices=conversation_choices(session, query), value=conv_id)

    def rename(conv_id, title):
        if conv_id is None:
            raise gr.Error("Pick a conversation to rename first.")
        if not title.strip():
            raise gr.Error("Type the new title first.")
        chats.rename(conv_id, title.strip())
        return gr.Radio(choices=conversation_choices(session), value=conv_id)

    def delete(conv_id):
        if conv_id is None:
            raise gr.Error("Pick a conversation to delete first.")
        chats.delete(conv_id)
        return None, [], gr.Radio(choices=conversation_choices(session), value=None), ""

    def export(conv_id):
        if conv_id is None:
            raise gr.Error("Pick a conversation to export first.")
        title = chats.get(conv_id).title or "chat"
        safe = "".join(c if c.isalnum() or c in " -_" else "_" for c in title).strip()[:40] or "chat"
        # Gradio serves files from the system temp folder; a fresh folder per export avoids name clashes.
        path = Path(tempfile.mkdtemp(prefix="fmoe-export-")) / f"{safe}.md"
        path.write_text(chats.export_markdown(conv_id), encoding="utf-8")
        return gr.File(value=str(path), visible=True)

    def on_load():
        # The saved generation settings, read per page: a reload shows what the last Send saved, not the values
        # the app started with (which the next Send would have written back).
        s = session.store.settings.load()
        saved = (s.system_prompt, s.temperature, s.top_p, s.max_new_tokens)
        choices = conversation_choices(session)
        # "loaded" marks the end of this page's load event (browser tests wait for it before typing).
        if not choices:
            return None, [], gr.Radio(choices=[], value=None, elem_classes=["loaded"]), *saved
        latest = choices[0][1]
        listed = gr.Radio(choices=choices, value=latest, elem_classes=["loaded"])
        return latest, display(chats.messages(latest)), listed, *saved

    t = tab
    gen_inputs = [t.system, t.temperature, t.top_p, t.max_tokens]
    send_outputs = [t.chatbot, t.conv_id, t.textbox, t.conv_list]
    slot = dict(concurrency_limit=1, concurrency_id="runtime")

    # While a reply streams, Send says so and cannot be pressed; `.then` re-enables it however the reply ended.
    def busy():
        return gr.Button(value="Generating…", interactive=False)

    def idle():
        return gr.Button(value="Send", interactive=True)

    quick = dict(queue=False, api_visibility="private")
    sent = t.send.click(busy, None, [t.send], **quick).then(
        send, [t.textbox, t.conv_id, *gen_inputs], send_outputs, api_name="send", **slot
    )
    submitted = t.textbox.submit(busy, None, [t.send], **quick).then(
        send, [t.textbox, t.conv_id, *gen_inputs], send_outputs, api_visibility="private", **slot
    )
    regen = t.regenerate.click(busy, None, [t.send], **quick).then(
        regenerate, [t.conv_id, *gen_inputs], [t.chatbot], api_name="regenerate", **slot
    )
    for event in (sent, submitted, regen):
        event.then(idle, None, [t.send], **quick)
    t.stop.click(stop, None, None, api_name="stop", concurrency_limit=None)
    t.edit_last.click(edit_last, [t.conv_id], [t.chatbot, t.textbox], api_name="edit_last")
    t.new_chat.click(new_chat, None, [t.conv_id, t.chatbot, t.conv_list, t.rename_box], api_name="new_chat")
    # The chatbot's own trash button would only blank the view; make it mean "new chat" (the old one is kept).
    t.chatbot.clear(new_chat, None, [t.conv_id, t.chatbot, t.conv_list, t.rename_box], api_visibility="private")
    t.conv_list.input(select, [t.conv_list], [t.conv_id, t.chatbot, t.rename_box], api_name="open_chat")
    t.search.input(search, [t.search, t.conv_id], [t.conv_list], api_name="search_chats")
    t.rename.click(rename, [t.conv_id, t.rename_box], [t.conv_list], api_name="rename_chat")
    t.delete.click(delete, [t.conv_id], [t.conv_id, t.chatbot, t.conv_list, t.rename_box], api_name="delete_chat")
    t.export.click(export, [t.conv_id], [t.export_file], api_name="export_chat")
    demo.load(on_load, None, [t.conv_id, t.chatbot, t.conv_list, *gen_inputs], api_visibility="private")
    return [sent, submitted, regen]
