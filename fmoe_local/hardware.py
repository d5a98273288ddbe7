"""What this machine has (GPU, VRAM, RAM, disk) and what fits on it.

Scope: probing happens only when `probe()` is called (the app asks once, and again when the user refreshes);
the fit functions are pure arithmetic over a `Machine` so that tests can feed made-up machines. It does NOT
choose runtime defaults on its own, allocate device memory beyond a bandwidth probe the caller asks for, or
know about the UI.

The fit verdicts per expert format (`format_fits`: disk for the download and an int8/int4/nf4 copy, RAM and GPU,
the recommended format: the most faithful that fits; `instead`: the sentence naming a format that fits when the
chosen one does not) are the download wizard's rows; the UI only renders them. Without a CUDA GPU a bf16 checkpoint
stays bf16 where the CPU decodes it about as fast as float32 (`Machine.cpu_keeps_bf16`), or where its experts are
int8/int4 and torch's weight-only products are measured faster with bf16 activations (`Machine.cpu_bf16_products`,
bandwidth.products_decode_ratio; both probes once per machine: dtype_verdicts.py), else it is computed in float32
and counts twice its size (`cpu_widening`); with int8/int4 experts the resident part's linear weights are packed the
same way (dense format auto: `cpu_resident_bytes`; int8 ones twice where OpenVINO multiplies them, per size class:
`Machine.cpu_openvino_dense`). `host_ram_budget_gb` is the RAM the host store may fill.
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from fmoe_local.catalog import GB, CatalogEntry

if TYPE_CHECKING:
    from fmoe_local.dtype_verdicts import DtypeVerdicts

# The runtime counts cache_gb in binary gigabytes (cache.py); every cache figure here does the same, while sizes
# shown to the user (downloads, RAM, disk) stay decimal like file managers show them.
GIB = 1024**3

# Room kept free on the GPU for the KV cache, activations and the CUDA context of a chat-length request.
KV_RESERVE_BYTES = int(1.0 * GB)
# RAM the OS, the browser and the app itself need besides the expert weights.
RAM_HEADROOM_BYTES = int(3.0 * GB)
# Disk left free after a download, so that the machine does not grind to a halt.
DISK_MARGIN_BYTES = int(2.0 * GB)


@dataclass(frozen=True)
class Machine:
    device: str  # "cuda", "mps" or "cpu"
    gpu_name: str  # "" without a GPU
    vram_total: int  # bytes; 0 without a GPU (on "mps" the GPU shares RAM, so this is 0 too)
    vram_free: int
    ram_total: int
    ram_available: int
    disk_free: int  # on the volume that holds the data directory
    os_name: str = field(default_factory=platform.system)
    # Why an NVIDIA GPU that is present is not used ("" when none is, or it is used): a sentence saying what to do.
    unused_gpu: str = ""
    # Without a CUDA GPU: does this CPU decode with bf16 weights about as fast as with float32 (measured by probe(),
    # bandwidth.cpu_keeps_half)? Then a bf16 model stays bf16 in RAM, else the runtime computes it in float32.
    cpu_keeps_bf16: bool = False
    # Without a CUDA GPU: the packed expert formats (int8, int4) whose weight-only products this CPU computes faster
    # with bf16 activations (bandwidth.cpu_products_prefer_bf16): a bf16 model in one of them stays bf16 in RAM.
    cpu_bf16_products: tuple[str, ...] = ()
    # Without a CUDA GPU: the size classes of dense weights packed int8 that OpenVINO's product multiplies here
    # (openvino_products.size_class, "small" and/or "large"; the measured verdicts,
    # dtype_verdicts.DtypeVerdicts.dense_prefers_openvino). Those take their size once more in RAM (its repacked copy,
    # openvino_products.REPACK_BYTES_PER_CODE).
    cpu_openvino_dense: tuple[str, ...] = ()

    @property
    def has_gpu(self) -> bool:
        return self.device == "cuda" and self.vram_total > 0

    def with_freed(self, vram_bytes: int, ram_bytes: int) -> Machine:
        """This machine as it would be with `vram_bytes` of GPU memory and `ram_bytes` of RAM given back (the app's
        own loaded model, which a Load unloads first)."""
        return replace(
            self,
            vram_free=min(self.vram_total, self.vram_free + vram_bytes),
            ram_available=min(self.ram_total, self.ram_available + ram_bytes) if self.ram_total else self.ram_available,
        )

    def summary(self) -> str:
        parts = []
        if self.has_gpu:
            parts.append(f"{self.gpu_name}: {_gb(self.vram_free)} of {_gb(self.vram_total)} VRAM free")
        elif self.device == "mps":
            # The runtime computes on CUDA or the CPU (engine.resolve_device): the Apple GPU is not used yet.
            parts.append("Apple Silicon: models run on the CPU (the Apple GPU is not used yet)")
        elif self.unused_gpu:
            parts.append(f"{self.unused_gpu} Until then models run on the CPU (slow)")
        else:
            parts.append("No CUDA GPU found: models run on the CPU (slow)")
        parts.append(f"RAM {_gb(self.ram_available)} free of {_gb(self.ram_total)}")
        parts.append(f"disk {_gb(self.disk_free)} free")
        return " · ".join(parts)


@dataclass(frozen=True)
class FitVerdict:
    level: str  # "good", "slow" or "no"
    reasons: tuple[str, ...]  # sentences, the first one is the headline
    max_cache_gb: float  # the biggest expert cache this machine can give the model, GiB (0 when it does not fit)

    @property
    def label(self) -> str:
        return {"good": "Fits", "slow": "Runs, slowly", "no": "Does not fit"}[self.level]


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def ram_bytes() -> tuple[int, int]:
    """(total, available) system RAM in bytes; (0, 0) when the platform does not say."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        values = {}
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
        return values.get("MemTotal", 0), values.get("MemAvailable", values.get("MemFree", 0))
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        # macOS has no cheap "available" figure without psutil; half of RAM is a conservative stand-in.
        return total, total // 2
    if platform.system() == "Windows":
        import ctypes

        class _Status(ctypes.Structure):
            _fields_ = [
                ("dwLength", ctypes.c_ulong),
                ("dwMemoryLoad", ctypes.c_ulong),
                ("ullTotalPhys", ctypes.c_ulonglong),
                ("ullAvailPhys", ctypes.c_ulonglong),
                ("ullTotalPageFile", ctypes.c_ulonglong),
                ("ullAvailPageFile", ctypes.c_ulonglong),
                ("ullTotalVirtual", ctypes.c_ulonglong),
                ("ullAvailVirtual", ctypes.c_ulonglong),
                ("ullAvailExtendedVirtual", ctypes.c_ulonglong),
            ]

        status = _Status()
        status.dwLength = ctypes.sizeof(_Status)
        ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status))  # type: ignore[attr-defined]
        return int(status.ullTotalPhys), int(status.ullAvailPhys)
    return 0, 0


