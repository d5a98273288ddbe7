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

The dense linear weights a packed dense format packs (dense_formats.py) are kept in the folder of their format as one
more file, `dense.safetensors` (`DenseCopy`: keys `<module name>.<part>`, expert_formats' parts, as the experts'
layers hold them), written and renamed into place the same way. It is read only when it holds exactly the
modules, parts, shapes and dtypes the load would pack; absent, unreadable or different, the load packs them again
and writes the file over. Writing it is best effort: a file that cannot be written costs the next load the packing,
never this load. It lives and goes with the experts' copy (`copies`, `remove_copies`, `remove_other_copies`).

A CPU device keeps int4 codes in torch's CPU layout on disk (`CpuLayout`): converting them costs ≈ 1 s of CPU per
Mixtral expert (docs/bench.md), and the layout depends on torch's version and the CPU it dispatches for, so a file
holding it names its key in its metadata (`int4_layout`). The layout replaces the portable codes in the file (the
same bytes per weight, so the copy takes no more disk); a file holds one form only and is read only in it: a CPU
load converts a portable layer (made by a GPU load) and writes it over (where it cannot, it converts the layer's
experts as it reads them, as every load did before), and any load quantises again from the checkpoint a layer whose
layout is another key's (torch updated, the folder moved to another machine) or that a load without a layout (a GPU)
cannot read. `dense.safetensors` (made on a CPU device only) holds int4 in the layout
of the key it names, and is packed again under any other.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
DENSE_FILE = "dense.safetensors"  # DenseCopy's file, beside the experts' layer files
LAYOUT = "int4_layout"  # metadata: the CpuLayout key of a file's int4 codes; absent: expert_formats' portable codes
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


def copy_dir(root: str | Path | None, model_dir: Path, fmt: str, dtype: torch.dtype) -> Path:
    """The folder of the copy of the checkpoint in `model_dir` in `fmt` and compute `dtype`."""
    base = Path(root) if root is not None else default_root()
    return base / f"{fingerprint(model_dir)}-{fmt}-{str(dtype).removeprefix('torch.')}"


def _remove_leftovers(folder: Path) -> None:
    """Delete what a write killed mid-file left in `folder` (never read: only whole files are renamed into place)."""
    if not folder.is_dir():
        return
    for pattern in _LEFTOVERS:
        for stale in folder.glob(pattern):
            if stale.is_file() and not stale.is_symlink():
                stale.unlink(missing_ok=True)


