"""How long `python app.py` takes to start on a tiny model and to end after SIGTERM, and the CPU it spends.

`python tools/app_exit_time.py [--runs 3] [--app PATH]` builds a tiny Mixtral once (tests/tiny.py), then starts the
app `--runs` times on a fresh data folder each, waits until it serves and has loaded the model, sends SIGTERM and
prints one row per run: seconds to ready, seconds from SIGTERM to the "stopped" line and to the process's end, and
the user + sys CPU seconds of the app and its children. `--app` times another checkout's app.py (a before/after on
the same machine; run them alternately, the load moves). What the test suite pays for each app it starts.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one_run(app: Path, model: Path, data: Path) -> tuple[float, float, float, float]:
    from tests.ports import unused_port

    args = [sys.executable, str(app), "--no-browser", "--data-dir", str(data), "--port", str(unused_port())]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.Popen(
        [*args, "--model", str(model)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=app.parent
    )
    serving = loaded = False
    for line in proc.stdout:
        serving = serving or "serving on" in line
        loaded = loaded or line.startswith(("fmoe-local: Loaded ", "fmoe-local: Could not load "))
        if serving and loaded:
            break
    else:
        raise SystemExit("The app ended before it served; run it by hand to see why.")
    ready = time.monotonic() - start
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stopped = float("nan")
    for line in proc.stdout:
        if "fmoe-local: stopped" in line:
            stopped = time.monotonic() - signalled
    proc.wait()
    ended = time.monotonic() - signalled
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ready, stopped, ended, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--app", type=Path, default=ROOT / "app.py", help="the app.py to time (default: this one)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the test suite runs it (tests/conftest.py)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    with tempfile.TemporaryDirectory() as tmp:
        import torch

        from tests.tiny import build_tiny_model

        model = build_tiny_model("mixtral", Path(tmp) / "mixtral", dtype=torch.float32)
        print(f"app: {args.app}; load average at the start: {os.getloadavg()[0]:.2f}")
        print("| run | ready s | SIGTERM → stopped s | SIGTERM → exit s | CPU s (user + sys) |")
        print("|---|---|---|---|---|")
        for run in range(1, args.runs + 1):
            ready, stopped, ended, cpu = one_run(args.app.resolve(), model, Path(tmp) / f"data-{run}")
            print(f"| {run} | {ready:.1f} | {stopped:.2f} | {ended:.2f} | {cpu:.1f} |", flush=True)
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