def host_ram_budget_gb(reserve_bytes: int = 0) -> float | None:
    """RAM the host store may fill with experts now: what is available less the headroom the fit verdicts keep
    (RAM_HEADROOM_BYTES) and `reserve_bytes` still to be allocated; None when the platform does not say (then
    every expert is held). The verdicts' "Runs, slowly: … read from disk" is this budget at work: a model whose
    experts exceed it reads the rest from its files on each use instead of being killed for want of memory."""
    total, available = ram_bytes()
    if total <= 0:
        return None
    return max(0, available - RAM_HEADROOM_BYTES - reserve_bytes) / GIB


def disk_free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the volume holding `path` (its nearest existing parent when it does not exist yet)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def volume_of(path: str | os.PathLike) -> str:
    """The drive or mount point holding `path` (its nearest existing parent when it does not exist yet): where a
    user frees space, named in sentences about it."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


def probe(data_dir: str | os.PathLike = ".", verdicts: DtypeVerdicts | None = None) -> Machine:
    """Look at this machine now. Imports torch lazily so that a CPU-only UI test pays nothing for CUDA. `verdicts`:
    the dtype probes' ratios saved for this machine (dtype_verdicts.py); those missing are measured into it, and
    without it all are."""
    import torch

    from fmoe_local.dtype_verdicts import DtypeVerdicts

    device, name, total, free = "cpu", "", 0, 0
    if torch.cuda.is_available():
        device = "cuda"
        name = torch.cuda.get_device_name(0)
        free, total = torch.cuda.mem_get_info(0)
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        device = "mps"
    ram_total, ram_avail = ram_bytes()
    unused = unused_gpu_reason(torch.version.cuda) if device == "cpu" else ""
    verdicts = DtypeVerdicts() if verdicts is None else verdicts
    keeps_bf16 = device != "cuda" and verdicts.keeps_half(torch.bfloat16)
    from fmoe_local.expert_formats import PRODUCTS
    from fmoe_local.openvino_products import PROBE_SHAPES

    products = () if device == "cuda" else tuple(f for f in PRODUCTS if verdicts.products_prefer_bf16(f))
    openvino_dense: tuple[str, ...] = ()
    if device != "cuda":
        from fmoe_local.dtype_verdicts import resolve_dtype

        # What a bf16 checkpoint with int8 experts computes in here (None: it keeps bf16).
        int8_dtype = resolve_dtype(
            "auto",
            torch.device("cpu"),
            lambda: torch.bfloat16,
            verdicts.keeps_half,
            "int8",
            verdicts.products_prefer_bf16,
        )
        openvino_dense = tuple(
            size for size in PROBE_SHAPES if verdicts.dense_prefers_openvino(int8_dtype or torch.bfloat16, size)
        )
    return Machine(
        device,
        name,
        int(total),
        int(free),
        ram_total,
        ram_avail,
        disk_free_bytes(data_dir),
        unused_gpu=unused,
        cpu_keeps_bf16=keeps_bf16,
        cpu_bf16_products=products,
        cpu_openvino_dense=openvino_dense,
    )


def unused_gpu_reason(torch_cuda: str | None) -> str:
    """Why PyTorch sees no CUDA GPU on a machine whose NVIDIA driver tool is installed; "" without that tool."""
    if shutil.which("nvidia-smi") is None:
        return ""
    if not torch_cuda:
        return (
            "An NVIDIA GPU is present but this PyTorch is the CPU-only build: start fmoe-local with its launcher "
            "(it installs the GPU build), or install PyTorch's CUDA build yourself."
        )
    return (
        f"An NVIDIA GPU is present but PyTorch (built for CUDA {torch_cuda}) cannot use it: update the NVIDIA driver "
        "(or restart after installing one), then start fmoe-local again."
    )


def min_cache_bytes(top_k: int, expert_bytes: int) -> int:
    """The smallest useful expert cache: the current layer's top-k plus as many being prefetched."""
    return 2 * top_k * expert_bytes


