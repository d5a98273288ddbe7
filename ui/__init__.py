"""The Gradio interface: one module per tab (chat, models, settings, stats), each with build() and wire().

Scope: `build(session)` assembles the tabs into one gr.Blocks and chains the cross-tab refreshes (a finished
reply redraws the stats; loading a model refreshes settings and stats). No model logic lives in ui/; the
app's state is the Session object passed in (ui/session.py). Launching is app.py's job; theme and css are
launch() arguments in Gradio 6 (ui/theme.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ui.gradio_import import skip_type_stubs

if TYPE_CHECKING:
    import gradio as gr

    from ui.session import Session

__all__ = ["TITLE", "build", "header"]

# Before any ui module imports gradio: it then skips rewriting its type stubs, half of its import time.
skip_type_stubs()


def __getattr__(name: str) -> object:
    # The page's title and header are imported on first use, not with the package: `python -m ui.downloads` (a
    # download's child process) imports this package first, and the header's imports (torch, via the session) cost
    # that child seconds of start-up.
    if name in ("TITLE", "header"):
        from ui import page_header

        return getattr(page_header, name)
    raise AttributeError(f"module 'ui' has no attribute {name!r}")


HEADER_REFRESH_S = 2.0


def build(session: Session) -> gr.Blocks:
    # Imported here, not with the package, for the same reason as the header (gradio alone costs seconds).
    import gradio as gr

    from ui import chat, model_formats, models, settings, stats
    from ui.page_header import TITLE, header
    from ui.theme import THEME_CHOICES, THEME_JS, THEME_LOAD_JS

    # Before the tabs read the saved settings: what the store refuses is reset and said in the header.
    session.check_settings()
    # Gradio keeps a copy of every file the page offers or receives (a chat export, an imported chats file) in its
    # cache in the system temp folder: deleted a day after (checked hourly), and all of them when the app stops.
    with gr.Blocks(title=TITLE, analytics_enabled=False, fill_width=True, delete_cache=(3600, 86400)) as demo:
        with gr.Row(equal_height=True):
            top = gr.Markdown(header(session), elem_id="app-title")
            # Beside the system's own setting, the page can be kept light or dark (remembered by this browser).
            theme_choice = gr.Radio(
                list(THEME_CHOICES),
                value="System",
                show_label=False,
                container=False,
                scale=0,
                min_width=330,
                elem_id="theme-choice",
            )
        with gr.Tabs(elem_id="tabs") as tabs:
            with gr.Tab("Chat", id="chat", elem_id="tab-chat"):
                chat_tab = chat.build(session)
            with gr.Tab("Models", id="models", elem_id="tab-models"):
                models_tab = models.build(session)
            with gr.Tab("Settings", id="settings", elem_id="tab-settings"):
                settings_tab = settings.build(session)
            with gr.Tab("Stats", id="stats", elem_id="tab-stats"):
                stats_tab = stats.build(session)
        replies = chat.wire(session, chat_tab, demo)
        loads = models.wire(session, models_tab, demo, top)
        applied = settings.wire(session, settings_tab, demo)
        stats.wire(session, stats_tab, demo)

        def after_load():
            return header(session), *settings.refresh(session), *stats.draw(session)

        after_load_outputs = [top, *settings.refresh_outputs(settings_tab), *stats.outputs(stats_tab)]
        for event in loads:
            event.success(after_load, None, after_load_outputs, api_visibility="private")
        for event in applied:
            # The Models tab's format choice is the picked model's: Settings may have just chosen it for the loaded one.
            event.success(
                lambda folder: (header(session), *stats.draw(session), model_formats.format_for(session, folder)),
                [models_tab.format_target],
                [top, *stats.outputs(stats_tab), models_tab.expert_format],
                api_visibility="private",
            )
        for event in replies:
            event.then(lambda: stats.draw(session), None, stats.outputs(stats_tab), api_visibility="private")
        # Without a model the chat cannot answer: open the wizard first.
        demo.load(
            lambda: gr.Tabs(selected="chat" if session.runtime is not None or session.still_loading else "models"),
            None,
            [tabs],
            api_visibility="private",
        )
        demo.load(lambda: header(session), None, [top], api_visibility="private")
        # The page's own choice, in the browser: no request reaches the server.
        demo.load(None, None, [theme_choice], js=THEME_LOAD_JS, api_visibility="private")
        theme_choice.input(None, [theme_choice], [theme_choice], js=THEME_JS, api_visibility="private")

        def follow_header(shown):
            now = header(session)
            if now == shown:
                return tuple(gr.skip() for _ in after_load_outputs)
            return after_load()  # a load began or ended elsewhere: Settings and Stats describe the model too

        # Another tab, an API client or the start-up load may load a model: every open tab's header (and its
        # Settings and Stats) follows within seconds, not only the tab whose Load button redraws it as it goes.
        gr.Timer(HEADER_REFRESH_S).tick(
            follow_header, [top], after_load_outputs, queue=False, show_progress="hidden", api_visibility="private"
        )
    return demo
