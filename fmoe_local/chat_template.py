"""A model's chat template rendered under a budget of time, memory and output, in a child process killed when over.

Scope: `render(template, messages, ...)` → the prompt text exactly as transformers' `apply_chat_template(...,
tokenize=False)` renders it (hf_internals.render_chat_template: the same sandboxed environment), or
TemplateOverBudget, a sentence, when the template runs longer than RENDER_BUDGET_S, needs more memory than
MEMORY_BUDGET_BYTES or writes far more than the conversation holds (`output_budget`). A template's own refusal
(`raise_exception`), and any other error it raises on a conversation (a TypeError on a message, transformers'
ValueError for a message it cannot continue), comes back as jinja2's TemplateError, a broken template as
TemplateSyntaxError. It does NOT tokenize (engine.py does, here) or decide that a model's template is
not used again (engine.py).

Why a child process: a chat template is code from the model's files. transformers renders it in jinja2's
ImmutableSandboxedEnvironment, which keeps it from the machine but not from running for ever or filling memory:
nested `range(100000)` loops spin for hours (every request hung, and Ctrl+C could not end the app), and `'x' *
10**10` allocates 10 GB in one step. Inside the app neither can be stopped reliably: a thread cannot be killed,
an exception sent into one (PyThreadState_SetAsyncExc) waits until the current step ends, and a sandbox that counts
loop iterations misses filters, string methods and concatenations that grow the output without a loop. A child
process is stopped whatever it is doing: it ends itself at the deadline (faulthandler's watchdog, a C thread that
needs no interpreter lock, so even a render stuck in one long step ends, and so does a render whose app was
killed), the app kills it shortly after in any case, and its memory is capped (RLIMIT_AS, where the system has
it). The cost: one small process (about 60 MB, without torch) started with the model, and a pipe round trip of
about a millisecond per render.

Threads: `render` may be called from any thread; renders run one at a time through one child per process,
started on first use (or by `prestart`) and again after one was stopped. The caller blocks on the child's reply;
a timer thread kills the child if it has not answered by the deadline, and is joined before `render` returns.
`stop` may be called from any thread, while a render waits: it kills the child without waiting for the render
(which holds `_lock` up to STARTUP_TIMEOUT_S or the budget), so the render raises at once and the next one starts a
fresh child. `_current` is replaced only under `_swap`, which `stop` takes too, so it never misses a child just
started. The child is the process's, not a Runtime's (every Runtime in the process renders through it): the
process's owner stops it as it ends (app.py), since an interpreter that is exiting first joins the thread pools whose
threads may be waiting on it, before any atexit handler could kill it.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from jinja2.exceptions import TemplateError, TemplateSyntaxError

# An honest template renders even a long conversation in milliseconds (it wraps each message in a few markers);
# 5 s leaves room for a slow, busy machine and stops a runaway one before a client gives up on the request.
RENDER_BUDGET_S = 5.0
# Above what the child needs idle. A conversation of 16 MB (the largest request body, ui/body_limit.py) renders to
# a few tens of MB; a template that needs more than this is building something no prompt holds.
MEMORY_BUDGET_BYTES = 1 << 30
STARTUP_TIMEOUT_S = 120.0  # importing transformers' template code, on a slow disk and a busy machine
_GRACE_S = 5.0  # the app's own deadline after the child's: the child ends itself first, this is the backstop


class TemplateOverBudget(RuntimeError):
    """The model's chat template ran over its budget of time, memory or output and was stopped; the message is a
    sentence naming the model and what to do. The model's fault, not the request's."""


def output_budget(messages: list[dict], variables: dict) -> int:
    """The most characters a template may write for these messages: four times what they and the template's
    variables hold, plus 1 MiB for a preamble (a date, a default system prompt). Templates wrap each message in a
    few markers; none we know writes a message more than twice. Values that are not text (a message's tool calls,
    the request's tools) count as their JSON."""

    def size(value: object) -> int:
        return len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False, default=str))

    held = sum(size(v) for m in messages for v in m.values() if v is not None)
    held += sum(size(v) for v in variables.values() if v is not None)
    return 4 * held + (1 << 20)


