"""cpu_experts.py: every kernel computes the expert eager computes (to its precision), the choice takes the fastest
measured one, and the host path's reads are bounded like the cache's loads."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fmoe_local import cpu_experts
from fmoe_local.cache import ExpertLoadError
from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.cpu_experts import KERNELS, NATIVE, HostExperts, KernelTiming, choose, expert_forward, kernels_for
from fmoe_local.engine import Engine
from fmoe_local.runtime import Runtime
from fmoe_local.runtime_types import Finished

PROMPT = [{"role": "user", "content": "Tell me about the ocean and the waves."}]
# Relative error of the whole expert's output against fp32 eager, per format (rounding of weights and activations).
FLOAT = ("fp32", "bf16", "fp16")
TOLERANCE = {"fp32": 1e-6, "bf16": 3e-2, "fp16": 3e-3, "int8": 5e-2, "int4": 0.3}


def _engine(tiny_model_dir, family: str, **changes) -> Engine:
    config = RuntimeConfig(device="cpu", cache_experts=4, policy="lru", synchronous_prefetch=True)
    return Engine.build(tiny_model_dir(family), config.with_changes(**changes))


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "qwen2_moe"])  # gated, transposed with biases, shared
def test_every_kernel_computes_the_eager_expert_to_its_precision(family, tiny_model_dir):
    engine = _engine(tiny_model_dir, family)
    try:
        module = engine.moe_layers[0].experts
        rows = engine.host.read(0, 3)  # fp32 [out, in] rows (GPT-OSS: [in, out])
        transposed = bool(module.is_transposed)
        x = torch.randn(5, engine.shape.embed_dim, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            expected = expert_forward(module, x, rows)  # eager's ops on the fp32 copy
            assert torch.equal(expected, expert_forward(module, x, rows, NATIVE))
            for fmt, kernels in KERNELS.items():
                for kernel in kernels:
                    if transposed and kernel.matmul is None:
                        continue
                    # The matrices in the format; biases too for the float formats (a host store holds them in
                    # its dtype), in fp32 for the packed ones.
                    packed = {n: kernel.pack(w) if w.dim() == 2 or fmt in FLOAT else w for n, w in rows.items()}
                    got = expert_forward(module, x, packed, kernel).float()
                    err = (got - expected).norm() / expected.norm()
                    assert err < TOLERANCE[fmt], f"{kernel.name}: relative error {err:.2e}"
    finally:
        engine.close()


def test_kernels_for_names_the_format_it_does_not_know_and_the_layout_it_cannot_read():
    with pytest.raises(ValueError, match="Known formats"):
        kernels_for("fp8")
    assert all(k.matmul is not None for k in kernels_for("bf16", transposed=True))
    with pytest.raises(ValueError, match="miss handling copy"):
        kernels_for("int8", transposed=True)


def test_choose_takes_the_fastest_at_one_token():
    kernels = kernels_for("bf16")
    timings = [KernelTiming(k.name, 1, s, 100) for k, s in zip(kernels, (3e-3, 1e-3, 2e-3), strict=True)]
    assert choose(timings, kernels).name == kernels[1].name
    assert timings[1].gbps == pytest.approx(100 / 1e-3 / 1e9)


def test_time_kernel_cycles_through_every_expert_and_keeps_the_best_pass(monkeypatch):
    calls: list[int] = []
    ticks = iter([0.0, 4.0, 10.0, 12.0])  # two passes of 2 experts: 4 s, then 2 s

    class Module(torch.nn.Module):
        is_transposed, has_bias, has_gate = False, False, False

        def act_fn(self, h):  # noqa: ANN001, ANN201
            return h

    experts = [{"up_proj": torch.eye(4) * i, "down_proj": torch.eye(4)} for i in range(2)]
    real = cpu_experts.expert_forward

    def counted(module, x, rows, kernel=NATIVE):  # noqa: ANN001, ANN202
        calls.append(int(rows["up_proj"][0, 0]))
        return real(module, x, rows, kernel)

    monkeypatch.setattr(cpu_experts, "expert_forward", counted)
    t = cpu_experts.time_kernel(NATIVE, Module(), experts, 4, passes=2, clock=lambda: next(ticks))
    assert calls == [0, 0, 1, 0, 1]  # one warm-up, then every expert in each pass
    assert t.seconds == 1.0 and t.bytes_per_expert == 2 * 16 * 4


def test_a_disk_tier_read_that_fails_is_a_sentence(tiny_model_dir):
    engine = _engine(tiny_model_dir, "olmoe", host_ram_gb=0.0)
    try:
        host_experts = HostExperts(engine.host)

        def broken(layer, expert):  # noqa: ANN001, ANN202
            raise OSError(5, "Input/output error")

        engine.host.read = broken
        with pytest.raises(ExpertLoadError, match="Could not read expert 2 of MoE layer 1.*download the model again"):
            host_experts.rows(1, 2, threading.Event(), 5.0)
        host_experts.close()
    finally:
        engine.close()


def test_a_disk_read_past_its_deadline_leaves_the_next_reads_a_thread_of_their_own(tiny_model_dir):
    # Before: the reader's one thread stayed in the hung read, and every later CPU-computed miss read from the disk
    # tier waited out its deadline behind it.
    from fmoe_local.copier import LoadTimeout

    engine = _engine(tiny_model_dir, "olmoe", host_ram_gb=0.0)
    try:
        host_experts = HostExperts(engine.host)
        real_read, release = engine.host.read, threading.Event()

        def read(layer, expert):  # noqa: ANN001, ANN202
            if (layer, expert) == (1, 2):
                release.wait(30)
            return real_read(layer, expert)

        engine.host.read = read
        with pytest.raises(LoadTimeout, match="expert 2 of MoE layer 1 took too long"):
            host_experts.rows(1, 2, threading.Event(), 0.3)
        rows = host_experts.rows(1, 3, threading.Event(), 0.3)  # while (1, 2) is still stuck
        assert torch.equal(rows["down_proj"], real_read(1, 3)["down_proj"])
        release.set()
        host_experts.close()
    finally:
        engine.close()


def test_stop_ends_a_request_whose_cpu_miss_is_stuck_in_a_disk_read(tiny_model_dir):
    config = RuntimeConfig(
        device="cpu", cache_experts=3, miss_handling="cpu", host_ram_gb=0.0, sampling=Sampling(greedy=True)
    )
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        host = runtime.engine.host
        real_read = host.read
        entered, release = threading.Event(), threading.Event()

        def read(layer, expert):  # noqa: ANN001, ANN202
            if not release.is_set():
                entered.set()
                release.wait(30)
            return real_read(layer, expert)

        host.read = read
        request = runtime.submit(PROMPT)
        assert entered.wait(10), "the request never reached the host store"
        t0 = time.perf_counter()
        request.cancel()
        final = request.result(timeout=5)
        assert isinstance(final, Finished) and final.reason == "cancelled"
        assert time.perf_counter() - t0 < 1.0
        release.set()
        again = runtime.generate(PROMPT, Sampling(greedy=True, max_new_tokens=3))
        assert again.reason in ("length", "stop", "context") and again.stats.on_host > 0


def test_a_cpu_miss_whose_read_fails_ends_the_request_with_a_sentence(tiny_model_dir):
    config = RuntimeConfig(device="cpu", cache_experts=3, miss_handling="cpu", host_ram_gb=0.0)
    with Runtime.load(tiny_model_dir("qwen3_moe"), config) as runtime:
        host = runtime.engine.host
        real_read, failing = host.read, {"on": True}

        def read(layer, expert):  # noqa: ANN001, ANN202
            if failing["on"] and layer == 1:
                raise OSError(5, "Input/output error")
            return real_read(layer, expert)

        host.read = read
        final = runtime.generate(PROMPT, Sampling(greedy=True, max_new_tokens=4))
        assert final.reason == "error" and "Could not read expert" in final.error and "MoE layer 1" in final.error
        failing["on"] = False
        assert runtime.generate(PROMPT, Sampling(greedy=True, max_new_tokens=4)).reason in ("length", "stop", "context")
