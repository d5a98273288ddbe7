"""fmoe-local entry point: `python app.py` (or `fmoe-local` with no sub-command) starts the chat app.

    python app.py [--model DIR|REPO_ID] [--port N] [--no-browser] [--data-dir DIR] [--listen] [--api-key KEY]
                  [--allow-origin ORIGIN]

Scope: command line → store + Session (+ the model to load) → ui.build() → ui.server (guarded, on 127.0.0.1; the
next free port when the asked one is taken; `--listen` opts in to the local network, behind an access token made
here unless --api-key names one). Sub-commands (`run`, `bench`) go to fmoe_local.cli with a map-persistence
factory, since only this module may import store/, and the bench's commands (fmoe_bench.cli), since the runtime
never imports the benchmarks. It does NOT hold any UI or model logic itself.
"""

from __future__ import annotations

import os

# Before any import of gradio / huggingface_hub: no analytics, no telemetry, no Hub traffic unless the user
# starts a download (ui/downloads.py lifts HF_HUB_OFFLINE in its own child process only).
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

SUBCOMMANDS = ("run", "bench")
DEFAULT_PORT = 7860
PORT_TRIES = 50
LOOPBACK = "127.0.0.1"


def build_parser() -> argparse.ArgumentParser:
    from fmoe_local.cli_args import SentenceParser, port

    p = SentenceParser(
        prog="fmoe-local",
        description="Chat with Mixture-of-Experts models larger than your GPU, on this computer.",
        epilog="Sub-commands: `fmoe-local run --help`, `fmoe-local bench --help`.",
    )
    p.add_argument("--model", help="model folder, or the repo id of a downloaded model (default: the last one used)")
    p.add_argument(
        "--port", type=port, default=DEFAULT_PORT, help="port to serve on, 1 to 65535 (the next free one if taken)"
    )
    p.add_argument("--no-browser", action="store_true", help="do not open a browser window")
    p.add_argument("--data-dir", help="where chats, settings and models are kept (default: your user data folder)")
    p.add_argument(
        "--listen",
        action="store_true",
        help="serve on the local network too, to whoever has the access token printed at start",
    )
    p.add_argument(
        "--api-key",
        type=api_key,
        metavar="KEY",
        help="the access token to ask for (the page's login and the /v1 API's key), instead of a new one at every "
        "start; with it the app asks for the key without --listen too",
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        type=api_origin,
        metavar="ORIGIN",
        help="let a browser-based app at ORIGIN (e.g. app://obsidian.md, http://localhost:3000) call the /v1 API; "
        "repeat for more",
    )
    return p


def api_origin(text: str) -> str:
    """An origin exactly as a browser sends it (scheme://host[:port], nothing after); never every origin."""
    from urllib.parse import urlsplit

    origin = text.strip().rstrip("/")
    parts = urlsplit(origin)
    if origin in ("*", "null") or not parts.scheme or not parts.netloc or parts.path or parts.query:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not an origin: write it as the app's page sends it, scheme://host[:port] with nothing "
            "after (e.g. http://localhost:3000 or app://obsidian.md); '*' and 'null' are never granted."
        )
    return origin


def api_key(text: str) -> str:
    """A key the user chose for --api-key: long enough, and sendable as it is in a header, a cookie and an address."""
    from ui.http_auth import key_problem

    problem = key_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def access_token(args: argparse.Namespace) -> str | None:
    """What every request must carry: --api-key's, or with --listen a new one; None (no token asked) otherwise."""
    if args.api_key:
        return args.api_key
    if args.listen:
        from ui.http_auth import new_token

        return new_token()
    return None


def lan_address() -> str:
    """This computer's address on its network, for the printed address other computers open (a UDP connect sends
    nothing; it only picks the interface a packet would leave by). Its name when there is no network."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere, so nothing could answer anyway
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


def bind_host(listen: bool) -> str:
    """Loopback unless the user opted in to the network with --listen."""
    return "0.0.0.0" if listen else LOOPBACK


def free_port(host: str, start: int, tries: int = PORT_TRIES) -> int:
    """The first port from `start` that `host` can bind. Raises OSError with a sentence when none is free."""
    from fmoe_local.cli_args import MAX_PORT

    last = min(start + tries - 1, MAX_PORT)  # past 65535 bind() raises OverflowError, not OSError
    for port in range(start, last + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if os.name != "nt":
                # As uvicorn does: a port left in TIME_WAIT by a previous run is free; on Windows the same
                # flag would let two servers share a port, so it is not set there.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"Ports {start}–{last} are all taken. Start with --port and another number from 1 to {MAX_PORT}.")


def persistence_factory(store_path: Path, model_dir: Path):
    """For `fmoe-local run --store`: the model's MapPersistence and a callable that closes the store."""
    from store import StoreError, open_store
    from ui.load_job import shape_of

    try:
        store = open_store(store_path)
    except StoreError as exc:
        raise ValueError(str(exc)) from exc  # fmoe_local.cli prints ValueErrors as a sentence, not a traceback
    return store.map_persistence(model_dir, shape_of(model_dir)), store.close