def render(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool | str,
    variables: dict,
    model: str,
    budget_s: float | None = None,
) -> str:
    """The prompt text; `variables`: the tokenizer's special tokens (bos_token…) as the template reads them;
    `model`: the model as a sentence names it. Raises TemplateOverBudget (a sentence), TemplateError or
    TemplateSyntaxError (the template's own), or RuntimeError (a sentence) when no child could be started."""
    budget_s = RENDER_BUDGET_S if budget_s is None else budget_s
    max_chars = output_budget(messages, variables)
    request = {
        "template": template,
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "variables": variables,
        "budget_s": budget_s,
        "max_chars": max_chars,
    }
    with _lock:
        child = _child()
        child.wait_ready()
        started = time.monotonic()
        reply = child.ask(request, budget_s + _GRACE_S)
        took = time.monotonic() - started
        if reply is None or reply.get("error") == "memory":  # gone, or left short of memory: a fresh one next time
            _stop_child()
    if reply is None and child.stopped:
        raise RuntimeError(_STOPPED)
    if reply is None:  # ended by its own deadline or the app's, or by the memory cap where an allocation aborts
        if took >= budget_s:
            raise TemplateOverBudget(_sentence(model, f"ran for more than {budget_s:g} s on this conversation"))
        limit = f"{MEMORY_BUDGET_BYTES >> 20:,} MB"
        raise TemplateOverBudget(
            _sentence(model, f"crashed on this conversation (it may use at most {limit} of memory)")
        )
    if "text" in reply:
        return reply["text"]
    kind, message = reply.get("error"), reply.get("message", "")
    if kind == "output":
        raise TemplateOverBudget(_sentence(model, f"wrote more than {max_chars:,} characters for this conversation"))
    if kind == "memory":
        raise TemplateOverBudget(_sentence(model, f"needed more than {MEMORY_BUDGET_BYTES >> 20:,} MB of memory"))
    if kind == "syntax":
        raise TemplateSyntaxError(message, lineno=int(reply.get("lineno") or 0))
    # The template's own refusal (raise_exception), a message it cannot read, or any other error it raised on this
    # conversation (a TypeError on a message's content, transformers' ValueError for a message it cannot continue):
    # a template that renders other conversations fails on this one's messages, which the request must change.
    raise TemplateError(message)


def _sentence(model: str, what: str) -> str:
    return (
        f"The chat template of {model} was stopped: it {what}, which no working template does. It will not be "
        "used again while this model is loaded. Load another model, or replace chat_template.jinja in the "
        "model's folder with the one its publisher ships, and load it again."
    )


def stop(for_good: bool = False) -> None:
    """Kill the child now, whatever it is doing: a render waiting on it raises RuntimeError (a sentence) at once,
    the next render starts a fresh child — or, `for_good` (a process that is ending), raises the same sentence at once
    instead: a request that reaches its render only after the app began to close would otherwise start a child and
    hold the exit until that child's deadline. For the process's owner as it ends."""
    global _closed
    with _swap:
        _closed = _closed or for_good
        if _current is not None:
            _current.stopped = True
            _current.kill()


_STOPPED = "The chat template renderer was stopped (the app is closing) before it answered. Send the message again."


def prestart() -> None:
    """Start the child now (without waiting for it), so that the first reply does not wait for its start-up."""
    with _lock:
        _child()


# ---- the app's side -----------------------------------------------------------------------------------------------

_lock = threading.Lock()  # one render at a time, through one child
_swap = threading.Lock()  # held only to replace `_current`, never while waiting on the child
_current: _Child | None = None
_closed = False  # set by stop(for_good=True): the process is ending, no child is started again


