"""A model's chat template rendered under a budget (fmoe_local/chat_template.py): the same prompt as transformers'
apply_chat_template; a template that loops for ever, fills memory or writes without end is stopped with a sentence,
leaves nothing running, and is not used again while its model is loaded; the /v1 API answers it with that sentence
and stays responsive; Ctrl+C still ends an app whose model has such a template."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from fmoe_local import chat_template
from fmoe_local.chat_template import TemplateOverBudget
from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.runtime import Runtime
from tests import machine_verdicts
from tests.api_server import STRICT_TEMPLATE, serving
from tests.ports import unused_port

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
FLOODS = "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}"
FILLS = "{{ 'x' * 10000000000 }}"
CHATS = [
    [{"role": "user", "content": "Tell me about the sea."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ships?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And the sea?"},
    ],
    [{"role": "user", "content": "Tell me about the sea."}, {"role": "assistant", "content": "The sea is"}],
]


def _ids(tok, messages: list[dict]) -> list[int]:  # noqa: ANN001
    cont = messages[-1]["role"] == "assistant"
    text = chat_template.render(
        tok.get_chat_template(),
        messages,
        add_generation_prompt=not cont,
        continue_final_message=cont,
        variables=dict(tok.special_tokens_map),
        model="m",
    )
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("which", ["tiny", "strict", "demo"])
def test_the_prompt_is_the_one_apply_chat_template_makes(tiny_model_dir, which):
    from fmoe_local.demo import demo_model_dir

    tok = AutoTokenizer.from_pretrained(demo_model_dir() if which == "demo" else tiny_model_dir("mixtral"))
    chats = CHATS
    if which == "strict":
        tok.chat_template, chats = STRICT_TEMPLATE, [CHATS[0], CHATS[2]]
    for messages in chats:
        cont = messages[-1]["role"] == "assistant"
        expected = tok.apply_chat_template(
            messages, add_generation_prompt=not cont, continue_final_message=cont, tokenize=True, return_dict=False
        )
        assert _ids(tok, messages) == expected


def _render(template: str, budget_s: float | None = None) -> str:
    """The first chat rendered with `template` for a model named m, as a reply starts."""
    return chat_template.render(
        template,
        CHATS[0],
        add_generation_prompt=True,
        continue_final_message=False,
        variables={},
        model="m",
        budget_s=budget_s,
    )


def test_a_fresh_renderer_spends_no_render_budget_on_its_own_start_up():
    # Its first render used to import transformers' template code inside the budget: on a busy machine an honest
    # template ran "more than 5 s" and was disabled for the session. Half a second is ample for a render alone.
    chat_template._stop_child()
    text = _render("{{ messages[0].content }}", budget_s=0.5)
    assert text == CHATS[0][0]["content"]


@pytest.mark.parametrize(
    "template, said",
    [
        (LOOPS, "ran for more than 1 s"),  # was: every request hung, for hours
        (FLOODS, "wrote more than 1,048,"),
        pytest.param(
            FILLS,
            "needed more than 1,024 MB",
            marks=pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memory is capped on Linux"),
        ),
    ],
    ids=["loops", "floods", "fills-memory"],
)
def test_a_runaway_template_is_stopped_and_leaves_nothing_running(template, said):
    chat_template.prestart()
    chat_template._current.wait_ready()  # its start-up (imports, a first render) is not the render's budget
    child = chat_template._current.proc
    started = time.monotonic()
    with pytest.raises(TemplateOverBudget, match=f"The chat template of m was stopped: it {said}"):
        _render(template, budget_s=1.0)
    assert time.monotonic() - started < 1.0 + chat_template._GRACE_S
    if template is LOOPS:
        assert child.poll() is not None  # the process that ran it is gone, not spinning somewhere
    assert not [t for t in threading.enumerate() if t.name == "fmoe-template-deadline"]
    ok = _render("{{ messages[0].content }}")
    assert ok == CHATS[0][0]["content"]  # the next render works (a fresh child where the last one was stopped)


def test_stopping_the_renderer_ends_a_render_waiting_on_it_at_once(monkeypatch):
    chat_template.prestart()
    chat_template._current.wait_ready()
    asked = threading.Event()
    ask = chat_template._Child.ask

    def ask_and_tell(child: chat_template._Child, request: dict, deadline_s: float) -> dict | None:
        asked.set()
        return ask(child, request, deadline_s)

    monkeypatch.setattr(chat_template._Child, "ask", ask_and_tell)
    outcome = {}

    def rendering() -> None:
        try:
            outcome["text"] = _render(LOOPS, budget_s=60.0)
        except Exception as exc:  # noqa: BLE001 - the test reads which
            outcome["error"] = exc

    waiter = threading.Thread(target=rendering, daemon=True)
    waiter.start()
    assert asked.wait(30)
    chat_template.stop()
    waiter.join(10)  # was: the child's deadline, 60 s here (and the app's exit waited for it)
    assert not waiter.is_alive()
    assert isinstance(outcome.get("error"), RuntimeError), outcome
    assert not isinstance(outcome["error"], TemplateOverBudget)  # the app's stop, not the template's fault
    assert "renderer was stopped" in str(outcome["error"])
    ok = _render("{{ messages[0].content }}")
    assert ok == CHATS[0][0]["content"]  # a later render starts a fresh child


def _runaway_copy(model: Path, where: Path) -> Path:
    copy = where / "runaway-template"
    shutil.copytree(model, copy)
    (copy / "chat_template.jinja").write_text(LOOPS)
    return copy


def test_a_model_whose_template_ran_away_refuses_chats_at_once_and_still_continues_text(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(chat_template, "RENDER_BUDGET_S", 1.0)
    model = _runaway_copy(tiny_model_dir("mixtral"), tmp_path)
    with Runtime.load(model, RuntimeConfig(device="cpu")) as runtime:
        with pytest.raises(TemplateOverBudget, match="runaway-template was stopped: it ran for more than 1 s"):
            runtime.check(CHATS[0])
        started = time.monotonic()
        final = runtime.generate(CHATS[1], Sampling(greedy=True, max_new_tokens=2))
        assert final.reason == "error" and "was stopped" in final.error and "Load another model" in final.error
        assert time.monotonic() - started < 0.5  # not used again: no second wait of the whole budget
        text = runtime.generate("The sea", Sampling(greedy=True, max_new_tokens=2))  # no template: served
        assert text.reason in ("length", "stop"), text.error


def test_the_api_answers_a_runaway_template_with_the_sentence_and_stays_responsive(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(chat_template, "RENDER_BUDGET_S", 2.0)
    model = _runaway_copy(tiny_model_dir("mixtral"), tmp_path)
    with serving(model, tmp_path / "data") as (server, _, _):
        body = {"model": "x", "messages": CHATS[0], "max_tokens": 2}
        answers = {}
        asking = threading.Thread(
            target=lambda: answers.update(r=httpx.post(f"{server.url}v1/chat/completions", json=body, timeout=60))
        )
        asking.start()
        assert httpx.get(f"{server.url}v1/models", timeout=10).status_code == 200  # while the template runs
        asking.join(60)
        r = answers["r"]  # was: no answer, ever
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text[:200]
        assert "was stopped: it ran for more than 2 s" in r.json()["error"]["message"]
        started = time.monotonic()
        again = httpx.post(f"{server.url}v1/chat/completions", json=body | {"stream": True}, timeout=60)
        assert again.status_code == 500 and time.monotonic() - started < 1.0  # before a stream's 200, at once
        text = httpx.post(f"{server.url}v1/completions", json={"model": "x", "prompt": "The sea", "max_tokens": 2})
        assert text.status_code == 200, text.text[:200]


def _cpu_ticks(pid: int) -> int:
    """CPU time of a process and its children, in clock ticks (Linux /proc)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:  # fields[1]: the parent's pid
            total += int(fields[11]) + int(fields[12])
    return total


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")
def test_ctrl_c_ends_the_app_while_a_runaway_template_renders(tiny_model_dir, tmp_path):
    model = _runaway_copy(tiny_model_dir("mixtral"), tmp_path)
    root = Path(chat_template.__file__).resolve().parent.parent
    args = [sys.executable, str(root / "app.py"), "--no-browser", "--data-dir", str(tmp_path / "data")]
    port = unused_port()
    args += ["--port", str(port), "--model", str(model)]
    # On a hang, SIGABRT makes the app's faulthandler print every thread's stack: the failure says where it waited.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    machine_verdicts.seed(tmp_path / "data")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Loaded" in line or "Traceback" in line:
                break
        assert "Loaded" in lines[-1], "".join(lines)
        before = _cpu_ticks(proc.pid)
        body = {"model": "x", "messages": CHATS[0], "max_tokens": 2}
        asking = threading.Thread(
            target=lambda: httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120),
            daemon=True,
        )
        asking.start()
        deadline = time.monotonic() + 60
        while _cpu_ticks(proc.pid) - before < os.sysconf("SC_CLK_TCK") // 2:  # the template is spinning
            assert time.monotonic() < deadline, "the runaway template never ran"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)  # was: never (a thread rendering it for ever held the exit)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            stacks, _ = proc.communicate(timeout=30)
            raise AssertionError(f"the app did not end within 60 s of Ctrl+C; its threads:\n{stacks[-6000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "fmoe-local: stopped" in out, out[-2000:]
    machine_verdicts.keep(tmp_path / "data")


def test_a_render_after_the_app_stopped_the_renderer_for_good_starts_no_child(monkeypatch):
    monkeypatch.setattr(chat_template, "_closed", False)  # restored after: later tests render in this process
    chat_template.stop(for_good=True)
    started = []
    monkeypatch.setattr(chat_template, "_Child", lambda: started.append(1))  # was: a fresh child, held the exit
    with pytest.raises(RuntimeError, match="renderer was stopped"):
        _render("{{ messages[0].content }}")
    assert started == []