def resolve_model(arg: str | None, models_dir: Path, last_model: str) -> tuple[Path | None, str]:
    """(folder to load or None, a sentence when something is off). Order: --model, last used, demo model."""
    if arg:
        path = Path(arg).expanduser()
        if path.is_dir():
            return path, ""
        from fmoe_local.catalog import local_name

        downloaded = models_dir / local_name(arg)
        if downloaded.is_dir():
            return downloaded, ""
        return None, f"'{arg}' is neither a model folder nor a downloaded model. Download it in the Models tab."
    if last_model and Path(last_model).is_dir():
        return Path(last_model), ""
    try:
        from fmoe_local.demo import demo_model_dir

        return Path(demo_model_dir()), ""
    except (ImportError, FileNotFoundError, OSError):
        return None, "No model is loaded yet. Download one in the Models tab."


def console_progress(what: str, out=print):
    """A progress callback for Runtime.load at start-up, before there is a page to show it on: a first int8/nf4
    load quantises for minutes, so the console says how far the copy got, every tenth of the way."""
    shown = [-1]

    def report(done: int, total: int) -> None:
        if not total:  # (0, 0): the copy was given up and the experts are quantised in memory (the load says why)
            out(f"fmoe-local: the {what} copy cannot be kept; quantising the experts in memory instead", flush=True)
            return
        tenth = done * 10 // total
        if tenth != shown[0]:
            shown[0] = tenth
            out(f"fmoe-local: making the {what} copy of the experts: {done} of {total} (first load only)", flush=True)

    return report


RUNNING_URL = "running-url.txt"  # in the data folder: the address of the instance that holds it


def announce(job) -> None:  # noqa: ANN001 - a ui.session.LoadJob
    """Print the start-up load's outcome on the console when it ends (tests and scripts wait for this line)."""
    job.finished.wait()
    print(f"fmoe-local: {job.error or job.message}", flush=True)


