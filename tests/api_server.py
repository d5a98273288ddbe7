"""The real app (`app.serve`) on a tiny model for the /v1 tests: served on a port the OS picked (tests/ports.py), with
a Mixtral-Instruct-strict chat template when asked, and an openai client that never retries; or with no model and a
scripted runtime put in its place (`serving_script`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import app
from tests.ports import unused_port

# Mixtral-8x7B-Instruct-v0.1's rule (a catalog model): roles must alternate after one optional system message.
STRICT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set loop_messages = messages[1:] %}{%- else %}"
    "{%- set loop_messages = messages %}{%- endif %}{{ bos_token }}{%- for m in loop_messages %}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('After the optional system "
    "message, conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "[INST]{{ m['content'] }}[/INST]{%- endfor %}"
)


@contextmanager
def serving(model: Path, data: Path, strict_template: bool = False, template: str | None = None) -> Iterator[tuple]:
    """(server, session, openai client) with `model` loaded; a copy of it gets the strict template, or `template`.
    The server's address is `server.url`."""
    import openai

    if strict_template or template is not None:
        copy = data.parent / f"{data.name}-model" / ("mixtral-strict" if strict_template else "templated")
        shutil.copytree(model, copy)
        (copy / "chat_template.jinja").write_text(STRICT_TEMPLATE if strict_template else template)
        model = copy
    args = ["--no-browser", "--data-dir", str(data), "--port", str(unused_port()), "--model", str(model)]
    server, session, url = app.serve(app.build_parser().parse_args(args))
    try:
        assert session.loading.finished.wait(120) and session.runtime is not None  # loaded on a thread of its own
        yield server, session, openai.OpenAI(base_url=f"{url}v1", api_key="anything", max_retries=0, timeout=120)
    finally:
        server.close()
        session.close()
        session.store.close()


@contextmanager
def serving_script(runtime: object, data: Path) -> Iterator[tuple]:
    """The real app with no model loaded (a --model that is none: nothing loads, not even the demo model), then
    `runtime` (a scripted stand-in) as its runtime; (openai client, anthropic client)."""
    import anthropic
    import openai

    args = ["--no-browser", "--data-dir", str(data), "--port", str(unused_port()), "--model", str(data / "none")]
    server, session, url = app.serve(app.build_parser().parse_args(args))
    assert session.runtime is None and session.loading is None, "a model is loading: it would replace the script"
    session.runtime = runtime
    try:
        yield (
            openai.OpenAI(base_url=f"{url}v1", api_key="x", max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=url.rstrip("/"), api_key="x", max_retries=0, timeout=120),
        )
    finally:
        session.runtime = None
        server.close()
        session.close()
        session.store.close()
