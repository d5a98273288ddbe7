"""Expert maps on disk: a model fingerprint, and SqliteMapPersistence (the runtime's MapPersistence over SQLite).

Scope: rows of (fingerprint, slot, probs, semantic, request_id, created, next_slot), a fast `load()`, and a
background writer that commits `put`s and `put_link`s in batches. It does NOT match, deduplicate, choose slots or
decide links: the runtime's MapStore does, and slot numbers are the identity here, so a map replaced in memory is
replaced on disk. `put` keeps the slot's link (next_slot, the successor link; NULL: none), as the store does.

On disk probs [L, J] and semantic [h] are float16 (half the bytes; gate probabilities and embeddings keep ~3
significant digits, far below what changes a cosine ranking); `load()` returns float32.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from store.db import StoreDb

if TYPE_CHECKING:
    from fmoe_local.maps import ExpertMap

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX_SUFFIX = ".index.json"


class MapShape(Protocol):
    """What the store needs of fmoe_local.policies.base.ModelShape."""

    num_layers: int
    num_experts: int
    embed_dim: int


def model_fingerprint(model_dir: str | Path) -> str:
    """Identify a checkpoint: its config.json, weights index files, and weight file names and sizes.

    Copying or moving a model keeps its fingerprint (no paths or mtimes); a different model, a different
    quantisation or re-sharded weights get a new one, so maps recorded on one are never served to another.
    """
    root = Path(model_dir)
    config = root / "config.json"
    if not config.is_file():
        raise ValueError(f"{root} has no config.json. Point to the folder of a Hugging Face checkpoint.")
    h = hashlib.sha256()
    h.update(b"config.json\0" + config.read_bytes() + b"\0")
    for path in sorted(root.iterdir()):
        if path.name.endswith(INDEX_SUFFIX):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        elif path.suffix in WEIGHT_SUFFIXES and path.is_file():
            h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class WriterStatus:
    pending: int  # puts, links and clears not yet committed
    written: int  # rows committed since start
    batches: int  # transactions committed
    failed: int  # puts lost to errors (disk full, read-only file)
    last_error: str | None


_CLEAR = object()
_STOP = object()
_FLUSH = object()  # ends the writer's linger so a waiting flush() returns at once


@dataclass(frozen=True)
class _Replace:
    """Everything of this model replaced in one transaction: rows as `put` queues them, then the links."""

    rows: tuple
    links: tuple


@dataclass(frozen=True)
class _Link:
    slot: int
    next_slot: int


class SqliteMapPersistence:
    """MapPersistence for one model. `put` only enqueues; a daemon thread commits what is queued, at once.

    Loss on a kill: with `linger_s` 0 (the default) each map is committed as soon as the writer has it, and maps
    arriving during a commit go in the next one, so a kill -9 (or a crash) loses at most the maps not committed yet:
    the one being written and any that arrived within that commit (~0.3 ms). It costs 0.14–0.20 ms of writer CPU per map
    over 0.2 s batches (docs/bench.md, "Map writer"); a power cut can lose more (synchronous=NORMAL, store/db.py).

    Call `close()` when the model is unloaded (it drains the queue first); `flush()` waits for what was put.
    """

    def __init__(
        self,
        store_db: StoreDb,
        fingerprint: str,
        shape: MapShape,
        name: str = "",
        batch_size: int = 512,
        linger_s: float = 0.0,
    ) -> None:
        self._store_db = store_db
        self.fingerprint = fingerprint
        self.num_layers, self.num_experts = int(shape.num_layers), int(shape.num_experts)
        self.embed_dim = int(shape.embed_dim)
        self._batch_size, self._linger_s = batch_size, linger_s
        self._register(name)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # Counters under a condition so flush() can wait for "everything put so far" without queue.join's
        # risk of waiting forever on a dead thread.
        self._cond = threading.Condition()
        self._enqueued = self._done = self._written = self._batches = self._failed = 0
        self._last_error: str | None = None
        self._closed = self._dead = False
        self._thread = threading.Thread(target=self._run, name=f"map-writer-{fingerprint[:8]}", daemon=True)
        self._thread.start()

    # --- MapPersistence -------------------------------------------------------------------------------------

    def load(self) -> list[tuple[int, ExpertMap, int]]:
        """Every stored map of this model, by slot, with its successor link (−1: none); pending writes are flushed
        first; arrays are float32."""
        from fmoe_local.maps import ExpertMap

        self.flush()
        L, J, h = self.num_layers, self.num_experts, self.embed_dim
        where = "fingerprint = ? AND length(probs) = ?"  # a blob of another shape is not decoded
        args = [self.fingerprint, L * J * 2]
        out: list[tuple[int, ExpertMap, int]] = []
        with self._store_db.lock, self._store_db.db.atomic():  # one snapshot for the counts and the rows
            db = self._store_db.db
            n = db.execute(f"SELECT count(*) FROM maps WHERE {where}", args).fetchone()[0]
            n_sem = 0
            if h > 0:
                n_sem = db.execute(f"SELECT count(*) FROM maps WHERE {where} AND length(semantic) = ?", [*args, h * 2])
                n_sem = n_sem.fetchone()[0]
            # Decoded chunk by chunk into preallocated float32 arrays: fetching everything first would hold a
            # second copy of every blob (hundreds of MB at 32K maps with embeddings).
            probs = np.empty((n, L, J), np.float32)
            sems = np.empty((n_sem, h), np.float32)
            cursor = db.execute(
                f"SELECT slot, probs, semantic, request_id, next_slot FROM maps WHERE {where} ORDER BY slot", args
            )
            k = 0
            while chunk := cursor.fetchmany(1024):
                for slot, probs_blob, sem_blob, request_id, next_slot in chunk:
                    i = len(out)
                    probs[i] = np.frombuffer(probs_blob, np.float16).reshape(L, J)
                    semantic = None
                    if h > 0 and sem_blob is not None and len(sem_blob) == h * 2:
                        sems[k] = np.frombuffer(sem_blob, np.float16)
                        semantic, k = sems[k], k + 1
                    m = ExpertMap(probs=probs[i], semantic=semantic, request_id=int(request_id))
                    out.append((int(slot), m, -1 if next_slot is None else int(next_slot)))
        return out

    def put(self, slot: int, expert_map: ExpertMap) -> None:
        """Queue `expert_map` for `slot` (replacing what the slot held). Never waits for the disk."""
        if self._closed:
            raise RuntimeError("This map persistence is closed; open a new one for the model.")
        item = self._row(slot, expert_map)
        with self._cond:
            self._enqueued += 1
        self._queue.put(item)

    def _row(self, slot: int, expert_map: ExpertMap) -> tuple:
        # Copied now: the caller may reuse its buffers before the writer runs.
        probs = np.array(expert_map.probs, dtype=np.float16).reshape(self.num_layers, self.num_experts)
        semantic = None
        if expert_map.semantic is not None and self.embed_dim > 0:
            semantic = np.array(expert_map.semantic, dtype=np.float16).reshape(self.embed_dim)
        return (int(slot), probs, semantic, int(expert_map.request_id), time.time())

    def put_link(self, slot: int, next_slot: int) -> None:
        """Queue the successor link of `slot` (a stored map): `next_slot` was stored right after it. Never waits."""
        if self._closed:
            raise RuntimeError("This map persistence is closed; open a new one for the model.")
        self._enqueue(_Link(int(slot), int(next_slot)))

    def replace_all(self, entries: list[tuple[int, ExpertMap, int]]) -> None:
        """Queue: every map of this model becomes `entries` (slot, map, next_slot or −1), in one transaction, so a
        kill leaves the old set or the new one, never a mix. Never waits for the disk."""
        if self._closed:
            raise RuntimeError("This map persistence is closed; open a new one for the model.")
        rows = tuple(self._row(slot, m) for slot, m, _ in entries)
        links = tuple(_Link(int(slot), int(nxt)) for slot, _, nxt in entries if nxt >= 0)
        self._enqueue(_Replace(rows, links))

    def clear(self) -> None:
        """Delete every map of this model, after whatever was put before and before what is put next.

        Queued like a put (MapStore calls it under its lock); `flush()` waits for it to reach the disk.
        """
        self._enqueue(_CLEAR)

    # --- lifecycle ------------------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything put so far is committed (or failed). False on timeout or a dead writer."""
        with self._cond:
            idle = self._done >= self._enqueued
        if not idle and not self._closed:
            self._enqueue(_FLUSH)
        with self._cond:
            target = self._enqueued
            return self._cond.wait_for(lambda: self._done >= target or self._dead, timeout) and (self._done >= target)

    def close(self, timeout: float | None = 30.0) -> None:
        """Drain the queue, then stop the writer. Safe to call twice."""
        if self._closed:
            return
        self._enqueue(_STOP)
        self._closed = True
        self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def status(self) -> WriterStatus:
        with self._cond:
            return WriterStatus(
                self._enqueued - self._done, self._written, self._batches, self._failed, self._last_error
            )

    def count(self) -> int:
        """Maps of this model on disk, once what was queued so far is written."""
        self.flush()
        with self._store_db.lock:
            return self._store_db.db.execute(
                "SELECT count(*) FROM maps WHERE fingerprint = ?", [self.fingerprint]
            ).fetchone()[0]

    # --- internals ------------------------------------------------------------------------------------------

    def _register(self, name: str) -> None:
        shape = {"num_layers": self.num_layers, "num_experts": self.num_experts, "embed_dim": self.embed_dim}
        with self._store_db.lock:
            db = self._store_db.db
            row = db.execute(
                "SELECT num_layers, num_experts, embed_dim FROM models WHERE fingerprint = ?", [self.fingerprint]
            ).fetchone()
            with db.atomic():
                if row is not None and tuple(row) != tuple(shape.values()):
                    # Same checkpoint, other shape: only a runtime change of what a map holds can do this, and
                    # such maps cannot be decoded; they are a cache, so they are dropped rather than misread.
                    log.warning("dropping maps of %s: shape %s, now %s", self.fingerprint, tuple(row), shape)
                    db.execute("DELETE FROM maps WHERE fingerprint = ?", [self.fingerprint])
                if row is None:
                    db["models"].insert(
                        {"fingerprint": self.fingerprint, "name": name, **shape, "created": time.time()}
                    )
                else:
                    db["models"].update(self.fingerprint, {"name": name, **shape} if name else shape)

    def _enqueue(self, item: object) -> None:
        with self._cond:
            self._enqueued += 1
        self._queue.put(item)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # flush() must not wait for a writer that is gone
            log.error("expert map writer stopped: %s", exc)
            with self._cond:
                self._last_error = f"{type(exc).__name__}: {exc}"
        finally:
            with self._cond:
                self._dead = True
                self._cond.notify_all()

    def _loop(self) -> None:
        db = self._store_db.connect()
        try:
            stop = False
            while not stop:
                batch = [self._queue.get()]
                deadline = time.monotonic() + self._linger_s
                while len(batch) < self._batch_size and batch[-1] is not _STOP and batch[-1] is not _FLUSH:
                    try:
                        batch.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                    except queue.Empty:
                        break
                stop = batch[-1] is _STOP
                self._commit(db, batch)
        finally:
            db.conn.close()

    def _commit(self, db, batch: list) -> None:
        # Within a batch a later put (or link) to a slot wins; a clear drops what was queued before it. Links are
        # applied after the puts: a link joins stored maps, so its slot's put came before it (this batch or one
        # earlier), and a put leaves a slot's link as it was.
        cleared = False
        pending: dict[int, tuple] = {}
        links: dict[int, int] = {}
        for item in batch:
            if item is _CLEAR or isinstance(item, _Replace):
                pending.clear()
                links.clear()
                cleared = True
                if isinstance(item, _Replace):  # one queue item, so always within this one transaction
                    pending.update((row[0], row) for row in item.rows)
                    links.update((link.slot, link.next_slot) for link in item.links)
            elif isinstance(item, tuple):
                pending[item[0]] = item
            elif isinstance(item, _Link):
                links[item.slot] = item.next_slot
        rows = [
            (self.fingerprint, s, p.tobytes(), None if e is None else e.tobytes(), r, t)
            for s, p, e, r, t in pending.values()
        ]
        error = None
        try:
            with db.atomic():
                if cleared:
                    db.execute("DELETE FROM maps WHERE fingerprint = ?", [self.fingerprint])
                db.conn.executemany(
                    "INSERT INTO maps (fingerprint, slot, probs, semantic, request_id, created) "
                    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (fingerprint, slot) DO UPDATE SET probs = excluded.probs, "
                    "semantic = excluded.semantic, request_id = excluded.request_id, created = excluded.created",
                    rows,
                )
                db.conn.executemany(
                    "UPDATE maps SET next_slot = ? WHERE fingerprint = ? AND slot = ?",
                    [(n, self.fingerprint, s) for s, n in links.items()],
                )
        except Exception as exc:  # disk full, read-only file: the app keeps running on its in-memory maps
            error = f"{type(exc).__name__}: {exc}"
            log.error("expert maps not saved: %s", error)
        with self._cond:
            if error is None:
                self._written += len(rows)
                self._batches += 1
            else:
                self._failed += len(rows)
                self._last_error = error
            self._done += len(batch)
            self._cond.notify_all()


def list_models(store_db: StoreDb) -> list[dict]:
    """Models with stored maps (for a settings page): fingerprint, name, shape, map count."""
    with store_db.lock:
        rows = store_db.db.execute(
            "SELECT m.fingerprint, m.name, m.num_layers, m.num_experts, m.embed_dim, count(p.slot) "
            "FROM models m LEFT JOIN maps p ON p.fingerprint = m.fingerprint GROUP BY m.fingerprint ORDER BY m.name"
        ).fetchall()
    keys = ("fingerprint", "name", "num_layers", "num_experts", "embed_dim", "maps")
    return [dict(zip(keys, r, strict=True)) for r in rows]


def clear_model(store_db: StoreDb, fingerprint: str) -> int:
    """Delete the maps of a model that is not loaded; returns how many were deleted."""
    with store_db.writing():
        return store_db.db.execute("DELETE FROM maps WHERE fingerprint = ?", [fingerprint]).rowcount
