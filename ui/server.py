"""The app's HTTP server: one port, the guard outermost, the Gradio UI mounted at /, served by uvicorn on a thread.

Scope: building the ASGI app around the Blocks (http_guard.LocalOnlyGuard, then http_auth.TokenGate when a token is
set, the budget on every request body (body_limit.py), a CORS policy that grants nothing, the upload size limit)
and running it until `close()`. It does NOT build the UI (ui.build), choose the port or make the token (app.py).

Why not `Blocks.launch`: launch builds its own app and puts Gradio's CORS middleware outermost, which grants any
origin whenever the Host is not a localhost name — the DNS-rebinding case. Mounted in our app, our guard sees
every request first, and Gradio stands its CORS handling down because the parent configures CORS.

Threads: `start`, `wait` and `close` belong to the thread that built the server (app.py's main thread).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import gradio as gr
import uvicorn
from fastapi import APIRouter, FastAPI
from starlette.middleware.cors import CORSMiddleware

from ui.body_limit import BodyLimit
from ui.http_auth import TokenGate, cookie_name
from ui.http_guard import LocalOnlyGuard, machine_names

# The UI uploads nothing; Gradio's upload route exists anyway, so keep what it could take small.
MAX_UPLOAD = "5mb"
# How long a stop waits for requests still open before uvicorn cancels them. An open page keeps one for good (its
# heartbeat stream): without a limit uvicorn waited for it, close() gave up after its 10 s join, and the stop ran
# neither uvicorn's nor Gradio's shutdown (Gradio's deletes its cached copies of the files the page offered).
SHUTDOWN_GRACE_S = 2


class _QuietStop(logging.Filter):
    """Once the server stops, uvicorn logs each request it cancels (a page's heartbeat) as an error with a traceback:
    the expected end of an open page, not a failure, so those records are dropped; everything else passes."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.stopping:
            return True
        if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
            return False
        return "timeout graceful shutdown exceeded" not in record.getMessage()


class Server:
    def __init__(
        self,
        demo: gr.Blocks,
        host: str,
        port: int,
        listen: bool = False,
        api: APIRouter | None = None,
        api_origins: tuple[str, ...] = (),
        token: str | None = None,
        **ui_options: object,
    ) -> None:
        """`api`: routes served beside the UI (the /v1 API); `api_origins`: browser origins the user granted the API
        (--allow-origin; http_guard.py); `token`: the access token every request must carry (--listen, --api-key;
        http_auth.py), None for none; `ui_options`: what Blocks.launch would take for the page (theme, css,
        footer_links, ssr_mode…)."""
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        self.api = api
        if api is not None:
            app.include_router(api)  # before the mount at /, which would otherwise take every path
        app.add_middleware(CORSMiddleware, allow_origins=[])  # no origin is ever granted; Gradio's CORS stands down
        app.add_middleware(BodyLimit)  # inside the token gate: the body of a refused caller is never read
        app.add_middleware(TokenGate, token=token, cookie=cookie_name(port))  # inside the guard: its rule comes first
        names = machine_names() if listen else ()
        app.add_middleware(LocalOnlyGuard, listen=listen, names=names, api_origins=api_origins)  # outermost
        gr.mount_gradio_app(app, demo, path="/", max_file_size=MAX_UPLOAD, show_error=True, **ui_options)
        self.app = app
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '127.0.0.1') else host}:{port}/"
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=SHUTDOWN_GRACE_S
        )
        self._quiet = _QuietStop()  # added after Config, which configures uvicorn's loggers
        logging.getLogger("uvicorn.error").addFilter(self._quiet)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="fmoe-http", daemon=True)

    def start(self, timeout: float = 60.0) -> str:
        """Serve in the background; returns the URL once the port accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"The web server did not start on {self.url}. Start with --port and another number.")
            time.sleep(0.05)
        return self.url

    def wait(self, until: threading.Event | None = None) -> None:
        """Block until the server stops or `until` is set (Ctrl+C raises KeyboardInterrupt here)."""
        while self._thread.is_alive() and not (until is not None and until.is_set()):
            self._thread.join(0.5)

    def close(self) -> None:
        self._quiet.stopping = True
        self._server.should_exit = True
        self._thread.join(10)
        logging.getLogger("uvicorn.error").removeFilter(self._quiet)