def copy_bytes(entry: CatalogEntry, fmt: str, machine: Machine | None = None) -> int:
    """Disk the quantised copy takes (quant_cache.py): int8/int4/nf4 experts made from another form on the first
    load, in their RAM size on `machine` (int4's scales follow the compute dtype: cpu_widening), and on a machine
    without a CUDA GPU the resident part's linear weights packed beside them (`cpu_dense_copy_bytes`); 0 for the
    download's own form. Without `machine`, the experts alone."""
    made = fmt in ("int8", "int4", "nf4") and fmt != entry.native_format
    if not made:
        return 0
    if machine is None:
        return entry.experts_bytes_for(fmt)
    experts = round(entry.experts_bytes_for(fmt) * cpu_widening(entry, fmt, machine))
    return experts + (0 if machine.has_gpu else cpu_dense_copy_bytes(entry, fmt, machine))


def fit(entry: CatalogEntry, machine: Machine, downloaded: bool = False, fmt: str = "auto") -> FitVerdict:
    """Will `entry` run here with its experts stored as `fmt`, and how well? Pure arithmetic: see the module
    constants for the margins. The download is the same for every format; int8/nf4 are made on the first load into
    a copy on disk, and a copy that does not fit is made again in memory at every load (minutes), so it runs, slowly."""
    verdict = _fit(entry, machine, downloaded, fmt)
    copy = copy_bytes(entry, fmt, machine)
    room = machine.disk_free - (0 if downloaded else entry.download_bytes) - DISK_MARGIN_BYTES
    if verdict.level == "no" or not copy or copy <= room:
        return verdict
    from fmoe_local.expert_formats import NAMES

    why = (
        f"The {NAMES[fmt]} copy of the experts ({_gb(copy)}) does not fit on the disk as well, so every load "
        "quantises them again (minutes): free up space to keep it."
    )
    if verdict.level == "good":
        return FitVerdict("slow", (f"Runs, slowly: {why}", *verdict.reasons[1:]), verdict.max_cache_gb)
    return FitVerdict(verdict.level, (*verdict.reasons, why), verdict.max_cache_gb)