def _write_whole(final: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write `tensors` as the safetensors file `final`: under a temporary name, renamed into place once on disk."""
    partial = final.with_name(final.name + _TMP)
    try:
        save_file(tensors, str(partial), metadata=metadata)
        with open(partial, "rb") as f:
            os.fsync(f.fileno())  # the rename must never publish bytes still in flight
        os.replace(partial, final)
    except (OSError, SafetensorError):
        partial.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class CpuLayout:
    """The form a CPU device keeps int4 codes in: `key`, what torch's CPU layout depends on
    (dtype_verdicts.torch_cpu_key), and `convert`, one expert's stored tensors from portable codes into it."""

    key: str
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class QuantCache:
    """The quantised copy of one checkpoint in one format and compute dtype; with `layout`, int4 codes are kept and
    read in that CPU layout (the module's docstring)."""

    def __init__(
        self,
        root: str | Path | None,
        model_dir: Path,
        fmt: str,
        dtype: torch.dtype,
        num_layers: int,
        layout: CpuLayout | None = None,
    ) -> None:
        self.fmt = fmt
        self.dir = copy_dir(root, model_dir, fmt, dtype)
        self.num_layers = num_layers
        self.layout = layout
        self.quantised_layers = 0  # how many layers this load quantised (0: everything came from the copy)
        self.converted_layers = 0  # how many portable layers this load put in `layout` and wrote over
        self._portable: set[int] = set()  # layers left portable though `layout` is kept: `read` converts them
        self.reported = False  # progress was reported: a build that stops must say so, or the count just freezes
        self._handles: dict[int, SafetensorsFile] = {}
        self._lock = threading.Lock()

    def layer_path(self, layer: int) -> Path:
        return self.dir / f"layer-{layer:04d}.safetensors"

    def missing_layers(self) -> list[int]:
        """Layers without a readable file in a form this load reads or converts (such a file is removed, so the
        layer is quantised again)."""
        return [layer for layer in range(self.num_layers) if self._state(layer) == "missing"]

    def _state(self, layer: int) -> str:
        """The layer file's state: "ok" (read as it is), "convert" (portable codes, this load keeps `layout`), or
        "missing"."""
        path = self.layer_path(layer)
        if not path.exists():
            return "missing"
        try:
            file = SafetensorsFile(path)  # the header and the file's length are checked
        except OSError:
            path.unlink(missing_ok=True)
            return "missing"
        held = file.metadata.get(LAYOUT)
        file.close()
        if held == (self.layout.key if self.layout is not None else None):
            return "ok"
        if held is None:
            return "convert"
        path.unlink(missing_ok=True)  # another key's layout (or one this load cannot read): never converted back
        return "missing"

    def build(self, fetch: Fetch, num_experts: int, expert_bytes: int, progress: Progress | None = None) -> None:
        """Quantise the layers not in the copy yet (`fetch(layer, expert)` gives one expert's stored tensors,
        `expert_bytes` their size), then, when the copy keeps a `layout`, write its portable layers over in it.
        Raises CopyNotKept (an OSError) when the copy does not fit with the margin to spare (nothing is written) or
        cannot be written."""
        _remove_leftovers(self.dir)
        states = [self._state(layer) for layer in range(self.num_layers)]
        missing = [layer for layer, state in enumerate(states) if state == "missing"]
        convert = [layer for layer, state in enumerate(states) if state == "convert"]
        if not missing and not convert:
            return
        layer_bytes = num_experts * expert_bytes
        if missing:
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
        done = (self.num_layers - len(missing) - len(convert)) * num_experts
        if progress is not None:
            progress(done, total)
            self.reported = True
        for step, layer in enumerate(missing):
            tensors = {}
            for e in range(num_experts):
                tensors.update(self._stored(fetch(layer, e), e))
                done += 1
                if progress is not None:
                    progress(done, total)
            try:
                self._write(layer, tensors)
            except (OSError, SafetensorError) as exc:  # safetensors' own type for its I/O errors (disk full)
                raise self._write_failed(exc, (len(missing) - step) * layer_bytes, layer_bytes) from exc
            self.quantised_layers += 1
            log.info("quantised MoE layer %d (%d/%d) into %s", layer, step + 1, len(missing), self.dir)
        for layer in convert:
            self._convert(layer, num_experts, layer_bytes)
            done += num_experts
            if progress is not None:
                progress(done, total)
        log.info("quantised %d and converted %d layers in %.1f s", len(missing), len(convert), time.perf_counter() - t0)

    def _stored(self, rows: dict[str, torch.Tensor], expert: int) -> dict[str, torch.Tensor]:
        """One expert's tensors as its layer file holds them: in `layout` when this copy keeps one."""
        if self.layout is not None:
            rows = self.layout.convert(rows)
        return {f"{expert}.{key}": t.contiguous() for key, t in rows.items()}

    def _convert(self, layer: int, num_experts: int, layer_bytes: int) -> None:
        """Write a portable layer over in `layout`. Best effort: a layer that cannot be (no room with the margin to
        spare, a write that fails) stays portable, and `read` converts its experts at every load, as before."""
        try:
            if hardware.disk_free_bytes(self.dir) < layer_bytes + hardware.DISK_MARGIN_BYTES:
                raise OSError(errno.ENOSPC, f"not {layer_bytes / hardware.GB:.1f} GB free beside the margin")
            file = SafetensorsFile(self.layer_path(layer))
            try:
                tensors = {}
                for e in range(num_experts):
                    tensors.update(self._stored(_expert(file, e), e))
            finally:
                file.close()  # before the converted layer is renamed over it (Windows refuses an open one)
            self._write(layer, tensors)
            self.converted_layers += 1
        except (OSError, SafetensorError) as exc:
            log.warning("Layer %d in %s stays portable (%s); every load converts it.", layer, self.dir, _reason(exc))
            self._portable.add(layer)

    def _write(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        layout = {LAYOUT: self.layout.key} if self.layout is not None else {}
        _write_whole(self.layer_path(layer), tensors, {"format": "pt", **layout})

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
        """One expert's stored tensors from the copy (positioned reads, as from the checkpoint), in `layout` when
        the copy keeps one. Called after `build`, which alone changes which layers are left portable."""
        with self._lock:
            handle = self._handles.get(layer)
            if handle is None:
                handle = self._handles[layer] = SafetensorsFile(self.layer_path(layer))
        rows = {key: handle.get(f"{expert}.{key}") for key in keys}
        return self.layout.convert(rows) if self.layout is not None and layer in self._portable else rows

    def close(self) -> None:
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()


def _expert(file: SafetensorsFile, expert: int) -> dict[str, torch.Tensor]:
    """One expert's stored tensors from a layer file (keys `<expert>.<stored key>`)."""
    prefix = f"{expert}."
    return {key.removeprefix(prefix): file.get(key) for key in file.keys() if key.startswith(prefix)}


Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]  # {key: (shape, dtype)} a DenseCopy must hold


class DenseCopy:
    """The packed dense linear weights (dense_formats.py) of one checkpoint in one dense format and compute dtype:
    `dense.safetensors` in that copy's folder, int4 codes in the CPU layout `layout_key` names
    (dtype_verdicts.torch_cpu_key; None for int8). Used by the loading thread only, one load at a time."""

    def __init__(
        self, root: str | Path | None, model_dir: Path, fmt: str, dtype: torch.dtype, layout_key: str | None = None
    ) -> None:
        self.fmt = fmt
        self.layout_key = layout_key
        self.path = copy_dir(root, model_dir, fmt, dtype) / DENSE_FILE

    def open(self, expected: Expected) -> SafetensorsFile | None:
        """The file, open (the caller closes it), when it holds exactly `expected` in this format; None when it is
        absent, unreadable or holds anything else — then the caller packs the weights and `write`s over it."""
        if not self.path.is_file():
            return None
        try:
            file = SafetensorsFile(self.path)  # the header, and the file's length against it, are checked
        except Exception as exc:  # noqa: BLE001 - a damaged header can fail in any way; the load packs instead
            log.warning("The packed dense weights in %s cannot be read (%s); packing them again.", self.path, exc)
            return None
        try:
            held = {key: (file.shape(key), file.dtype(key)) for key in file.keys()}
            same = file.metadata.get("dense_format") == self.fmt and file.metadata.get(LAYOUT) == self.layout_key
            same = same and held == {key: (tuple(shape), dtype) for key, (shape, dtype) in expected.items()}
        except Exception:  # noqa: BLE001 - metadata of another type than the format's str → str
            same = False
        if not same:
            file.close()
            log.warning("The packed dense weights in %s are not this model's; packing them again.", self.path)
            return None
        return file

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `tensors` ({module name.part: part}, int4 codes in the CPU layout of `layout_key`) as the file,
        renamed into place whole. A write that fails, or that would leave less than hardware.DISK_MARGIN_BYTES free,
        is logged and skipped (as is the empty folder it made): the next load packs again."""
        folder = self.path.parent
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        try:
            free = hardware.disk_free_bytes(folder)
            if free < size + hardware.DISK_MARGIN_BYTES:
                log.warning(
                    "The packed dense weights (%.1f GB) are not kept: %s has %.1f GB free. "
                    "Later loads pack them again.",
                    size / hardware.GB,
                    hardware.volume_of(folder),
                    free / hardware.GB,
                )
                return
            folder.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(folder)
            metadata = {"format": "pt", "dense_format": self.fmt}
            if self.layout_key is not None:
                metadata[LAYOUT] = self.layout_key
            _write_whole(self.path, {k: t.contiguous() for k, t in tensors.items()}, metadata)
        except (OSError, SafetensorError) as exc:
            log.warning(
                "The packed dense weights could not be kept in %s (%s). Later loads pack them again.", folder, exc
            )
            with contextlib.suppress(OSError):
                folder.rmdir()  # the folder this write made, when nothing else is in it: no empty copy is listed

    def discard(self) -> None:
        """Remove the file (it failed while being read): the next load writes it again."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:  # the next load reads it, fails the same way, and packs again
            log.warning("Could not remove %s (%s).", self.path, exc)
