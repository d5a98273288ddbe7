"""What OpenVINO's GatherMatmul would make of CPU decode in int8, through the real Runtime (issue 26): a measurement,
not a runtime path. Prints a table.

The runtime decodes the `bench cpu-decode` synthetic checkpoint in int8 on a CPU device (miss handling cpu, policy
on_demand: every expert computed from the host copy), twice per round, interleaved: as it is (torch's int8 product
per expert), and with each MoE layer's experts computed by one OpenVINO GatherMatmul call (float32 activations; the
layer's int8 `q` and `scale` from the host store, stacked into one [E, out, in] model per layer at load). Per variant:
tok/s, its share of the memory limit (DRAM read measured each round ÷ the bytes one token reads, as `bench
cpu-decode` counts them), the experts' ms per token, and whether the greedy tokens equal torch's.

The OpenVINO variant replaces `OffloadedExperts._one_token` in this process only (the one-token path every decode step
takes when every expert is a miss), keeps its ascending order and its casts, and counts the call as host time, as
`Offload.host_expert` does. Its stacked copies double the experts' RAM: measure with few layers.

Run from the repository root with openvino on PYTHONPATH (`pip install --no-deps --target DIR openvino==2026.4.1`; not
a dependency of the app): `python tools/openvino_decode.py --layers 2 --rounds 3 --work-dir DIR`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import openvino as ov
import torch
from openvino_layer import call_inputs, compile_config, int8_weight, layer_model

from fmoe_bench import cpu_decode
from fmoe_local import bandwidth
from fmoe_local.config import Sampling
from fmoe_local.experts import OffloadedExperts
from fmoe_local.runtime import Runtime


def layer_models(runtime: Runtime, threads: int) -> dict[int, ov.CompiledModel]:
    """One compiled GatherMatmul model per MoE layer (tools/openvino_layer.py), from the host store's int8 parts of
    its experts."""
    offload = runtime.engine.offload
    info = runtime.info
    core = ov.Core()
    models = {}
    for layer in range(info.num_layers):
        parts = [offload.host.read(layer, e) for e in range(info.num_experts)]

        def weight(name: str, parts: list = parts) -> ov.Node:
            q = np.stack([p[f"{name}.q"].numpy() for p in parts])
            return int8_weight(q, np.stack([p[f"{name}.scale"].numpy() for p in parts])[..., None])

        model = layer_model(weight("gate_up_proj"), weight("down_proj"))
        models[layer] = core.compile_model(model, "CPU", compile_config(threads))
    return models


def one_token_with(models: dict[int, ov.CompiledModel]) -> object:
    requests = {layer: model.create_infer_request() for layer, model in models.items()}
    original = OffloadedExperts._one_token  # noqa: SLF001

    def one_token(module, layer, offload, hidden_states, chosen, top_k_weights, out):  # noqa: ANN001, ANN202
        pos = {e: k for k, e in enumerate(chosen) if 0 <= e < module.num_experts}
        needed = sorted(pos)
        slots = offload.acquire(layer, needed)
        try:
            if not needed or max(slots) >= 0:
                offload.release(slots)
                slots = []
                return original(module, layer, offload, hidden_states, chosen, top_k_weights, out)
            t0 = time.perf_counter()
            x = hidden_states.to("cpu", torch.float32).numpy()
            y = requests[layer].infer(call_inputs(x, needed, module.num_experts))[0]
            currents = torch.from_numpy(y.copy()).to(hidden_states.dtype)
            offload.counters.host_s += time.perf_counter() - t0
            for j, e in enumerate(needed):
                k = pos[e]
                out.add_((currents[j : j + 1] * top_k_weights[:, k : k + 1]).to(out.dtype))
            return out
        finally:
            offload.release(slots)

    return staticmethod(one_token)


def decode(model_dir: Path, quant_dir: Path, variant: str, tokens: int, threads: int) -> dict:
    settings = cpu_decode.DecodeSettings(formats=("int8",), tokens=tokens)
    dtype = cpu_decode.compute_dtype("auto", model_dir, "int8")
    config = cpu_decode._config("int8", dtype, settings, quant_dir, cpu_decode._top_k(model_dir))  # noqa: SLF001
    with Runtime.load(model_dir, config) as runtime:
        patch = (
            mock.patch.object(OffloadedExperts, "_one_token", one_token_with(layer_models(runtime, threads)))
            if (variant == "openvino")
            else mock.patch.object(OffloadedExperts, "_one_token", OffloadedExperts.__dict__["_one_token"])
        )
        with patch:
            runtime.generate(cpu_decode.PROMPT, Sampling(greedy=True, max_new_tokens=cpu_decode.WARM_UP_TOKENS))
            final = runtime.generate(cpu_decode.PROMPT)
        if final.error:
            raise RuntimeError(f"The {variant} generation failed: {final.error}")
        counted = cpu_decode.token_bytes(runtime)
        result = {
            "tok_s": final.stats.tokens_per_s,
            "experts_ms": 1e3 * final.stats.host_s / max(final.stats.tokens, 1),
            "bytes": counted,
            "text": final.text,
            "dtype": dtype,
        }
    del runtime
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch and OpenVINO threads (default: torch's own)")
    parser.add_argument("--work-dir", type=Path, required=True, help="keeps the checkpoint and the int8 copy")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = cpu_decode.checkpoint(args.work_dir, args.shape, args.layers, lambda s: print(s, file=sys.stderr))
    loads = [" ".join(f"{x:.2f}" for x in os.getloadavg())]
    samples: dict[str, list[dict]] = {"torch": [], "openvino": []}
    for r in range(args.rounds):
        gbps = bandwidth.dram_read_gbps()
        for variant in ("torch", "openvino") if r % 2 == 0 else ("openvino", "torch"):
            s = decode(model_dir, args.work_dir / "quantized", variant, args.tokens, threads)
            s["dram"] = gbps
            samples[variant].append(s)
            print(f"round {r + 1} {variant}: {s['tok_s']:.2f} tok/s, DRAM {gbps:.1f} GB/s", file=sys.stderr)
    loads.append(" ".join(f"{x:.2f}" for x in os.getloadavg()))
    same = all(a["text"] == b["text"] for a, b in zip(samples["torch"], samples["openvino"], strict=True))
    print(
        f"{args.shape} widths, {args.layers} layers, int8 experts, computes in {samples['torch'][0]['dtype']}; "
        f"{threads} threads; {args.tokens} greedy tokens; load {' → '.join(loads)}; greedy text equal: {same}\n"
    )
    print("| experts computed by | tok/s | % of limit | experts ms / token | experts % of their limit |")
    print("|---|---|---|---|---|")
    for variant, runs in samples.items():
        b = runs[0]["bytes"]
        share = [s["tok_s"] * b.total / (s["dram"] * 1e9) for s in runs]
        experts = [b.experts / (s["dram"] * 1e9) / (s["experts_ms"] / 1e3) for s in runs]
        print(
            f"| {variant} | {statistics.median(s['tok_s'] for s in runs):.2f} | {100 * statistics.median(share):.0f} % "
            f"| {statistics.median(s['experts_ms'] for s in runs):.1f} | {100 * statistics.median(experts):.0f} % |"
        )


if __name__ == "__main__":
    main()
