"""Look and feel: one calm theme and a little CSS. Fonts are served by Gradio itself or the system (no CDN).

Scope: styling only. In Gradio 6 theme and css are arguments of `launch()`, so app.py passes these along. The page's
light/dark choice (System, Light, Dark) is the browser's: kept in its localStorage, applied by THEME_JS as Gradio
does its own (the `dark` class on the body), so each browser keeps its own choice and nothing is sent anywhere.
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
/* Present for the page's scripts (back/forward opens the chat of the address), never shown. */
.fmoe-hidden { display: none !important; }
#theme-choice { flex-grow: 0; }
#theme-choice .wrap { flex-wrap: nowrap; }
/* Gradio's trash icon above the chat looks like "delete this chat" but only blanks the view: New chat and the
   sidebar's Delete (which asks first) are the two clear ways. */
#chatbot button[aria-label="Clear"] { display: none !important; }
"""


THEME_CHOICES = ("System", "Light", "Dark")
_THEME_KEY = "fmoe-local-theme"

# (choice) → choice: applies "System" (the browser's prefers-color-scheme), "Light" or "Dark" and remembers it.
THEME_JS = f"""(choice) => {{
  const wanted = ["Light", "Dark"].includes(choice) ? choice : "System";
  try {{ localStorage.setItem("{_THEME_KEY}", wanted); }} catch (e) {{}}
  const dark = wanted === "Dark" || (wanted === "System" && matchMedia("(prefers-color-scheme: dark)").matches);
  document.body.classList.toggle("dark", dark);
  return wanted;
}}"""

# () → the remembered choice, applied; it also follows a change of the system's scheme while "System" is chosen (and
# keeps a chosen Light or Dark when Gradio's own listener would follow the system instead).
THEME_LOAD_JS = f"""() => {{
  let saved = "System";
  try {{ saved = localStorage.getItem("{_THEME_KEY}") || "System"; }} catch (e) {{}}
  const apply = {THEME_JS};
  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => {{
    let now = "System";
    try {{ now = localStorage.getItem("{_THEME_KEY}") || "System"; }} catch (e) {{}}
    apply(now);
  }});
  return apply(saved);
}}"""


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
