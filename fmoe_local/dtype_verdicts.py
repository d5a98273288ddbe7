"""What `dtype` auto decides on a CPU from measurements, measured once per machine and reused: the ratios of
bandwidth's dtype probes (`half_decode_ratio`: bf16 against float32 dense decode; `products_decode_ratio`: torch's
int8/int4 products with bf16 against float32 activations), keyed by what they depend on; and, by the same rule, which
product multiplies the dense int8 weights (`openvino_products.int8_ratio`: OpenVINO's against torch's, per compute
dtype, weight size class and openvino version, which its ratio's name holds).

Scope: `DtypeVerdicts` holds the ratios measured for one machine key (the CPU's model name and flags, torch's version
and CPU capability, torch's thread count), measures a missing one when it is first asked (the probe for a format is
run only for a load in that format), and gives the verdicts `resolve_dtype` (here) and hardware.probe ask for. It does
NOT save anything: as for miss_cost.MissCosts, the app saves `to_dict()` in its settings after a load and hands it
back to the next (`Runtime.load(..., dtype_verdicts=)`); the Models tab's "Re-check this computer" measures them
again. Saved figures of another machine key, or unreadable ones, are ignored and measured again, never an error.

Threads: one object may be shared (the app's page probes the machine while its start-up load resolves a dtype). A
probe runs under the object's lock: two threads asking at once never run two probes together (each would time the
other's memory traffic and save a wrong verdict for good), and a ratio is measured once. The lock does not keep a
load's own work (reading, quantising) from running beside a probe.
"""

from __future__ import annotations

import hashlib
import math
import platform
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from fmoe_local import bandwidth, expert_formats, openvino_products


def machine_key() -> str:
    """What the dtype probes' answers depend on, as one string: `torch_cpu_key()` and torch's thread count now."""
    return f"{torch_cpu_key()} | threads {torch.get_num_threads()}"


def torch_cpu_key() -> str:
    """The CPU (model name and flags, or what the platform says of it), torch's version and the CPU capability it
    dispatches to, as one string: what torch's CPU kernels, and the int4 layout they read (kept on disk by
    quant_cache.py), depend on."""
    model, flags = _cpu_identity()
    digest = hashlib.sha256(flags.encode()).hexdigest()[:16]
    return f"{model} | flags {digest} | torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}"