def cpu_widening(entry: CatalogEntry, fmt: str, machine: Machine) -> float:
    """How many times larger than its size in `expert_formats.BITS` an expert of `fmt` is in RAM here. Without a CUDA
    GPU the runtime computes in float32 where the CPU computes bf16 slowly (dtype_verdicts.resolve_dtype: `_widens`):
    bf16 experts take twice their size, and int4's group scales and zeros, kept in the compute dtype, 5 bits per weight
    instead of 4.5. Else, and for int8, nf4 and MXFP4 (their scales are float32 or bytes either way), 1."""
    from fmoe_local.expert_formats import BITS, INT4_FLOAT32_BITS

    stored = entry.native_format if fmt == "auto" else fmt
    if not _widens(machine, stored):
        return 1.0
    return {"bf16": 2.0, "int4": INT4_FLOAT32_BITS / BITS["int4"]}.get(stored, 1.0)


def resident_widening(machine: Machine, fmt: str = "bf16") -> int:
    """How many times larger than on disk the non-expert (bf16) weights are in RAM here with experts stored in `fmt`
    (see cpu_widening)."""
    return 2 if _widens(machine, fmt) else 1


def cpu_resident_bytes(entry: CatalogEntry, fmt: str, machine: Machine) -> int:
    """The resident part in RAM without a CUDA GPU, experts stored as `fmt`: dense format auto packs its linear
    weights as int8/int4 experts (dense_formats.resolve, `cpu_dense_copy_bytes`), int8 ones twice where OpenVINO
    multiplies them (`Machine.cpu_openvino_dense`: its repacked copy beside ours; the output head judged by its own
    size, the other linear weights as attention projections, small); the input embedding table, and everything with
    other experts, takes its size in the compute dtype (resident_widening)."""
    from fmoe_local.openvino_products import REPACK_BYTES_PER_CODE, size_class

    stored = entry.native_format if fmt == "auto" else fmt
    widen = resident_widening(machine, stored)
    packed = cpu_dense_copy_bytes(entry, fmt, machine)
    if not packed:
        return widen * entry.resident_bytes
    if stored == "int8":
        head = entry.embedding_bytes // 2  # int8 codes of the input table's shape: none of the catalog ties them
        repacked = head if size_class(head) in machine.cpu_openvino_dense else 0
        repacked += packed - head if "small" in machine.cpu_openvino_dense else 0
        packed += round(repacked * REPACK_BYTES_PER_CODE)
    return widen * entry.embedding_bytes + packed


def cpu_dense_copy_bytes(entry: CatalogEntry, fmt: str, machine: Machine) -> int:
    """The resident part's linear weights as dense format auto packs them on a CPU device with experts in `fmt` (0
    when it leaves them unpacked): their size in RAM and in the copy's `dense.safetensors` (quant_cache.DenseCopy).
    int4's scales and zeros follow the compute dtype, as the experts' (cpu_widening)."""
    import torch

    from fmoe_local.dense_formats import resolve
    from fmoe_local.expert_formats import BITS, INT4_FLOAT32_BITS

    stored = entry.native_format if fmt == "auto" else fmt
    dense = resolve("auto", torch.device("cpu"), stored)
    if dense == "bf16":
        return 0
    packed = entry.resident_bytes_for(dense) - entry.embedding_bytes
    if dense == "int4" and resident_widening(machine, stored) == 2:
        packed = round(packed * INT4_FLOAT32_BITS / BITS["int4"])
    return packed


