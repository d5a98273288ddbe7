"""Host store: checkpoint reading, RAM and disk tiers, MXFP4 dequantisation, thread safety."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from fmoe_local.architectures import FusedRow, architecture_for
from fmoe_local.host import GIB, CheckpointFiles, CheckpointHostStore, HostStore, dequantize_mxfp4


def _store(model_dir, host_ram_gb=None, dtype=torch.float32):
    config = AutoConfig.from_pretrained(model_dir)
    arch = architecture_for(config)
    files = CheckpointFiles(model_dir)
    layers = arch.moe_layer_indices(config)
    sources = [[arch.expert_sources(i, e, files) for e in range(arch.num_experts(config))] for i in layers]
    shapes = {"gate_up_proj": (2 * 32, 64), "down_proj": (64, 32)}  # tiny models: hidden 64, expert intermediate 32
    return CheckpointHostStore(files, sources, shapes, dtype, host_ram_gb), files, layers


def test_dequantize_mxfp4_known_values():
    # One row, one group of 32 values: byte 0x21 holds codes 1 (low nibble, first) and 2 (high nibble).
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x21
    blocks[0, 0, 1] = 0xF9  # codes 9 (-0.5) then 15 (-6.0)
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2 ** (128 - 127) = 2
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out.shape == (1, 32)
    assert out[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0]
    assert not out[0, 4:].any()


def test_dequantize_mxfp4_matches_transformers_layout():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 2, 16), dtype=torch.uint8, generator=gen)  # [E, out, G, B]
    scales = torch.randint(120, 134, (3, 6, 2), dtype=torch.uint8, generator=gen)
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    for e in range(3):
        mine = dequantize_mxfp4(blocks[e], scales[e], torch.float32).reshape(6, -1)  # [out, in]
        torch.testing.assert_close(mine.t(), reference[e], rtol=0, atol=0)


def test_checkpoint_files_single_and_sharded(tiny_model_dir):
    single = CheckpointFiles(tiny_model_dir("olmoe"))
    sharded = CheckpointFiles(tiny_model_dir("olmoe", sharded=True))
    assert set(single.keys()) == set(sharded.keys())
    assert len(set(sharded.key_file.values())) >= 2
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    torch.testing.assert_close(single.get(key), sharded.get(key), rtol=0, atol=0)
    full = sharded.get("model.embed_tokens.weight")
    assert torch.equal(sharded.get_row("model.embed_tokens.weight", 7), full[7])
    assert sharded.shape("model.embed_tokens.weight") == tuple(full.shape)
    single.close()
    sharded.close()


def test_checkpoint_files_missing_weights_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="No safetensors weights"):
        CheckpointFiles(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="incomplete"):
        CheckpointFiles(tmp_path)


def test_ram_tier_rows_are_the_checkpoint_tensors(tiny_model_dir):
    d = tiny_model_dir("mixtral")
    store, files, layers = _store(d)
    assert isinstance(store, HostStore)
    assert (store.num_layers, store.num_experts, store.ram_experts) == (4, 8, 32)
    base = f"model.layers.{layers[2]}.block_sparse_moe.experts.6"
    rows = store.read(2, 6)
    expected = torch.cat([files.get(f"{base}.w1.weight"), files.get(f"{base}.w3.weight")])
    assert torch.equal(rows["gate_up_proj"], expected)
    assert torch.equal(rows["down_proj"], files.get(f"{base}.w2.weight"))
    assert store.expert_bytes == (64 * 64 + 64 * 32) * 4
    with pytest.raises(IndexError):
        store.read(4, 0)
    store.close()


@pytest.mark.parametrize("experts_in_ram", [0, 5])
def test_disk_tier_returns_the_same_tensors(tiny_model_dir, experts_in_ram):
    d = tiny_model_dir("qwen3_moe", sharded=True)
    full, _, _ = _store(d)
    budget_gb = experts_in_ram * full.expert_bytes / GIB
    lazy, _, _ = _store(d, host_ram_gb=budget_gb)
    assert lazy.ram_experts == experts_in_ram
    assert lazy.in_ram(0, 4) == (experts_in_ram > 4) and not lazy.in_ram(2, 7)
    for layer in range(full.num_layers):
        for expert in range(full.num_experts):
            a, b = full.read(layer, expert), lazy.read(layer, expert)
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]) and b[name].device.type == "cpu"
    full.close()
    lazy.close()


def test_rows_are_cast_to_the_compute_dtype(tiny_model_dir):
    store, files, layers = _store(tiny_model_dir("deepseek_v2"), host_ram_gb=0, dtype=torch.bfloat16)
    rows = store.read(1, 2)
    assert all(t.dtype == torch.bfloat16 for t in rows.values())
    down = files.get(f"model.layers.{layers[1]}.mlp.experts.2.down_proj.weight")
    assert torch.equal(rows["down_proj"], down.to(torch.bfloat16))
    assert store.expert_bytes == (64 * 64 + 64 * 32) * 2
    store.close()


def test_concurrent_reads_from_the_disk_tier(tiny_model_dir):
    d = tiny_model_dir("olmoe", sharded=True)
    ram, _, _ = _store(d)
    disk, _, _ = _store(d, host_ram_gb=0)
    keys = [(layer, expert) for layer in range(ram.num_layers) for expert in range(ram.num_experts)] * 4
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda k: (k, disk.read(*k)), keys))
    for key, rows in results:
        for name, t in ram.read(*key).items():
            assert torch.equal(rows[name], t)
    ram.close()
    disk.close()


def test_fused_rows_are_read_one_expert_at_a_time(tmp_path):
    fused = torch.arange(4 * 3 * 2, dtype=torch.float32).reshape(4, 3, 2)
    save_file({"model.layers.0.mlp.experts.down_proj": fused}, str(tmp_path / "model.safetensors"))
    files = CheckpointFiles(tmp_path)
    sources = [[{"down_proj": FusedRow("model.layers.0.mlp.experts.down_proj", e)} for e in range(4)]]
    store = CheckpointHostStore(files, sources, {"down_proj": (3, 2)}, torch.float32, host_ram_gb=0)
    assert torch.equal(store.read(0, 2)["down_proj"], fused[2])
    wrong = CheckpointHostStore(files, sources, {"down_proj": (2, 3)}, torch.float32, host_ram_gb=0)
    with pytest.raises(ValueError, match="does not match its config.json"):
        wrong.read(0, 1)
    store.close()


class _Locks:
    """register / unregister as CudaStreams offers them, recording each block; `fail_after` registrations work."""

    def __init__(self, fail_after: int = 10**9) -> None:
        self.blocks: list[torch.Tensor] = []
        self.released: list[torch.Tensor] = []
        self.fail_after = fail_after

    def register(self, block: torch.Tensor) -> None:
        if len(self.blocks) >= self.fail_after:
            raise RuntimeError("cudaHostRegister failed")
        self.blocks.append(block)

    def unregister(self, block: torch.Tensor) -> None:
        self.released.append(block)

    def holds(self, t: torch.Tensor) -> bool:
        return any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() for b in self.blocks)


def _all_rows(store) -> dict:
    keys = [(layer, e) for layer in range(store.num_layers) for e in range(store.num_experts)]
    return {key: {k: v.clone() for k, v in store.read(*key).items()} for key in keys}


def test_pinning_moves_ram_experts_into_one_block_per_layer_within_the_budget(tiny_model_dir):
    store, _, _ = _store(tiny_model_dir("mixtral"), dtype=torch.bfloat16)
    before = _all_rows(store)
    J, locks = store.num_experts, _Locks()
    budget = int(1.5 * J * store.expert_bytes)  # one whole layer and half of the next
    pinned = store.pin(budget, locks.register, locks.unregister)
    assert len(locks.blocks) == 2 and pinned == store.pinned_bytes == sum(b.numel() for b in locks.blocks) <= budget
    inside = {k for k in before if all(locks.holds(t) for t in store.read(*k).values())}
    assert inside == {(0, e) for e in range(J)} | {(1, e) for e in range(J // 2)}
    for key, rows in before.items():  # the same weights, wherever they live now
        got = store.read(*key)
        assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in rows.items())
    with pytest.raises(RuntimeError, match="already pinned"):
        store.pin(budget, locks.register, locks.unregister)
    store.close()
    assert [b.data_ptr() for b in locks.released] == [b.data_ptr() for b in reversed(locks.blocks)]


def test_a_block_that_cannot_be_pinned_keeps_its_experts_and_pinning_stops(tiny_model_dir):
    store, _, _ = _store(tiny_model_dir("olmoe"))
    before = _all_rows(store)
    locks = _Locks(fail_after=1)
    pinned = store.pin(10 * GIB, locks.register, locks.unregister)
    assert len(locks.blocks) == 1 and pinned == locks.blocks[0].numel()
    for key, rows in before.items():
        assert all(torch.equal(store.read(*key)[n], t) for n, t in rows.items())
    assert store.in_ram(store.num_layers - 1, 0)  # later layers still in (plain) RAM


def test_only_the_ram_tier_is_pinned(tiny_model_dir):
    store, _, _ = _store(tiny_model_dir("mixtral"), host_ram_gb=0)
    locks = _Locks()
    assert store.pin(10 * GIB, locks.register, locks.unregister) == 0 and locks.blocks == []


def test_by_default_the_host_holds_what_available_ram_allows_and_reads_the_rest_from_disk(tiny_model_dir, monkeypatch):
    from fmoe_local import hardware
    from fmoe_local.config import RuntimeConfig
    from fmoe_local.loading import load_model

    d = tiny_model_dir("qwen3_moe")
    full = load_model(d, RuntimeConfig(device="cpu", cache_experts=2))  # this machine's RAM holds every expert
    every = full.host.num_layers * full.host.num_experts
    assert full.host.ram_experts == every
    # A machine with 7 experts' worth of RAM above the headroom: 7 in RAM, the rest read per use, same tensors.
    room = 7 * full.host.expert_bytes + hardware.RAM_HEADROOM_BYTES
    monkeypatch.setattr(hardware, "ram_bytes", lambda: (64 * hardware.GIB, room))
    tight = load_model(d, RuntimeConfig(device="cpu", cache_experts=2))
    assert tight.host.ram_experts == 7 and not tight.host.in_ram(full.host.num_layers - 1, 0)
    for layer, expert in ((0, 0), (full.host.num_layers - 1, full.host.num_experts - 1)):
        a, b = full.host.read(layer, expert), tight.host.read(layer, expert)
        assert all(torch.equal(a[k], b[k]) for k in a)
    # On the CPU the expert cache comes out of the same RAM: a 1 GB cache leaves nothing of that room for experts.
    assert load_model(d, RuntimeConfig(device="cpu", cache_gb=1.0)).host.ram_experts == 0
    monkeypatch.setattr(hardware, "ram_bytes", lambda: (0, 0))  # a platform that does not say: every expert
    assert load_model(d, RuntimeConfig(device="cpu", cache_experts=2)).host.ram_experts == every


def test_a_store_that_lacks_a_capability_gets_the_dense_answer_from_host_store():
    class Bare(HostStore):
        num_layers, num_experts, param_shapes, param_dtype, expert_bytes = 1, 2, {"w": (2, 3)}, torch.float32, 24

        def read(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
            return {"w": torch.zeros(2, 3)}

        def close(self) -> None:
            pass

    store, rows = Bare(), {"w": torch.ones(2, 3)}
    assert store.view(rows) is rows and store.land(rows) is None and torch.equal(rows["w"], torch.ones(2, 3))
    assert store.pin(10**9, lambda block: None, lambda block: None) == 0
    assert not store.in_ram(0, 1)  # a read that may touch the disk: bounded by a deadline (cpu_experts.HostExperts)
    assert dict(store.param_dtypes) == {} and store.dense_shapes == {"w": (2, 3)}
    assert (store.expert_format, store.notice) == ("bf16", "")
