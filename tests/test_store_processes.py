"""The store across real processes: `fmoe-local run --store` twice (the second, a fresh process, predicts better from
the maps the first left on disk), and kill -9 in the middle of a generation (the database stays intact and the next
run works).

Slow: a run in a fresh Python imports torch and transformers and loads a tiny model. The side of each boundary that
needs no process of its own (the first run, whose maps reach the second only through the disk; the run after a kill)
runs `app.main` in this process.
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

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


def run_here(model: Path, store: Path, capsys: pytest.CaptureFixture[str], max_new_tokens: int = 24) -> dict:
    """The same command as `run_once`, through the same entry (`app.main`), in this process: where the other side of
    the process boundary is a separate process already, a second fresh Python (14–18 s of CPU) shows nothing more."""
    import app

    capsys.readouterr()
    assert app.main(cli(model, store, max_new_tokens)[2:]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]


def stored_slots(db_file: Path) -> set[int]:
    conn = sqlite3.connect(db_file, timeout=10)
    try:
        return {row[0] for row in conn.execute("SELECT slot FROM maps")}
    except sqlite3.OperationalError:  # not created yet
        return set()
    finally:
        conn.close()


def test_second_run_predicts_better_from_maps_on_disk(tiny_model_dir, tmp_path, capsys):
    model, db_file = tiny_model_dir("mixtral"), tmp_path / "maps.db"
    first = run_here(model, db_file, capsys)  # this process writes the maps; a fresh one reads them from the disk
    saved = stored_slots(db_file)
    assert len(saved) > 0  # the first run's maps reached the disk
    second = run_once(model, db_file)
    assert second["hits"] + second["misses"] == first["hits"] + first["misses"]  # same work, same prompt
    assert second["hit_rate"] > first["hit_rate"], (first["hit_rate"], second["hit_rate"])


def test_kill_9_mid_generation_leaves_a_sound_database(tiny_model_dir, tmp_path, capsys):
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
    stats = run_here(model, db_file, capsys)  # the next run works, on top of the surviving maps
    assert stats["tokens"] > 0
    assert stored_slots(db_file) >= after


REWRITER = """
import sys
from pathlib import Path

import numpy as np

from fmoe_local.maps import MapStore
from store import open_store
from tests.test_store_maps import SHAPE, fake_model, random_map

store = open_store(Path(sys.argv[1]))
persistence = store.map_persistence(fake_model(Path(sys.argv[2])), SHAPE)
maps = MapStore(SHAPE, capacity=700, prefetch_distance=1, persistence=persistence)
if maps.load_from() == 0:
    rng, prev = np.random.default_rng(0), -1
    for i in range(600):  # 150 requests of 4 maps: 450 successor links
        prev = maps.add(random_map(rng, i // 4), after=prev if i % 4 else -1)
    persistence.flush()
rounds = 0
while True:  # what a capacity change or a compacting load does: rewrite everything (600 > one 512-map batch)
    maps._rewrite_persistence()
    persistence.flush()
    rounds += 1
    print(rounds, flush=True)
"""


def _stored(db_file: Path) -> tuple[int, int]:
    conn = sqlite3.connect(db_file, timeout=10)
    try:
        maps, links = conn.execute("SELECT count(*), count(next_slot) FROM maps").fetchone()
        return maps, links
    finally:
        conn.close()


def test_kill_9_inside_a_map_store_rewrite_keeps_every_map_and_link(tmp_path):
    data, db_file = tmp_path / "data", tmp_path / "data" / "fmoe-local.db"
    data.mkdir()
    for kill_after in (2, 5, 9):  # three kills at different points of the rewrite loop
        child = subprocess.Popen(
            [sys.executable, "-c", REWRITER, str(data), str(tmp_path / "model")],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            for _ in range(kill_after):
                line = child.stdout.readline()
                assert line, child.stderr.read()[-2000:]
            time.sleep(0.003 * kill_after)  # somewhere inside the next rewrite
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()
            child.stderr.close()
        assert _stored(db_file) == (600, 450), f"after a kill in round {kill_after}"


WRITER = """
import sys, time
from pathlib import Path

import numpy as np

from store import open_store
from tests.test_store_maps import SHAPE, fake_model, random_map

store = open_store(Path(sys.argv[1]))
persistence = store.map_persistence(fake_model(Path(sys.argv[2])), SHAPE)
rng = np.random.default_rng(1)
for i in range(100_000):  # a fast decode: a map every 10 ms
    persistence.put(i, random_map(rng, i))
    print(i, flush=True)
    time.sleep(0.01)
"""


def test_kill_9_loses_at_most_the_maps_of_the_last_moments(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(data), str(tmp_path / "model")], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        last = -1
        while last < 150:
            line = child.stdout.readline()
            assert line, "the writer died before it was killed"
            last = int(line)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    kept = stored_slots(data / "fmoe-local.db")
    # Every map put at least 5 puts (~50 ms) before the kill is on disk (with 0.2 s batches up to ~20 were lost).
    assert set(range(last - 5)) <= kept, sorted(set(range(last - 5)) - kept)[:20]