def _widens(machine: Machine, fmt: str) -> bool:
    """Does a bf16 model with experts in `fmt` compute in float32 here (dtype_verdicts.resolve_dtype's rule)?"""
    if machine.has_gpu or machine.cpu_keeps_bf16:
        return False
    return fmt not in machine.cpu_bf16_products


def _fit(entry: CatalogEntry, machine: Machine, downloaded: bool, fmt: str) -> FitVerdict:
    reasons: list[str] = []
    expert_bytes, experts_bytes = entry.expert_bytes_for(fmt), entry.experts_bytes_for(fmt)
    if not machine.has_gpu:  # float32 on a CPU slow in bf16: the resident part always, bf16 experts too
        expert_bytes = round(expert_bytes * cpu_widening(entry, fmt, machine))
        experts_bytes = round(experts_bytes * cpu_widening(entry, fmt, machine))
        entry = replace(entry, resident_bytes=cpu_resident_bytes(entry, fmt, machine))
    min_cache = min_cache_bytes(entry.top_k, expert_bytes)
    disk_needed = 0 if downloaded else entry.download_bytes + DISK_MARGIN_BYTES
    if disk_needed and machine.disk_free < disk_needed:
        return FitVerdict(
            "no",
            (
                f"Not enough disk space: the download needs {_gb(entry.download_bytes)} and "
                f"{_gb(machine.disk_free)} is free. Free up space or choose a smaller model.",
            ),
            0.0,
        )
    ram_free = max(0, machine.ram_available - RAM_HEADROOM_BYTES)
    if machine.has_gpu:
        vram_for_cache = machine.vram_free - entry.resident_bytes - KV_RESERVE_BYTES
        if vram_for_cache < min_cache:
            need = entry.resident_bytes + KV_RESERVE_BYTES + min_cache
            return FitVerdict(
                "no",
                (
                    f"Not enough GPU memory: the always-resident part plus a minimal expert cache needs "
                    f"{_gb(need)}, and {_gb(machine.vram_free)} is free.",
                ),
                0.0,
            )
        cache = min(vram_for_cache, experts_bytes)
        reasons.append(f"GPU: {_gb(entry.resident_bytes)} resident, up to {_gb(cache)} of expert cache.")
        if experts_bytes <= ram_free:
            reasons.insert(0, "Fits: all experts stay in RAM and stream to the GPU cache.")
            return FitVerdict("good", tuple(reasons), cache / GIB)
        reasons.insert(
            0,
            f"Runs, slowly: the experts ({_gb(experts_bytes)}) exceed free RAM ({_gb(ram_free)}), "
            "so some are read from disk.",
        )
        return FitVerdict("slow", tuple(reasons), cache / GIB)
    # CPU (or Apple unified memory): resident part, cache and the host copies of the experts share RAM.
    needed = entry.resident_bytes + min_cache
    if ram_free < needed:
        return FitVerdict(
            "no",
            (f"Not enough memory: the model needs at least {_gb(needed)} of RAM and {_gb(ram_free)} is free.",),
            0.0,
        )
    cache = min(ram_free - entry.resident_bytes, experts_bytes)
    where = "all experts fit in RAM" if entry.resident_bytes + experts_bytes <= ram_free else "experts spill to disk"
    gpu = "on the CPU (the Apple GPU is not used yet)" if machine.device == "mps" else "on the CPU, without a CUDA GPU"
    return FitVerdict("slow", (f"Runs, slowly: {gpu}; {where}.",), cache / GIB)


def fit_by_format(entry: CatalogEntry, machine: Machine, downloaded: bool = False) -> dict[str, FitVerdict]:
    """The verdict for each expert format a user can choose (the download's own form first)."""
    from fmoe_local.expert_formats import LABELS

    formats = [entry.native_format] + [f for f in ("bf16", "int8", "int4", "nf4") if f != entry.native_format]
    return {f: fit(entry, machine, downloaded, f) for f in formats if f in LABELS}