def _cpu_identity() -> tuple[str, str]:
    """(model name, flags) from /proc/cpuinfo on Linux; elsewhere the platform's processor and machine names (the
    key then also holds torch's CPU capability, which follows the vector units)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip().lower(), value.strip())
    model = fields.get("model name") or fields.get("cpu model") or platform.processor() or platform.machine()
    flags = " ".join(sorted((fields.get("flags") or fields.get("features") or "").split()))
    return model, flags


class DtypeVerdicts:
    """The dtype probes' ratios for this machine: saved ones where they were measured under the same key, else
    measured when first asked. `measured`: how many probes this object ran."""

    def __init__(
        self,
        saved: object = None,
        key: str | None = None,
        half_ratio: Callable[[object], float] | None = None,
        products_ratio: Callable[[str], float] | None = None,
        openvino_ratio: Callable[[object, str], float] | None = None,
    ) -> None:
        self.key = machine_key() if key is None else key
        # The probes (default: bandwidth's, looked up when measured) and the key are arguments so that tests count
        # the probes run without timing anything.
        self._half_ratio = half_ratio or (lambda dtype: bandwidth.half_decode_ratio(dtype))
        self._products_ratio = products_ratio or (lambda fmt: bandwidth.products_decode_ratio(fmt))
        self._openvino_ratio = openvino_ratio or (lambda dtype, size: openvino_products.int8_ratio(dtype, size))
        self.ratios: dict[str, float] = _readable(saved, self.key)
        self.measured = 0
        self._lock = threading.Lock()  # held while a probe runs and while `ratios` changes or is copied

    def keeps_half(self, dtype: object) -> bool:
        """Does this CPU decode with weights in half precision `dtype` about as fast as in float32?"""
        name = str(dtype).removeprefix("torch.")
        return self._ratio(f"half {name}", lambda: self._half_ratio(dtype)) <= bandwidth.HALF_DECODE_SLACK

    def products_prefer_bf16(self, fmt: str) -> bool:
        """Does this CPU compute torch's weight-only products for `fmt` faster with bf16 activations?"""
        return self._ratio(f"products {fmt}", lambda: self._products_ratio(fmt)) < 1.0

    def dense_prefers_openvino(self, dtype: object, size: str = "small") -> bool:
        """Does OpenVINO's int8 product (openvino_products.py) run one token faster here than torch's with `dtype`
        activations, on weights of `size` (openvino_products.size_class)? False, with nothing measured, where
        openvino is not installed or, with no saved verdict, cannot be imported. A saved verdict is read without
        importing openvino (about 0.3 s at every app start); should the import fail at the load, dense_formats falls
        back to torch's product and says so."""
        installed = openvino_products.version()
        if not installed:
            return False
        # The small size's name is the one verdicts were saved under before sizes were told apart (the same probe).
        kind = "" if size == "small" else f"{size} "
        name = f"openvino int8 {kind}{str(dtype).removeprefix('torch.')} {installed}"
        if name not in self.ratios and openvino_products.unavailable():
            return False
        return self._ratio(name, lambda: self._openvino_ratio(dtype, size)) < 1.0

    def forget(self) -> None:
        """Measure everything again when next asked (the Models tab's "Re-check this computer"), here and in this
        process's cache of OpenVINO's probe (openvino_products.int8_ratio); waits for a probe under way."""
        with self._lock:
            self.ratios.clear()
            openvino_products.forget_measured()

    def _ratio(self, name: str, measure: Callable[[], float]) -> float:
        with self._lock:
            if name not in self.ratios:
                self.ratios[name] = float(measure())
                self.measured += 1
            return self.ratios[name]

    def to_dict(self) -> dict:
        """What to save: the key and the ratios (an infinite ratio, a product torch lacks here, as the string "inf",
        so that the saved text is strict JSON)."""
        with self._lock:
            ratios = {k: (v if math.isfinite(v) else "inf") for k, v in self.ratios.items()}
        return {"key": self.key, "ratios": ratios}


def _readable(saved: object, key: str) -> dict[str, float]:
    """The ratios of `saved` (a `to_dict()` read back) when it was measured under `key`; {} for anything else."""
    if not isinstance(saved, Mapping) or saved.get("key") != key or not isinstance(saved.get("ratios"), Mapping):
        return {}
    ratios = {}
    for name, value in saved["ratios"].items():
        if value == "inf":
            value = math.inf
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            return {}  # written by something else: measure again
        if math.isnan(value) or value < 0:
            return {}
        ratios[name] = float(value)
    return ratios


def resolve_dtype(
    name: str,
    device: torch.device,
    stored: Callable[[], torch.dtype] | None = None,
    keeps_half: Callable[[torch.dtype], bool] = bandwidth.cpu_keeps_half,
    expert_format: str = "auto",
    products_prefer_bf16: Callable[[str], bool] = bandwidth.cpu_products_prefer_bf16,
) -> torch.dtype | None:
    """None = keep the checkpoint's dtype (`stored()` says which it is). On a GPU auto keeps it. On the CPU auto keeps
    a bf16 checkpoint where this CPU decodes in bf16 about as fast as in float32 (`keeps_half`, a measurement:
    CPUs range from ones without bf16 units to AMX), so the model holds its own size in RAM, and where its experts
    are int8/int4 (`expert_format`) that torch's weight-only products compute faster with bf16 activations
    (`products_prefer_bf16`, measured; asked first: the experts are most of a token's bytes). Else, and for fp16
    checkpoints (models trained in bf16 can overflow fp16, and CPUs' fp16 products are slow), float32."""
    if name != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    if device.type == "cuda" or stored is None:
        return None
    dtype = stored()
    if dtype == torch.float32:
        return None
    if dtype == torch.bfloat16:
        if expert_format in expert_formats.PRODUCTS and products_prefer_bf16(expert_format):
            return None
        if keeps_half(dtype):
            return None
    return torch.float32
