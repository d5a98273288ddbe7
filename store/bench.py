"""Benchmark of the expert-map store: write throughput through the background writer, and load time of many maps.

Scope: a script (`python -m store.bench [--maps N ...] [--dir DIR]`) that prints a table. It is NOT a test: it
asserts nothing and its figures depend on the machine and its disk.

Counts: 1000 (the default store capacity C) and 32768 (a stress size). Shapes: Mixtral-8x7B (32 MoE layers × 8 experts, hidden 4096) and Qwen1.5-MoE-A2.7B (24 × 60, hidden 2048),
each with and without the semantic embedding ([h] float16 on disk), which dominates the bytes when present.
Load is reported as wall time and as this process's CPU time: on a shared machine the first includes waiting for
a core, the second does not.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from fmoe_local.maps import ExpertMap
from fmoe_local.policies.base import ModelShape
from store import open_store
from store.maps import SqliteMapPersistence

SHAPES = {
    "mixtral-8x7b": ModelShape(num_layers=32, num_experts=8, top_k=2, embed_dim=4096),
    "qwen1.5-moe-a2.7b": ModelShape(num_layers=24, num_experts=60, top_k=4, embed_dim=2048),
}


def _maps(shape: ModelShape, count: int, semantic: bool, seed: int = 0, pool: int = 256) -> list[ExpertMap]:
    # A pool of distinct maps reused round-robin: generating 32K random embeddings would time numpy, not SQLite.
    rng = np.random.default_rng(seed)
    out = []
    for i in range(min(count, pool)):
        logits = rng.normal(size=(shape.num_layers, shape.num_experts)).astype(np.float32)
        probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        sem = rng.normal(size=shape.embed_dim).astype(np.float32) if semantic else None
        out.append(ExpertMap(probs=probs, semantic=sem, request_id=i))
    return out


def bench_shape(root: Path, name: str, shape: ModelShape, count: int, semantic: bool) -> dict:
    path = root / f"{name}-{'sem' if semantic else 'nosem'}-{count}.db"
    pool = _maps(shape, count, semantic)
    with open_store(path) as store:
        persistence = SqliteMapPersistence(store.db, f"bench-{name}", shape, name=name)
        put_s = []
        start = time.perf_counter()
        for slot in range(count):
            t = time.perf_counter()
            persistence.put(slot, pool[slot % len(pool)])
            put_s.append(time.perf_counter() - t)
        persistence.flush()
        write_s = time.perf_counter() - start
        batches = persistence.status().batches
        persistence.close()
    size_mb = path.stat().st_size / 1e6
    start = time.perf_counter()
    store = open_store(path)  # includes quick_check of the whole file
    open_s = time.perf_counter() - start
    with store:
        persistence = SqliteMapPersistence(store.db, f"bench-{name}", shape, name=name)
        start, cpu = time.perf_counter(), time.process_time()
        loaded = persistence.load()
        load_s, load_cpu_s = time.perf_counter() - start, time.process_time() - cpu
        assert len(loaded) == count
        persistence.close()
    put_us = np.array(put_s) * 1e6
    return {
        "shape": f"{name} {shape.num_layers}x{shape.num_experts}" + (f" h={shape.embed_dim}" if semantic else ""),
        "maps": count,
        "db_mb": size_mb,
        "write_maps_s": count / write_s,
        "write_mb_s": size_mb / write_s,
        "batches": batches,
        "put_us_mean": float(put_us.mean()),
        "put_us_p99": float(np.percentile(put_us, 99)),
        "open_s": open_s,
        "load_s": load_s,
        "load_cpu_s": load_cpu_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--maps", type=int, nargs="+", default=[1000, 32768], help="map counts per shape (default: 1000 32768)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where to put the databases (default: a temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = [
            bench_shape(Path(tmp), name, shape, count, semantic)
            for name, shape in SHAPES.items()
            for semantic in (False, True)
            for count in args.maps
        ]
    header = (
        f"{'shape':<38}{'maps':>7}{'DB MB':>8}{'write maps/s':>14}{'write MB/s':>12}{'batches':>9}"
        f"{'put µs mean/p99':>17}{'open s':>8}{'load s':>8}{'load CPU s':>12}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['shape']:<38}{r['maps']:>7}{r['db_mb']:>8.1f}{r['write_maps_s']:>14.0f}{r['write_mb_s']:>12.1f}"
            f"{r['batches']:>9}{r['put_us_mean']:>9.1f}/{r['put_us_p99']:<7.1f}{r['open_s']:>8.3f}{r['load_s']:>8.3f}{r['load_cpu_s']:>12.3f}"
        )


if __name__ == "__main__":
    main()
