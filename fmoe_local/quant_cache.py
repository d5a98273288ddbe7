"""The quantise-on-load cache: a model's experts quantised once (int8, int4 or nf4) into the user data folder, and read
from there on every later load.

Scope: where a copy lives (`<root>/<fingerprint>-<format>-<dtype>/`, the fingerprint covering config.json, the
weights index and every weight file's name, size and modification time, so a changed checkpoint or another
format gets a copy of its own), building it layer by layer, and reading one expert back. It does NOT decide the
format (loading.py) or hold experts in RAM (packed_host.py).

One file per MoE layer (`layer-0003.safetensors`, keys `<expert>.<stored key>`), each written to a temporary name
and renamed into place only when complete, so a build that is killed or runs out of disk leaves whole layers and no
half-written one: the next load keeps those layers and quantises the rest (resumes) — unless the disk filled up, when
the finished layers go too, so that a failed first load never leaves the disk full. A build first checks that the
copy fits with `hardware.DISK_MARGIN_BYTES` to spare, and writes nothing when it does not. Leftover temporary files are
removed then: ours (`.partial`) and the ones safetensors writes through before its own rename (`.tmpXXXXXX`, left
by a build killed inside `save_file`); only this module writes in a copy's folder.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from fmoe_local import hardware
from fmoe_local.expert_formats import NAMES
from fmoe_local.safetensors_file import SafetensorsFile

log = logging.getLogger(__name__)

VERSION = 1  # of the stored layout: a change makes every earlier copy unused (a new folder name)
_TMP = ".partial"
_COPY_NAME = re.compile(r"[0-9a-f]{24}-[a-z0-9]+-[a-z0-9]+")  # QuantCache's folder: fingerprint, format, dtype
_LEFTOVERS = (f"*{_TMP}", ".tmp*")  # ours, and safetensors' own temporary name (tempfile in the target's folder)
Fetch = Callable[[int, int], dict[str, torch.Tensor]]
# (experts in the copy so far, experts in the whole copy), after every expert quantised: a resumed build starts at
# the experts of the layers it kept, so a user sees it continue rather than start over.
Progress = Callable[[int, int], None]
_WINDOWS_DISK_FULL = {39, 112}  # ERROR_HANDLE_DISK_FULL, ERROR_DISK_FULL: what Rust reports there for a full disk


class CopyNotKept(OSError):
    """The copy cannot be kept: `why` (a clause) and `advice` (what the user can do: free space on a named drive, or
    choose bf16), for the caller's sentence about what it did instead."""

    def __init__(self, why: str, advice: str) -> None:
        super().__init__(f"{why}: {advice}")
        self.why, self.advice = why, advice


def _reason(exc: Exception) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _out_of_space(exc: Exception) -> bool:
    """A write refused for lack of space. SafetensorError carries no errno, only Rust's "(os error N)" text."""
    codes = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
    if isinstance(exc, OSError):
        return exc.errno in codes
    return any(f"(os error {code})" in str(exc) for code in codes | _WINDOWS_DISK_FULL)


def default_root() -> Path:
    """`quantized/` in the per-OS user data folder (where the app keeps its database and models)."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("fmoe-local", appauthor=False)) / "quantized"


def fingerprint(model_dir: Path) -> str:
    """Identify a checkpoint's exact files: config.json and index contents, weight names, sizes and mtimes."""
    h = hashlib.sha256(f"v{VERSION}\0".encode())
    for path in sorted(Path(model_dir).iterdir()):
        if path.name == "config.json" or path.name.endswith(".index.json"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        elif path.suffix == ".safetensors" and path.is_file():
            st = path.stat()
            h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:24]


def remove_copies(root: str | Path | None, model_dir: Path) -> int:
    """Delete every quantised copy of the checkpoint in `model_dir` (any format; call before the checkpoint goes:
    the name comes from its files); returns the bytes freed. Only `<fingerprint>-…` folders inside `root`, which
    this module made, are touched. Why: a copy is gigabytes, and a re-downloaded checkpoint (new file times) never
    reads it again."""
    prefix = f"{fingerprint(model_dir)}-"
    return _remove([c for c in copies(root) if c.name.startswith(prefix)])


