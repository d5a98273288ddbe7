"""A cache hit in a packed format on the GPU: one expert's three projections for a decode batch, computed as we do
today (dequantise with expert_formats.unpack, then eager's matmuls) against library kernels that read the packed
bytes directly: bitsandbytes' 4-bit matmul (its gemv at one token) and torch's int4 (tinygemm) / int8 weight-only
kernels. Prints µs per expert and the weight bytes read per second; a variant whose output is off by more than
bf16 rounding is marked. Experts rotate over more bytes than the L2 holds, so HBM is what is timed.

Run from the repository root on a CUDA machine: `python tools/gpu_check/packed_kernels.py`.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fmoe_local import expert_formats  # noqa: E402

# hidden, expert intermediate (Mixtral-8x7B, Qwen3-30B-A3B)
SHAPES = {"mixtral-8x7b": (4096, 14336), "qwen3-30b-a3b": (2048, 768)}
L2_ROTATE_BYTES = 400 * 1024**2


def timed(fn, reps: int = 30) -> float:
    """Median µs of `fn()` over `reps` runs (CUDA events), after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[len(times) // 2]


def rotating(fns: list, x: torch.Tensor):
    """A call that runs the next expert of `fns` on `x` each time (round robin)."""
    turn = itertools.cycle(fns)
    return lambda: next(turn)(x)


def expert_fn(gate_up, down):
    """SwiGLU expert as eager computes it: gate_up [2I, H], down [H, I] (weights produced by the callables)."""

    def run(x):
        gu = gate_up(x)
        g, u = gu.chunk(2, dim=-1)
        return down(F.silu(g) * u)

    return run


def main() -> None:
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf

        print(f"bitsandbytes {bnb.__version__}")
    except Exception as exc:  # reported, and the other variants still run
        bnb = None
        print(f"bitsandbytes unavailable: {exc}")
    rows = []
    for name, (h, i) in SHAPES.items():
        dense_bytes = 3 * h * i * 2
        n = max(2, min(64, L2_ROTATE_BYTES // dense_bytes + 1))
        gen = torch.Generator(device=dev).manual_seed(0)
        ws = [
            (
                torch.randn(2 * i, h, device=dev, generator=gen, dtype=torch.bfloat16) * h**-0.5,
                torch.randn(h, i, device=dev, generator=gen, dtype=torch.bfloat16) * i**-0.5,
            )
            for _ in range(n)
        ]
        if True:
            variants: dict[str, tuple[list, int]] = {}
            variants["bf16 dense"] = ([expert_fn(lambda x, w=gu: F.linear(x, w), lambda x, w=d: F.linear(x, w)) for gu, d in ws], dense_bytes)  # fmt: skip
            for fmt in ("nf4", "int8", "int4"):
                fns, runtime_fns = [], []
                for gu, d in ws:
                    params = expert_formats.layout(fmt, {"gu": tuple(gu.shape), "d": tuple(d.shape)})
                    parts = {
                        key: {
                            s: t.to(dev) for s, t in expert_formats.pack(params[key], w.cpu(), torch.bfloat16).items()
                        }
                        for key, w in (("gu", gu), ("d", d))
                    }

                    def unpacked(x, p=params["gu"], q=parts["gu"], p2=params["d"], q2=parts["d"]):
                        return expert_fn(
                            lambda y: F.linear(y, expert_formats.unpack(p, q, torch.bfloat16)),
                            lambda y: F.linear(y, expert_formats.unpack(p2, q2, torch.bfloat16)),
                        )(x)

                    fns.append(unpacked)
                    if fmt == "int4":  # what a cache hit runs: the slot as the copier leaves it, read by PackedRows
                        hit = []
                        for key in ("gu", "d"):
                            slot = {f"w.{k}": t.clone() for k, t in parts[key].items()}
                            expert_formats.to_cuda_layout({"w": params[key]}, slot, torch.bfloat16)
                            hit.append(expert_formats.PackedRows(slot, {"w": params[key]}, torch.bfloat16)["w"])
                        kind = type(hit[0]).__name__
                        runtime_fns.append(
                            expert_fn(lambda y, r=hit[0]: r.linear(y, None), lambda y, r=hit[1]: r.linear(y, None))
                        )
                size = sum(t.numel() * t.element_size() for t in parts["gu"].values())
                size += sum(t.numel() * t.element_size() for t in parts["d"].values())
                variants[f"{fmt} ours (unpack+matmul)"] = (fns, size)
                if runtime_fns:
                    variants[f"{fmt} ours, runtime's hit ({kind})"] = (runtime_fns, size)
            if bnb is not None:
                fns, size = [], 0
                for gu, d in ws:
                    qgu, sgu = bnbf.quantize_4bit(gu, blocksize=64, quant_type="nf4")
                    qd, sd = bnbf.quantize_4bit(d, blocksize=64, quant_type="nf4")
                    size = qgu.numel() + qd.numel() + (sgu.absmax.numel() + sd.absmax.numel()) * 4
                    fns.append(expert_fn(
                        lambda y, q=qgu, s=sgu: bnb.matmul_4bit(y, q.t(), quant_state=s),
                        lambda y, q=qd, s=sd: bnb.matmul_4bit(y, q.t(), quant_state=s),
                    ))  # fmt: skip
                variants["nf4 bitsandbytes matmul_4bit"] = (fns, size)
            try:  # torch's tinygemm int4 (bf16 activations, group size 64)
                fns, size = [], 0
                for gu, d in ws:
                    packed = []
                    for w in (gu, d):
                        wq, sz = _int4_group_quant(w, 64)
                        wq = (wq[:, ::2] << 4 | wq[:, 1::2]).to(torch.uint8)  # two codes a byte, as torch >= 2.5 takes
                        packed.append((torch._convert_weight_to_int4pack(wq, 8), sz))
                    fns.append(expert_fn(
                        lambda y, p=packed[0]: torch._weight_int4pack_mm(y, p[0], 64, p[1]),
                        lambda y, p=packed[1]: torch._weight_int4pack_mm(y, p[0], 64, p[1]),
                    ))  # fmt: skip
                size = 3 * h * i // 2 + 3 * h * i // 64 * 4
                variants["int4 torch _weight_int4pack_mm"] = (fns, size)
            except Exception as exc:
                print(f"torch int4 kernel unavailable: {type(exc).__name__}: {str(exc)[:200]}")
            try:  # torch's weight-only int8 (per-channel scale)
                fns = []
                for gu, d in ws:
                    qs = []
                    for w in (gu, d):
                        scale = w.float().abs().amax(1) / 127
                        qs.append(((w.float() / scale[:, None]).round().to(torch.int8), scale.to(torch.bfloat16)))
                    fns.append(expert_fn(
                        lambda y, q=qs[0]: torch._weight_int8pack_mm(y, q[0], q[1]),
                        lambda y, q=qs[1]: torch._weight_int8pack_mm(y, q[0], q[1]),
                    ))  # fmt: skip
                fns[0](torch.randn(1, h, device=dev, dtype=torch.bfloat16))
                variants["int8 torch _weight_int8pack_mm"] = (fns, 3 * h * i)
            except Exception as exc:
                print(f"torch int8 weight-only kernel unavailable: {type(exc).__name__}: {str(exc)[:200]}")
        for m in (1, 8):
            x = torch.randn(m, h, device=dev, dtype=torch.bfloat16, generator=gen)
            ref = variants["bf16 dense"][0][0](x).float()
            for label, (fns, size) in variants.items():
                try:
                    out = fns[0](x).float()
                    err = ((out - ref).norm() / ref.norm()).item()
                    us = timed(rotating(fns, x))
                    rows.append((name, m, label, us, size / us / 1e3, err))
                except Exception as exc:
                    print(f"{name} m={m} {label}: {type(exc).__name__}: {str(exc)[:300]}")
        del ws
        torch.cuda.empty_cache()
    print(
        f"\n{'shape':15s} {'tokens':>6s} {'variant':34s} {'µs/expert':>10s} {'GB/s read':>10s} {'rel.err vs bf16':>15s}"
    )
    for name, m, label, us, gbs, err in rows:
        print(f"{name:15s} {m:6d} {label:34s} {us:10.1f} {gbs:10.0f} {err:15.4f}")


def _int4_group_quant(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` inputs: (int32 [out, in] values 0..15, scales_and_zeros [in/group, out, 2])."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
    zero = lo + 8 * scale  # tinygemm's zero point is the value of code 8
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return q, sz


if __name__ == "__main__":
    main()