class _Child:
    def __init__(self) -> None:
        root = Path(__file__).resolve().parent.parent
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fmoe_local.chat_template"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self.ready = False
        self.stopped = False  # by `stop`: the reply it cut off is not the template's fault

    def wait_ready(self) -> None:
        """Block until the child has started (once); a RuntimeError (a sentence) if it could not."""
        if self.ready:
            return
        hello = self._exchange(None, STARTUP_TIMEOUT_S)
        if hello is None and self.stopped:
            raise RuntimeError(_STOPPED)
        if hello is None or not hello.get("ready"):
            said = (hello or {}).get("message", "it ended at once")
            raise RuntimeError(
                f"The chat template renderer could not start ({said}). Reinstall with the launcher's --repair."
            )
        self.ready = True

    def ask(self, request: dict, deadline_s: float) -> dict | None:
        """The child's reply, or None when it ended without one (killed at `deadline_s` at the latest)."""
        return self._exchange(request, deadline_s)

    def _exchange(self, request: dict | None, deadline_s: float) -> dict | None:
        timer = threading.Timer(deadline_s, self.kill)
        timer.name, timer.daemon = "fmoe-template-deadline", True
        timer.start()
        try:
            if request is not None:
                self.proc.stdin.write(_line(request))
                self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except OSError:  # the child is gone (killed, or ended by its own deadline)
            line = b""
        finally:
            timer.cancel()
            timer.join()
        try:
            return _parse(line) if line else None
        except ValueError:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        self.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def _child() -> _Child:
    global _current
    if _closed:
        raise RuntimeError(_STOPPED)
    if _current is None or _current.stopped or _current.proc.poll() is not None:
        if _current is not None:
            _current.close()
        with _swap:
            _current = _Child()
    return _current


def _stop_child() -> None:
    global _current
    if _current is not None:
        _current.close()
        with _swap:
            _current = None


@atexit.register
def _at_exit() -> None:
    if _current is not None:
        _current.kill()


# ---- the child's side ---------------------------------------------------------------------------------------------


def _serve() -> None:
    """Answer render requests from stdin, one JSON line each, until stdin closes (the app ended or let go)."""
    import faulthandler
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C in the app's terminal is the app's to handle
    devnull = open(os.devnull, "w")  # noqa: SIM115 - faulthandler writes here until the process ends
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")  # the replies' own channel: nothing else may write to it,
    os.dup2(devnull.fileno(), sys.stdout.fileno())  # so whatever prints to stdout goes nowhere instead
    try:
        from fmoe_local.hf_internals import render_chat_template

        # Before "ready", not in the first request's budget: the first render imports transformers' template code,
        # seconds on a busy machine, which stopped an honest template and disabled it for the session.
        render_chat_template("{{ messages[0].content }}", [{"role": "user", "content": ""}], False, False, {})
    except Exception as exc:  # noqa: BLE001 - told to the app, which says it in a sentence
        out.write(json.dumps({"ready": False, "message": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
        out.flush()
        return
    _cap_memory()
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        request = _parse(line)
        faulthandler.dump_traceback_later(request["budget_s"], exit=True, file=devnull)  # ends this process
        try:
            text = render_chat_template(
                request["template"],
                request["messages"],
                request["add_generation_prompt"],
                request["continue_final_message"],
                request["variables"],
            )
            reply = {"error": "output"} if len(text) > request["max_chars"] else {"text": text}
            del text
        except BaseException as exc:  # noqa: BLE001 - every failure is the template's, reported by its kind
            reply = {"error": _kind(exc), "message": f"{type(exc).__name__}: {exc}"[:2000]}
            if isinstance(exc, TemplateError):
                reply["message"], reply["lineno"] = str(exc)[:2000], getattr(exc, "lineno", 0)
        faulthandler.cancel_dump_traceback_later()
        out.write(_line(reply))
        out.flush()
        if reply.get("error") == "memory":
            return  # the app starts a fresh child: this one may be too short of memory to go on


def _line(value: dict) -> bytes:
    """One JSON line in UTF-8 (JSON escapes every line break inside a string); "surrogatepass": text that is not
    valid Unicode (half a character) crosses the pipe as it is, for the tokenizer to judge, not this pipe."""
    return json.dumps(value, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass") + b"\n"


def _parse(line: bytes) -> dict:
    return json.loads(line.decode("utf-8", "surrogatepass"))


def _kind(exc: BaseException) -> str:
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, TemplateSyntaxError):
        return "syntax"
    return "template"


def _cap_memory() -> None:
    """RLIMIT_AS at what the child uses now plus MEMORY_BUDGET_BYTES, where the system enforces it (Linux; macOS
    and Windows keep the time and output budgets only)."""
    try:
        import resource

        with open("/proc/self/statm") as statm:
            used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = used + MEMORY_BUDGET_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    except (ImportError, OSError, ValueError):
        pass


if __name__ == "__main__":
    _serve()
