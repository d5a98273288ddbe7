"""One safetensors file read with plain positioned reads (pread) into memory we own, never memory-mapped.

Scope: the header (tensor name → dtype, shape, byte range), whole tensors, and single rows along dim 0. It does NOT
know about models or experts (host.py and loading.py do).

Why not the safetensors library's `safe_open`: it memory-maps the file and its tensors keep pointing into the map,
so a file that shrinks while the app runs (a re-download, a full disk, another program) kills the whole process
with SIGBUS at the next touch — resident weights and "RAM" experts included. Read into our own buffers, the same
fault is an OSError or a short read, which the runtime turns into a sentence. Format: 8-byte little-endian header
length, a JSON header, then the raw little-endian data (https://huggingface.co/docs/safetensors).
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024**2  # the format's own limit


class DamagedFile(OSError):
    """The file is shorter than its header says, or its header is not safetensors."""


def _damaged(path: Path, what: str) -> DamagedFile:
    return DamagedFile(f"The model file {path.name} is damaged ({what}). Download the model again.")


class SafetensorsFile:
    """Thread-safe: reads are positioned (no shared file offset), the header is read once."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self._fd = self._file.fileno()
        # preadv reads at an offset without a shared file position; where the OS lacks it (Windows) a lock
        # serialises seek + readinto.
        self._lock = threading.Lock()
        try:
            size = os.fstat(self._fd).st_size
            head = self._pread(8, 0)
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise _damaged(self.path, "its header is cut off or not safetensors")
            try:
                header = json.loads(self._pread(n, 8))
            except ValueError as exc:
                raise _damaged(self.path, "its header is not valid JSON") from exc
            self._start = 8 + n
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
            for key, e in header.items():
                begin, end = e["data_offsets"]
                self._entries[key] = (e["dtype"], tuple(e["shape"]), begin, end)
                if self._start + end > size:
                    raise _damaged(self.path, f"it ends before tensor {key}")
        except BaseException:
            self._file.close()
            raise

    def keys(self) -> list[str]:
        return list(self._entries)

    def dtype_name(self, key: str) -> str:
        return self._entries[key][0]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def dtype(self, key: str) -> torch.dtype | None:
        """The tensor's torch dtype; None for one fmoe-local cannot read."""
        return _DTYPES.get(self._entries[key][0])

    def get(self, key: str) -> torch.Tensor:
        dtype_name, shape, begin, end = self._entries[key]
        return self._tensor(dtype_name, shape, self._start + begin, end - begin)

    def get_row(self, key: str, index: int) -> torch.Tensor:
        """Row `index` along dim 0, reading only its bytes."""
        dtype_name, shape, begin, end = self._entries[key]
        if not 0 <= index < shape[0]:
            raise IndexError(f"{key} has {shape[0]} rows; no row {index}.")
        row_bytes = (end - begin) // shape[0]
        return self._tensor(dtype_name, shape[1:], self._start + begin + index * row_bytes, row_bytes)

    def _tensor(self, dtype_name: str, shape: tuple[int, ...], offset: int, nbytes: int) -> torch.Tensor:
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise ValueError(f"{self.path.name} holds a {dtype_name} tensor, which fmoe-local cannot read.")
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes != expected:
            raise _damaged(self.path, f"a tensor's byte range does not match its shape {shape}")
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self._read_into(memoryview(out.numpy()), offset)
        return out.view(dtype).reshape(shape)

    def _pread(self, nbytes: int, offset: int) -> bytes:
        buf = bytearray(nbytes)
        self._read_into(memoryview(buf), offset)
        return bytes(buf)

    def _read_into(self, buf: memoryview, offset: int) -> None:
        """Fill `buf` from `offset`; a file that ends first is damaged (never a silent short tensor)."""
        while len(buf):
            if hasattr(os, "preadv"):
                n = os.preadv(self._fd, [buf], offset)
            else:
                with self._lock:
                    self._file.seek(offset)
                    n = self._file.readinto(buf)
            if not n:
                raise _damaged(self.path, "it is shorter than its header says")
            buf = buf[n:]
            offset += n

    def close(self) -> None:
        with self._lock:
            self._file.close()