def copies(root: str | Path | None) -> list[Path]:
    """Every quantised copy in `root`: the `<fingerprint>-<format>-<dtype>` folders this module made."""
    base = Path(root) if root is not None else default_root()
    if not base.is_dir():
        return []
    return sorted(c for c in base.iterdir() if c.is_dir() and not c.is_symlink() and _COPY_NAME.fullmatch(c.name))


def copies_bytes(root: str | Path | None) -> int:
    return sum(_size(c) for c in copies(root))


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def remove_other_copies(root: str | Path | None, keep: Path | None) -> int:
    """Delete every quantised copy but those of the checkpoint in `keep` (the loaded model reads its own); returns
    the bytes freed. Why: copies of models loaded from a folder, or of a checkpoint downloaded again (new file
    times), are never read again, and only this app knows they are there. Each is made again on its next load."""
    prefix = f"{fingerprint(keep)}-" if keep is not None and keep.is_dir() else None
    return _remove([c for c in copies(root) if prefix is None or not c.name.startswith(prefix)])


def _remove(folders: list[Path]) -> int:
    freed = 0
    for copy in folders:
        freed += _size(copy)
        shutil.rmtree(copy)
    return freed


class QuantCache:
    """The quantised copy of one checkpoint in one format and compute dtype."""

    def __init__(self, root: str | Path | None, model_dir: Path, fmt: str, dtype: torch.dtype, num_layers: int) -> None:
        name = f"{fingerprint(model_dir)}-{fmt}-{str(dtype).removeprefix('torch.')}"
        self.fmt = fmt
        self.dir = Path(root) if root is not None else default_root()
        self.dir = self.dir / name
        self.num_layers = num_layers
        self.quantised_layers = 0  # how many layers this load quantised (0: everything came from the copy)
        self.reported = False  # progress was reported: a build that stops must say so, or the count just freezes
        self._handles: dict[int, SafetensorsFile] = {}
        self._lock = threading.Lock()

    def layer_path(self, layer: int) -> Path:
        return self.dir / f"layer-{layer:04d}.safetensors"

    def missing_layers(self) -> list[int]:
        """Layers without a readable file (a damaged one is removed, so it is quantised again)."""
        missing = []
        for layer in range(self.num_layers):
            path = self.layer_path(layer)
            if not path.exists():
                missing.append(layer)
                continue
            try:
                SafetensorsFile(path).close()  # the header and the file's length are checked
            except OSError:
                path.unlink(missing_ok=True)
                missing.append(layer)
        return missing

    def build(self, fetch: Fetch, num_experts: int, expert_bytes: int, progress: Progress | None = None) -> None:
        """Quantise the layers not in the copy yet (`fetch(layer, expert)` gives one expert's stored tensors,
        `expert_bytes` their size). Raises CopyNotKept (an OSError) when the copy does not fit with the margin to
        spare (nothing is written) or cannot be written."""
        self._remove_leftovers()
        missing = self.missing_layers()
        if not missing:
            return
        layer_bytes = num_experts * expert_bytes
        try:
            free = hardware.disk_free_bytes(self.dir)
        except OSError as exc:
            raise self._unwritable(exc) from exc
        if free < len(missing) * layer_bytes + hardware.DISK_MARGIN_BYTES:
            raise self._no_room(len(missing) * layer_bytes, free, whole=len(missing) == self.num_layers)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._unwritable(exc) from exc
        t0 = time.perf_counter()
        total = self.num_layers * num_experts
        done = (self.num_layers - len(missing)) * num_experts
        if progress is not None:
            progress(done, total)
            self.reported = True
        for step, layer in enumerate(missing):
            tensors = {}
            for e in range(num_experts):
                tensors.update({f"{e}.{key}": t.contiguous() for key, t in fetch(layer, e).items()})
                done += 1
                if progress is not None:
                    progress(done, total)
            try:
                self._write(layer, tensors)
            except (OSError, SafetensorError) as exc:  # safetensors' own type for its I/O errors (disk full)
                raise self._write_failed(exc, (len(missing) - step) * layer_bytes, layer_bytes) from exc
            self.quantised_layers += 1
            log.info("quantised MoE layer %d (%d/%d) into %s", layer, step + 1, len(missing), self.dir)
        log.info("quantised %d layers in %.1f s", len(missing), time.perf_counter() - t0)

    def _remove_leftovers(self) -> None:
        """Delete what a build killed mid-file left (a layer's size each time, never read)."""
        if not self.dir.is_dir():
            return
        for pattern in _LEFTOVERS:
            for stale in self.dir.glob(pattern):
                if stale.is_file() and not stale.is_symlink():
                    stale.unlink(missing_ok=True)

    def _write(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        final = self.layer_path(layer)
        partial = final.with_name(final.name + _TMP)
        try:
            save_file(tensors, str(partial), metadata={"format": "pt"})
            with open(partial, "rb") as f:
                os.fsync(f.fileno())  # the rename must never publish bytes still in flight
            os.replace(partial, final)
        except (OSError, SafetensorError):
            partial.unlink(missing_ok=True)
            raise

    def _write_failed(self, exc: Exception, rest_bytes: int, layer_bytes: int) -> CopyNotKept:
        log.warning("could not write the quantised copy to %s: %s", self.dir, exc)
        free = hardware.disk_free_bytes(self.dir)
        if free < hardware.DISK_MARGIN_BYTES:
            # The disk is full: the finished layers go too. Kept, they would only help a later load once the user
            # freed space, while a full disk breaks the system and every other program now; quantising them again
            # costs minutes.
            shutil.rmtree(self.dir, ignore_errors=True)
            return self._no_room(self.num_layers * layer_bytes, hardware.disk_free_bytes(self.dir), whole=True)
        if free < rest_bytes + hardware.DISK_MARGIN_BYTES:
            return self._no_room(rest_bytes, free, whole=False)  # the finished layers stay: the next load resumes
        if _out_of_space(exc):  # refused for space while the volume reports room: a quota, or no inodes left
            volume = hardware.volume_of(self.dir)
            return CopyNotKept(
                f"The {NAMES[self.fmt]} copy of the experts could not be kept: {volume} refused more data "
                f"({_reason(exc)}) with {free / hardware.GB:.1f} GB free",
                f"free space for this user on {volume}, or choose expert format bf16.",
            )
        return self._unwritable(exc)

    def _no_room(self, need: int, free: int, whole: bool) -> CopyNotKept:
        volume, gb = hardware.volume_of(self.dir), hardware.GB
        short = max(math.ceil((need + hardware.DISK_MARGIN_BYTES - free) / gb * 10) / 10, 0.1)  # room may come back
        size = f"{need / gb:.1f} GB" + ("" if whole else " left to write")
        return CopyNotKept(
            f"The {NAMES[self.fmt]} copy of the experts ({size}) could not be kept: {volume} has {free / gb:.1f} GB "
            "free",
            f"free {short:.1f} GB on {volume} (the copy and {hardware.DISK_MARGIN_BYTES / gb:.0f} GB kept free), "
            "or choose expert format bf16.",
        )

    def _unwritable(self, exc: Exception) -> CopyNotKept:
        return CopyNotKept(
            f"The {NAMES[self.fmt]} copy of the experts could not be written to {self.dir} ({_reason(exc)})",
            f"let the app write to {self.dir.parent}, or choose expert format bf16.",
        )

    def read(self, layer: int, expert: int, keys: list[str]) -> dict[str, torch.Tensor]:
        """One expert's stored tensors from the copy (positioned reads, as from the checkpoint)."""
        with self._lock:
            handle = self._handles.get(layer)
            if handle is None:
                handle = self._handles[layer] = SafetensorsFile(self.layer_path(layer))
        return {key: handle.get(f"{expert}.{key}") for key in keys}

    def close(self) -> None:
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()