def recommend_format(verdicts: dict[str, FitVerdict]) -> str:
    """The most faithful format that runs well here; else the one that runs at all with the most room to spare
    (the smallest); the download's own form when nothing fits. Ties go to the listed order: int4 before nf4 (4.5
    bits each), since a CPU computes int4 with torch's int4 product and dequantises nf4 at every use, 19× slower
    here (docs/bench.md, "CPU experts on a CPU device")."""
    from fmoe_local.expert_formats import BITS

    order = ("good", "slow")
    for level in order:
        fitting = [f for f, v in verdicts.items() if v.level == level]
        if fitting:
            return fitting[0] if level == "good" else min(fitting, key=BITS.__getitem__)
    return next(iter(verdicts))


@dataclass(frozen=True)
class FormatFit:
    """One expert format of a catalog model on this machine: what it takes and the verdict (the wizard's row)."""

    fmt: str  # the stored form: bf16, int8, int4, nf4 or the download's own (mxfp4)
    choice: str  # the RuntimeConfig.expert_format that gives it ("auto" for a download's own non-bf16 form)
    disk_bytes: int  # the download plus the quantised copy made on the first load
    ram_bytes: int  # every expert in this form (plus the resident part without a CUDA GPU: it shares RAM)
    gpu_bytes: int  # resident part plus the expert cache this machine can give it; 0 without a CUDA GPU
    verdict: FitVerdict
    recommended: bool


def format_fits(entry: CatalogEntry, machine: Machine, downloaded: bool = False) -> list[FormatFit]:
    """Every format a user can choose for `entry` here, the download's own first, with one recommended (none when
    no format fits)."""
    verdicts = fit_by_format(entry, machine, downloaded)
    best = recommend_format(verdicts)
    out = []
    for fmt, verdict in verdicts.items():
        experts = round(entry.experts_bytes_for(fmt) * cpu_widening(entry, fmt, machine))
        gpu = entry.resident_bytes + int(verdict.max_cache_gb * GIB) if machine.has_gpu and verdict.max_cache_gb else 0
        out.append(
            FormatFit(
                fmt,
                "auto" if fmt == entry.native_format and fmt != "bf16" else fmt,
                entry.download_bytes + copy_bytes(entry, fmt, machine),
                experts + (0 if machine.has_gpu else cpu_resident_bytes(entry, fmt, machine)),
                gpu,
                verdict,
                fmt == best and verdict.level != "no",  # nothing is recommended where nothing fits
            )
        )
    return out


def instead(fits: list[FormatFit], choice: str) -> str:
    """A sentence when the chosen format (a RuntimeConfig.expert_format) does not fit here, naming one that does;
    "" when it fits (or runs, slowly)."""
    from fmoe_local.expert_formats import NAMES

    chosen = next((f for f in fits if f.choice == choice), fits[0] if choice == "auto" else None)
    if chosen is None or chosen.verdict.level != "no":
        return ""
    working = [f for f in fits if f.verdict.level != "no"]
    if not working:
        return f"{NAMES[chosen.fmt]} does not fit here, and neither does any other format: {chosen.verdict.reasons[0]}"
    best = next((f for f in working if f.recommended), working[0])
    return (
        f"{NAMES[chosen.fmt]} does not fit here: {chosen.verdict.reasons[0]} Choose {NAMES[best.fmt]} instead "
        f"({best.verdict.label.lower()})."
    )


def cache_gb_limit(machine: Machine, resident_bytes: int, current_cache_gb: float = 0.0) -> float:
    """Upper bound for the cache-GB slider of a loaded model, in GiB like RuntimeConfig.cache_gb.

    On a GPU: free VRAM (plus what the current cache already holds, since resizing releases it) minus the
    KV reserve. On the CPU: free RAM minus the headroom. `resident_bytes` is what still has to be allocated
    besides the cache: pass 0 for a loaded model (a live probe already counts its weights as used).
    """
    current = int(current_cache_gb * GIB)
    if machine.has_gpu:
        room = machine.vram_free + current - KV_RESERVE_BYTES - resident_bytes
    else:
        room = machine.ram_available + current - RAM_HEADROOM_BYTES - resident_bytes
    return max(0.0, room / GIB)