def answers(url: str, timeout_s: float = 3.0) -> bool:
    """Does something serve HTTP at `url` (any status counts)?"""
    import urllib.error
    import urllib.request

    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # our own address: never via a proxy
    try:
        with direct.open(url, timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def running_url_file(store) -> Path:  # noqa: ANN001 - a store.Store
    """Where the instance holding this data says where it serves (a second start opens that address)."""
    return Path(store.models_dir).parent / RUNNING_URL


def serve(args: argparse.Namespace):
    """Open the store, load the model, build and serve the UI. Returns (server, session, url); does not block."""
    from store import StoreError, StoreInUseError, open_store

    data_dir = None
    if args.data_dir:
        # A folder, always: the store would take a path that does not exist yet for a database file name.
        data_dir = Path(args.data_dir).expanduser()
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SystemExit(
                f"fmoe-local: cannot use {data_dir} as the data folder ({exc.strerror or exc}). Give --data-dir a "
                "folder you can write to (it is created if missing)."
            ) from exc
    try:
        store = open_store(data_dir)
    except StoreInUseError as exc:
        running = exc.db_path.parent / RUNNING_URL
        url = running.read_text(encoding="utf-8").strip() if running.is_file() else ""
        if not url:
            raise SystemExit(f"fmoe-local: {exc}") from exc
        if not answers(url):  # the holder is starting, stopping, or a command that does not serve a page
            raise SystemExit(
                f"fmoe-local: {exc} (It does not answer at {url}: it may still be starting or be stopping; wait a "
                "moment and start again.)"
            ) from exc
        # A second double-click while the app runs: show the running one instead of failing.
        opening = "" if args.no_browser else "; opening it in your browser"
        print(f"fmoe-local is already running at {url}{opening}.", flush=True)
        if not args.no_browser:
            import webbrowser

            webbrowser.open(url)
        raise SystemExit(0) from exc
    except StoreError as exc:  # too new, unwritable: each a sentence
        raise SystemExit(f"fmoe-local: {exc}") from exc
    if store.recovery is not None:
        print(
            f"fmoe-local: the database was damaged; it was moved to {store.recovery.moved_to}, kept as it was, and "
            f"{store.recovery.what_came_back()}."
        )
    from fmoe_local.config import RuntimeConfig
    from ui import build
    from ui.session import Session, format_name
    from ui.theme import CSS, theme

    # Quantised copies of experts live beside the models, in the same data folder (also under --data-dir).
    quantized = Path(store.models_dir).parent / "quantized"
    session = Session(store=store, config=RuntimeConfig(quant_cache_dir=str(quantized)))
    model_dir, note = resolve_model(args.model, session.models_dir, store.settings.load().last_model)
    if model_dir is not None:
        # On a thread of its own, so that the page opens at once: reading a big model takes minutes, which a silent
        # terminal makes look hung. The page's header says "Loading …" (and how far a first int8/nf4 copy got);
        # the console says so too, and prints the outcome (Loaded … / Could not load …) when it ends.
        what = format_name(session.load_format(model_dir))  # the model's own, else the last loaded one's
        print(f"fmoe-local: loading {model_dir.name} ({what}); the page says when it is ready.", flush=True)
        job = session.start_load(model_dir, progress=console_progress(what))
        threading.Thread(target=announce, args=(job,), name="fmoe-announce", daemon=True).start()
    else:
        session.load_error = note
        print(f"fmoe-local: {note}", flush=True)
    host = bind_host(args.listen)
    token = access_token(args)
    try:
        port = free_port(host, args.port)
    except OSError as exc:
        raise SystemExit(f"fmoe-local: {exc}") from exc
    demo = build(session)
    demo.queue(default_concurrency_limit=1)
    from ui.anthropic_api import build_router as build_messages_router
    from ui.openai_api import build_router
    from ui.server import Server

    api = build_router(session, others=(build_messages_router(session),))  # /v1: OpenAI's API and Anthropic's
    origins = tuple(args.allow_origin)
    if origins:
        print(f"fmoe-local: the /v1 API also answers browser pages from {', '.join(origins)}.", flush=True)
    server = Server(
        demo, host, port, args.listen, api, origins, token, theme=theme(), css=CSS, ssr_mode=False, footer_links=[]
    )
    url = server.start()
    # For a second start on the same data, which finds it in use: it opens this address instead of failing. Never
    # the token: the page there asks for it.
    running_url_file(store).write_text(url, encoding="utf-8")
    session.api_base = f"{url}v1"
    session.api_key_required = token is not None
    print(f"fmoe-local: serving on {url}", flush=True)
    opened = url
    if token is not None:
        from urllib.parse import quote

        opened = f"{url}?token={quote(token, safe='')}"
        where = f"http://{lan_address()}:{port}/?token={quote(token, safe='')}" if args.listen else opened
        print(
            f"fmoe-local: every request needs the access token {token} — open {where} (this computer: {opened}); "
            "API clients send it as their API key. Anyone with the token can read your chats.",
            flush=True,
        )
    if not args.no_browser:
        import webbrowser

        webbrowser.open(opened)
    return server, session, url


def stop_on_signals() -> threading.Event:
    """Ctrl+C (SIGINT), closing the launcher's terminal (SIGHUP) or a system shutdown (SIGTERM) end the app through
    main's `finally`, which saves what is in flight (a streaming reply, queued expert maps) and closes the database.
    Without a handler SIGTERM and SIGHUP end the process at once, and Ctrl+C's KeyboardInterrupt lands wherever the
    main thread is: during start-up, outside main's `try`, where it was lost and the app then served on with no one
    to stop it (the Ctrl+C test hung so under load). The handler only sets the returned event (main's wait looks at
    it), so a signal during start-up is acted on once start-up is done; a second Ctrl+C raises KeyboardInterrupt as
    usual, for a start-up that does not end. Main thread only."""
    stopping = threading.Event()

    def leave(signum: int, frame: object) -> None:
        stopping.set()
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        if hasattr(signal, name):  # Windows has no SIGHUP
            signal.signal(getattr(signal, name), leave)
    return stopping


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        from fmoe_bench import cli as bench_cli
        from fmoe_local import cli

        return cli.main(argv, persistence_factory=persistence_factory, extra=(bench_cli,))
    args = build_parser().parse_args(argv)
    stopping = stop_on_signals()  # before serving: "serving on" may be the last line a terminal shows before it closes
    server, session, _ = serve(args)
    try:
        server.wait(until=stopping)
    except KeyboardInterrupt:
        pass
    finally:
        from fmoe_local import chat_template

        running_url_file(session.store).unlink(missing_ok=True)  # a later start must not send anyone there
        server.close()
        # A request may still be waiting on the template renderer in a pool thread, which the exiting interpreter
        # joins: stopped now, it answers at once instead of at its deadline (up to STARTUP_TIMEOUT_S).
        chat_template.stop(for_good=True)
        session.close()
        session.store.close()
        print("fmoe-local: stopped (chats and expert maps saved).", flush=True)
    return 0


def entry() -> None:
    """The process's entry point (`python app.py`, the `fmoe-local` command): `main`, then exit with its code."""
    code = main()
    # Everything is saved and closed by now. Left to itself the exiting interpreter runs a last full collection
    # over torch's, transformers' and gradio's objects: 3-4 s of CPU before the process ends, after the "stopped"
    # line (docs/bench.md, "Test suite time"). Frozen objects are skipped; the OS frees the memory anyway.
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
