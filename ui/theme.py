"""Look and feel: one calm theme and a little CSS. Fonts are served by Gradio itself or the system (no CDN).

Scope: styling only. In Gradio 6 theme and css are arguments of `launch()`, so app.py passes these along.
"""

from __future__ import annotations

import gradio as gr

CSS = """
/* As wide as the window up to 1280 px on every tab (Gradio otherwise shrinks the page to its content). */
.gradio-container { width: 100% !important; max-width: 1280px !important; margin: 0 auto; }
#app-title h1 { font-size: 1.35rem; margin: 0; }
#app-title p { margin: 0; color: var(--body-text-color-subdued); font-size: 0.85rem; }
#chat-sidebar { border-right: 1px solid var(--border-color-primary); padding-right: 12px; }
#conv-list { max-height: 420px; overflow-y: auto; }
#conv-list label { width: 100%; }
.reply-stats { display: block; margin-top: 6px; font-size: 0.78rem; color: var(--body-text-color-subdued); }
.progress-outer { width: 100%; height: 14px; border-radius: 7px; background: var(--neutral-200); overflow: hidden; }
.progress-inner { height: 100%; background: var(--color-accent); transition: width 0.4s; }
.fit-good { color: #15803d; } .fit-slow { color: #b45309; } .fit-no { color: #b91c1c; }
footer { display: none !important; }
/* Gradio's trash icon above the chat looks like "delete this chat" but only blanks the view: New chat and the
   sidebar's Delete (which asks first) are the two clear ways. */
#chatbot button[aria-label="Clear"] { display: none !important; }
"""


def theme() -> gr.themes.Base:
    return gr.themes.Base(
        primary_hue="indigo",
        secondary_hue="slate",
        neutral_hue="slate",
        radius_size="md",
        text_size="md",
        font=[gr.themes.LocalFont("IBM Plex Sans"), "ui-sans-serif", "system-ui", "sans-serif"],
        font_mono=[gr.themes.LocalFont("IBM Plex Mono"), "ui-monospace", "Consolas", "monospace"],
    ).set(
        body_background_fill="*neutral_50",
        block_background_fill="white",
        button_primary_background_fill="*primary_600",
        button_primary_background_fill_hover="*primary_700",
    )
