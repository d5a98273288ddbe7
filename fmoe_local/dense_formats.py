"""Dense formats: the linear weights a token reads outside the routed experts (attention projections, the output
head, shared experts, dense MLP layers), stored packed on a CPU device as llama.cpp's Q8_0/Q4_0 files store every
weight, and multiplied by the same torch weight-only products the experts use there, or for int8 by OpenVINO's.

Scope: resolving `dense_format` (auto | bf16 | int8 | int4, config.py) against the device and the experts' resolved
format; choosing the nn.Linear modules to pack; swapping each for a `PackedLinear` holding the weight in
expert_formats' int8 / int4 form (expert_formats.pack_int8 / pack_int4 and Int4Weight's CPU layout: one packer for
experts and dense weights); the bytes they hold. Packed once per checkpoint, format and dtype: the packed parts are
kept in the quantise-on-load cache beside the experts (quant_cache.DenseCopy, `dense.safetensors`, int4's codes in
the CPU layout of the torch and CPU that wrote it) and read back as they are at later loads under the same key. It
does NOT read checkpoints (loading.py puts
the dense weights in the model first, then calls `quantise`), touch the routed experts, or re-implement a model: each
module keeps its place in transformers' model, only its weight's storage and product change.

Never packed: routers and shared-expert gates (their logits choose the experts: a small error flips a top-k choice,
and they are tiny — architectures.Architecture.gates knows where they are), embeddings and norms (not nn.Linear),
and a layer whose weight the model keeps in float32 (transformers' keep-in-fp32 list: kept for precision). int4
packs only weights torch's CPU int4 product takes (out a multiple of 16, in of 32); another stays unquantised.

Tied embeddings: the output head shares the input table's tensor. The head is packed as its own copy and the input
table stays as it is (a lookup reads one row of it per token), so a tied model holds its embedding twice: the table
in the compute dtype plus the packed head (vocab × hidden bytes in int8, about half that in int4) — for a 151,936 ×
2,048 vocabulary 311 MB or 175 MB more RAM than unpacked, in exchange for a head that reads 2–3.6× fewer bytes.

The int8 product: OpenVINO's (openvino_products.Int8Product, float32 activations, on the same `q` and `scale`) where
the machine's verdict for the weight's size says it is faster (measured once per machine and size class and saved
with the dtype verdicts: dtype_verdicts.DtypeVerdicts.dense_prefers_openvino; `RuntimeConfig.dense_int8_product`
forces either), torch's `_weight_int8pack_mm` otherwise, and where openvino cannot be imported or a weight does not
compile (`int8_product` and `quantise` log which product runs and what that costs). OpenVINO's costs RAM: its plugin
keeps a repacked copy of the codes beside ours (made at the first call; our `q` stays, shared with the model's
constant, not copied), so a dense int8 weight it computes holds about twice its int8 bytes (`repacked_bytes`;
hardware.cpu_resident_bytes counts it): for Qwen3-30B-A3B's 1.2 GB of dense int8 weights, up to 1.2 GB more (as much
RAM as the bf16 weights, half the bytes read per token).

Exactness: a PackedLinear computes x·Wᵀ (+ b) with W = expert_formats.unpack of its parts; "lossless" for a packed
dense format means the same greedy tokens as transformers eager whose dense weights (and experts) are those
dequantised values (tests/test_dense_formats.py, with each int8 product).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fmoe_local import expert_formats, openvino_products
from fmoe_local.architectures import Architecture, MoELayerRef
from fmoe_local.expert_formats import Int4Weight, Int8Weight, PackedParam
from fmoe_local.quant_cache import DenseCopy

log = logging.getLogger(__name__)

PACKED = expert_formats.PRODUCTS  # int8, int4: the dense formats that pack (bf16 keeps the checkpoint's dtype)


def check(choice: str, device: torch.device) -> None:
    """Refuse (ValueError, a sentence) a packed dense format on a device with no product for it: checked before any
    weight is read."""
    if choice in PACKED and device.type != "cpu":
        raise ValueError(
            f"Dense format {choice} runs on a CPU device only (torch's weight-only CPU products); on a GPU the "
            "attention and output head stay unquantised. Choose dense format auto or bf16, or device cpu."
        )


def resolve(choice: str, device: torch.device, expert_format: str) -> str:
    """The dense format in force: bf16 (the checkpoint's own dtype, unpacked), int8 or int4. `auto` follows the
    experts' resolved format on a CPU device when it is int8 or int4, as llama.cpp's Q8_0/Q4_0 quantise every
    weight (a CPU decode reads every dense weight per token, so their bytes are its speed); elsewhere it keeps them
    unpacked (a GPU holds them once and computes them fast; bf16/nf4/mxfp4 experts have no CPU product to share)."""
    check(choice, device)
    if choice == "auto":
        return expert_format if device.type == "cpu" and expert_format in PACKED else "bf16"
    return choice


class PackedLinear(nn.Module):
    """An nn.Linear's place in the model with its weight stored packed (`fmt` int8 or int4, expert_formats' parts:
    int8 `q`/`scale`, int4 `q` in torch's CPU layout and `sz`), multiplied by torch's weight-only CPU product, or for
    int8 by `product` (an openvino_products.Int8Product built on these same `q` and `scale`; it reads `q`'s memory,
    so the buffers must not be replaced or moved while it is set). The parts are non-persistent buffers: they move
    with the model and count in `model.buffers()`, and a state_dict never saves them as the checkpoint's weight."""

    def __init__(
        self,
        fmt: str,
        in_features: int,
        out_features: int,
        parts: dict[str, torch.Tensor],
        bias: nn.Parameter | None,
        product: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.group = expert_formats.int4_group(in_features)
        for name, tensor in parts.items():
            self.register_buffer(name, tensor, persistent=False)
        self.bias = bias
        self.product = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # torch's products take [tokens, in]
        if self.product is not None:
            out = self.product(flat)
            out = out if self.bias is None else out + self.bias
        elif self.fmt == "int8":
            out = Int8Weight(self.q, self.scale).linear(flat, self.bias)
        else:
            out = Int4Weight(self.q, self.sz, self.group).linear(flat, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        by = ", product=openvino" if self.product is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}{by}"

    def repacked_bytes(self) -> int:
        """RAM OpenVINO's product holds beside the parts (its repacked copy of the codes; 0 for torch's product): held,
        but a token reads it instead of `q`, not beside it."""
        return 0 if self.product is None else round(self.q.numel() * openvino_products.REPACK_BYTES_PER_CODE)


Int8ProductFactory = Callable[[torch.Tensor, torch.Tensor], Callable[[torch.Tensor], torch.Tensor] | None]


def int8_product(
    choice: str, dtype: torch.dtype, prefers_openvino: Callable[[torch.dtype, str], bool]
) -> Int8ProductFactory | None:
    """What multiplies the dense weights packed int8 (`RuntimeConfig.dense_int8_product`): a factory of OpenVINO's
    product per weight (openvino_products.Int8Product; None for a weight torch's `_weight_int8pack_mm` multiplies),
    or None for torch's on every weight. `auto` asks `prefers_openvino(dtype, size)` (the machine's measured verdict,
    dtype_verdicts.py) once per weight size class (openvino_products.size_class: an output head can be faster with
    OpenVINO where an attention projection is not), only where openvino imports; where it does not, or a verdict
    says torch, the log says which product runs and what that costs. `openvino` where it cannot be imported is
    refused (ValueError, a sentence) before any weight is packed."""
    if choice == "torch":
        return None
    why = openvino_products.unavailable()
    if choice == "openvino" and why:
        raise ValueError(
            f"Dense int8 product openvino was chosen but {why}. Install openvino "
            f"({_OPENVINO_PIN}), or choose dense int8 product auto or torch."
        )
    if why:
        log.warning(
            "The dense int8 weights are multiplied by torch's _weight_int8pack_mm: %s. %s Install openvino (%s) "
            "where it has a wheel for this machine for the faster product.",
            why,
            _TORCH_COST,
            _OPENVINO_PIN,
        )
        return None
    threads = torch.get_num_threads()
    if choice == "openvino":
        return lambda q, scale: openvino_products.Int8Product(q, scale, threads)
    verdicts: dict[str, bool] = {}

    def by_size(q: torch.Tensor, scale: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        size = openvino_products.size_class(q.numel())
        if size not in verdicts:
            verdicts[size] = prefers_openvino(dtype, size)
            if not verdicts[size]:
                log.info(
                    "Dense int8 weights the size of %s are multiplied by torch's _weight_int8pack_mm: at that size it "
                    "measured faster on this machine than OpenVINO's product (saved verdict, dtype_verdicts.py).",
                    openvino_products.PROBE_NAMES[size],
                )
        return openvino_products.Int8Product(q, scale, threads) if verdicts[size] else None

    return by_size


_OPENVINO_PIN = "pip install openvino==2026.4.1"
# What torch's product costs against OpenVINO's, as measured (docs/bench.md, session 21): said where it runs instead.
_TORCH_COST = (
    "Where measured it read these weights 1.2-2.3x slower than OpenVINO's product, and int8 decode took 5-36 % "
    "longer per token."
)


def packs(fmt: str, out_features: int, in_features: int) -> bool:
    """Can a [out, in] weight be packed in `fmt`? int8 always; int4 where torch's CPU int4 product takes it."""
    if fmt == "int8":
        return True
    return fmt == "int4" and out_features % 16 == 0 and in_features % 32 == 0


def candidates(model: nn.Module, arch: Architecture, moe_layers: list[MoELayerRef]) -> dict[str, nn.Linear]:
    """{module name: nn.Linear} that a packed dense format may pack: every nn.Linear of the model but the routers
    and shared-expert gates (the routed experts are fused 3-D parameters, never nn.Linear). PhiMoE's router is an
    nn.Linear subclass: it is left out by identity, as every gate is."""
    gates = {id(g) for ref in moe_layers for g in arch.gates(ref)}
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in gates}


@dataclass
class DenseReport:
    """What `quantise` did: the format, the modules packed, and those left unpacked with the reason."""

    fmt: str
    packed: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # module name → why it stays unpacked
    bytes_before: int = 0  # the packed modules' weights as they were
    bytes_after: int = 0  # … and as they are now
    from_copy: int = 0  # how many of `packed` were read from the DenseCopy rather than packed now
    openvino: int = 0  # how many of `packed` OpenVINO's product multiplies (the rest: torch's)


@torch.no_grad()
def quantise(
    model: nn.Module,
    arch: Architecture,
    moe_layers: list[MoELayerRef],
    fmt: str,
    kept_in_fp32: Callable[[str], bool] = lambda name: False,
    copy: DenseCopy | None = None,
    int8_product: Int8ProductFactory | None = None,
) -> DenseReport:
    """Swap every candidate nn.Linear of `model` for a PackedLinear in `fmt` (int8 or int4; bf16 does nothing).
    Each weight's parts are read from `copy` when it holds exactly the ones this load packs, else packed from the
    weight's current values (float32 arithmetic) and then written to `copy` whole; the weight is dropped as soon as
    its module is swapped, so the peak is one module's packed copy over the unpacked model (the copy writes the
    modules' own parts). `kept_in_fp32(parameter name)`: transformers' keep-in-fp32 rule (hf_internals.keep_in_fp32):
    such a weight is left as it is. `int8_product` (`int8_product`'s answer): builds the product an int8 layer
    multiplies with instead of torch's, or None where torch's runs; where it fails for one, torch's product runs for it
    and every later layer, and the log says so."""
    report = DenseReport(fmt)
    if fmt not in PACKED:
        return report
    t0 = time.perf_counter()
    plan: dict[str, tuple[nn.Linear, PackedParam]] = {}
    for name, linear in candidates(model, arch, moe_layers).items():
        if kept_in_fp32(f"{name}.weight"):
            report.kept[name] = "kept in float32 by the model"
            continue
        out_f, in_f = linear.weight.shape  # on the CPU: `check` refused a packed format on any other device
        if not packs(fmt, out_f, in_f):
            report.kept[name] = f"[{out_f}, {in_f}] has no {fmt} product"
            continue
        plan[name] = linear, PackedParam(fmt, (out_f, in_f))
    expected = {
        f"{name}.{part}": spec
        for name, (linear, param) in plan.items()
        for part, spec in param.parts(linear.weight.dtype).items()
    }
    stored = copy.open(expected) if copy is not None and plan else None
    written: dict[str, torch.Tensor] | None = {} if copy is not None and stored is None else None
    for name, (linear, param) in plan.items():
        weight, parts = linear.weight, None
        if stored is not None:
            try:
                parts = {part: stored.get(f"{name}.{part}") for part in param.parts(weight.dtype)}
                report.from_copy += 1
            except OSError as exc:  # failed after its header was read: the rest is packed, the next load writes it
                log.warning("Reading the packed dense weights failed (%s); packing the rest.", exc)
                stored.close()
                stored = None
                copy.discard()
        if parts is None:  # packed now, int4 into this CPU's layout (a copy's parts are in it: DenseCopy.open)
            parts = expert_formats.pack(param, weight, weight.dtype)
            parts = expert_formats.to_cpu_layout({"w": param}, {f"w.{k}": v for k, v in parts.items()})
            parts = {k.removeprefix("w."): v for k, v in parts.items()}
            if written is not None:
                written.update({f"{name}.{part}": t for part, t in parts.items()})
        product = None
        if int8_product is not None and fmt == "int8":
            try:
                product = int8_product(parts["q"], parts["scale"])
            except RuntimeError as exc:  # OpenVINO's errors are RuntimeError subclasses
                log.warning(
                    "OpenVINO could not compile the int8 product of %s (%s): the dense int8 weights from here on are "
                    "multiplied by torch's _weight_int8pack_mm. %s",
                    name,
                    exc,
                    _TORCH_COST,
                )
                int8_product = None
        packed = PackedLinear(fmt, param.shape[1], param.shape[0], parts, linear.bias, product)
        report.openvino += product is not None
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, packed)
        report.packed.append(name)
        report.bytes_before += weight.numel() * weight.element_size()
        report.bytes_after += sum(t.numel() * t.element_size() for t in parts.values()) + packed.repacked_bytes()
    if stored is not None:
        stored.close()
    if written:
        copy.write(written)
    log.info(
        "dense format %s: %d linear layers (%d read from %s, %d multiplied by OpenVINO), %.0f MB → %.0f MB in %.1f s",
        fmt,
        len(report.packed),
        report.from_copy,
        report.openvino,
        copy.path if copy is not None else "no copy",
        report.bytes_before / 1e6,
        report.bytes_after / 1e6,
        time.perf_counter() - t0,
    )
    if report.kept:
        log.info("dense format %s: %d layers left unpacked (e.g. %s)", fmt, len(report.kept), next(iter(report.kept)))
    return report


def packed_bytes(model: nn.Module) -> int:
    """Bytes of every PackedLinear's packed weight in `model` (buffers, which a count over parameters misses): what a
    token reads of them."""
    return sum(
        b.numel() * b.element_size() for m in model.modules() if isinstance(m, PackedLinear) for b in m.buffers()
    )


def repacked_bytes(model: nn.Module) -> int:
    """RAM OpenVINO's products hold beside the packed weights in `model` (PackedLinear.repacked_bytes)."""
    return sum(m.repacked_bytes() for m in model.modules() if isinstance(m, PackedLinear))


def product_name(model: nn.Module) -> str:
    """What multiplies the dense weights packed int8: "openvino", "torch", both as "openvino, torch" where the
    verdicts differ by weight size or a compile failed part way, or "" with none packed int8."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.fmt == "int8"]
    names = {"openvino" if m.product is not None else "torch" for m in layers}
    return ", ".join(sorted(names))
