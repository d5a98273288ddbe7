"""ui/gradio_import.py: gradio, imported after the ui package, defines its components without rewriting their type
stubs, and works as before. It runs in a fresh interpreter: this one may have imported gradio already."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_gradio_imported_after_ui_skips_its_stubs_and_still_builds_a_page():
    out = run(
        "import ui, gradio as gr\n"
        "from gradio import component_meta\n"
        "from ui.gradio_import import _no_stubs\n"
        "print(component_meta.create_or_modify_pyi is _no_stubs)\n"
        "with gr.Blocks() as demo:\n"
        "    box = gr.Textbox(label='Question')\n"
        "    box.submit(lambda text: text, box, box)\n"
        "print(len(demo.config['dependencies']), demo.config['components'][0]['props']['label'])\n"
    )
    assert out.splitlines() == ["True", "1 Question"]
