"""The store across real processes: `fmoe-local run --store` twice (the second predicts better from the first's
maps), and kill -9 in the middle of a generation (the database stays intact and the next run works).

Slow: each run is a fresh Python that imports torch and transformers and loads a tiny model.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store import open_store

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Tell me a story about the sea and the ships that sail on it"
# A cache of 4 expert slots for 4 layers × 8 experts: most accesses miss unless the prefetcher predicts them.
RUN_ARGS = ["--greedy", "--synchronous", "--device", "cpu", "--cache-experts", "4", "--policy", "fmoe"]


def cli(model: Path, store: Path, max_new_tokens: int) -> list[str]:
    return [
        *[sys.executable, str(REPO / "app.py"), "run", "--model", str(model), "--prompt", PROMPT],
        *["--store", str(store), "--max-new-tokens", str(max_new_tokens), "--json", *RUN_ARGS],
    ]


def run_once(model: Path, store: Path, max_new_tokens: int = 24) -> dict:
    done = subprocess.run(cli(model, store, max_new_tokens), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["stats"]


def stored_slots(db_file: Path) -> set[int]:
    conn = sqlite3.connect(db_file, timeout=10)
    try:
        return {row[0] for row in conn.execute("SELECT slot FROM maps")}
    except sqlite3.OperationalError:  # not created yet
        return set()
    finally:
        conn.close()


def test_second_run_predicts_better_from_maps_on_disk(tiny_model_dir, tmp_path):
    model, db_file = tiny_model_dir("mixtral"), tmp_path / "maps.db"
    first = run_once(model, db_file)
    saved = stored_slots(db_file)
    assert len(saved) > 0  # the first run's maps reached the disk
    second = run_once(model, db_file)
    assert second["hits"] + second["misses"] == first["hits"] + first["misses"]  # same work, same prompt
    assert second["hit_rate"] > first["hit_rate"], (first["hit_rate"], second["hit_rate"])


def test_kill_9_mid_generation_leaves_a_sound_database(tiny_model_dir, tmp_path):
    model, db_file = tiny_model_dir("mixtral"), tmp_path / "maps.db"
    proc = subprocess.Popen(
        cli(model, db_file, max_new_tokens=5000), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 540
        seen: set[int] = set()
        while len(seen) < 8:  # the writer has committed several batches of this generation
            assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no expert maps reached the database in time"
            time.sleep(0.2)
            seen = stored_slots(db_file)
        time.sleep(0.5)  # kill it while it is still writing
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    conn = sqlite3.connect(db_file)
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    conn.close()
    after = stored_slots(db_file)
    assert seen <= after  # every map committed before the kill is still there
    with open_store(db_file) as store:  # no stale lock, nothing to recover
        assert store.recovered_from is None
    stats = run_once(model, db_file)  # the next run works, on top of the surviving maps
    assert stats["tokens"] > 0
    assert stored_slots(db_file) >= after
