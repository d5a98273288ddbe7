"""Dense formats: which linear layers are packed, the `auto` rule, the refusals, and lossless — with dense_format
int8 and int4 on a CPU device the offloaded model generates exactly the greedy tokens of transformers eager whose
dense linear weights AND routed experts are replaced by their dequantised values (`unpack(pack(w))`, the weights the
runtime's products compute with), for every family.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM

from fmoe_local import dense_formats, expert_formats, hardware, openvino_products, quant_cache
from fmoe_local.architectures import architecture_for
from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.dense_formats import PackedLinear
from fmoe_local.dtype_verdicts import DtypeVerdicts
from fmoe_local.loading import load_model
from fmoe_local.runtime import Runtime
from fmoe_local.safetensors_file import DamagedFile, SafetensorsFile
from tests.test_runtime_quantized import NEW_TOKENS, PROMPT, dequantise_experts
from tests.tiny import FAMILIES

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@torch.no_grad()
def dequantise_dense(model: nn.Module, fmt: str) -> list[str]:
    """Replace the weight of every linear layer a packed dense format packs with `unpack(pack(w))` in `fmt`; returns
    their names. A tied output head gets a weight of its own (the runtime packs a copy, the input table stays)."""
    arch = architecture_for(model.config)
    names = []
    for name, linear in dense_formats.candidates(model, arch, arch.moe_layers(model)).items():
        out_f, in_f = linear.weight.shape
        if not dense_formats.packs(fmt, out_f, in_f):
            continue
        param = expert_formats.PackedParam(fmt, (out_f, in_f))
        parts = expert_formats.pack(param, linear.weight, linear.weight.dtype)
        linear.weight = nn.Parameter(expert_formats.unpack(param, parts, linear.weight.dtype), requires_grad=False)
        names.append(name)
    return names


@torch.no_grad()
def reference_tokens(model_dir, fmt: str, ids: torch.Tensor, tied: bool = False) -> tuple[list[int], list[str]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32).eval()
    table = model.get_input_embeddings().weight.clone()
    dequantise_experts(model, fmt)
    names = dequantise_dense(model, fmt)
    if tied:  # the input table stays unpacked: only the head reads the dequantised copy
        assert torch.equal(model.get_input_embeddings().weight, table)
    out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return out[0, ids.shape[1] :].tolist(), names


def _config(fmt: str, tmp_path, **changes) -> RuntimeConfig:
    """A CPU load with experts and dense weights in `fmt` (`changes` override). Torch's int8 product unless a test
    asks for another: OpenVINO's compiles every weight at every load (~40 ms each here), and the tests of the dense
    copy load three times each; the exactness tests run both products."""
    config = RuntimeConfig(
        device="cpu",
        cache_experts=1,
        expert_format=fmt,
        dense_format=fmt,
        dense_int8_product="torch",
        quant_cache_dir=str(tmp_path),
        sampling=Sampling(greedy=True, max_new_tokens=NEW_TOKENS),
    )
    return config.with_changes(**changes)


# int8 with each of its products (torch's `_weight_int8pack_mm`, OpenVINO's: openvino_products.py); int4 has torch's.
PRODUCTS = [("int8", "torch"), ("int8", "openvino"), ("int4", "torch")]


@pytest.mark.parametrize(("fmt", "product"), PRODUCTS, ids=[f"{f}-{p}" for f, p in PRODUCTS])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_dense_layers_give_eager_s_tokens_on_the_dequantised_weights(
    family, fmt, product, tiny_model_dir, tmp_path
):
    model_dir = tiny_model_dir(family)
    config = _config(fmt, tmp_path, dense_int8_product=product)
    with Runtime.load(model_dir, config) as runtime:
        engine = runtime.engine
        assert runtime.info.dense_format == fmt and runtime.info.dense_product == (product if fmt == "int8" else "")
        ids = engine.encode_prompt(PROMPT)
        expected, names = reference_tokens(model_dir, fmt, ids)
        packed = [n for n, m in engine.model.named_modules() if isinstance(m, PackedLinear)]
        assert packed == names and "lm_head" in packed  # the reference dequantised exactly what the runtime packs
        for policy, misses in (("on_demand", "cpu"), ("fmoe", "copy")):
            runtime.reconfigure(cache_experts=engine.shape.top_k, policy=policy, miss_handling=misses)
            final = runtime.generate(PROMPT)
            assert final.token_ids == expected[: len(final.token_ids)], f"{family} {fmt} {product} {policy} {misses}"
            assert len(final.token_ids) == NEW_TOKENS or final.token_ids[-1] in engine.eos_ids


@pytest.mark.skipif(bool(openvino_products.unavailable()), reason="needs openvino importable")
def test_auto_asks_one_verdict_per_weight_size_and_the_head_alone_can_be_openvino_s(
    tiny_model_dir, tmp_path, monkeypatch
):
    """An output head streams faster with OpenVINO where an attention projection is slower (docs/bench.md, session
    23): each size class has its verdict, asked once, and a load with both gives eager's tokens."""
    model_dir = tiny_model_dir("qwen3_moe")
    config = _config("int8", tmp_path, dense_int8_product="auto")
    with Runtime.load(model_dir, config.with_changes(dense_int8_product="torch")) as runtime:
        head = runtime.engine.model.lm_head.q.numel()  # the tiny model's largest weight: "large" here
    monkeypatch.setattr(openvino_products, "size_class", lambda codes: "large" if codes >= head else "small")
    asked: list[tuple[object, str]] = []
    ratios = {"small": 2.0, "large": 0.5}
    verdicts = DtypeVerdicts(
        None,
        "machine A",
        half_ratio=lambda dtype: 2.0,  # float32 compute: no dtype probe runs
        products_ratio=lambda fmt: math.inf,
        openvino_ratio=lambda dtype, size: asked.append((dtype, size)) or ratios[size],
    )
    with Runtime.load(model_dir, config, dtype_verdicts=verdicts) as runtime:
        engine = runtime.engine
        products = {n: m.product is not None for n, m in engine.model.named_modules() if isinstance(m, PackedLinear)}
        assert products.pop("lm_head") and products and not any(products.values())
        assert runtime.info.dense_product == "openvino, torch"
        assert engine.dense_repacked_bytes == round(head * openvino_products.REPACK_BYTES_PER_CODE)
        assert asked == [(engine.dtype, "small"), (engine.dtype, "large")]  # once per size, in the order met
        expected, _ = reference_tokens(model_dir, "int8", engine.encode_prompt(PROMPT))
        runtime.reconfigure(cache_experts=engine.shape.top_k, policy="on_demand", miss_handling="cpu")
        final = runtime.generate(PROMPT)
        assert final.token_ids == expected[: len(final.token_ids)]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_tied_head_is_packed_as_its_own_copy_and_the_input_table_stays(fmt, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("mixtral", tied=True)
    with Runtime.load(model_dir, _config(fmt, tmp_path)) as runtime:
        model = runtime.engine.model
        table = model.get_input_embeddings().weight
        assert isinstance(model.get_output_embeddings(), PackedLinear)
        assert table.dtype == torch.float32 and table.shape == (model.config.vocab_size, model.config.hidden_size)
        expected, _ = reference_tokens(model_dir, fmt, runtime.engine.encode_prompt(PROMPT), tied=True)
        runtime.reconfigure(cache_experts=runtime.engine.shape.top_k, policy="on_demand", miss_handling="cpu")
        final = runtime.generate(PROMPT)
        assert final.token_ids == expected[: len(final.token_ids)]


def test_routers_gates_embeddings_and_norms_stay_and_the_rest_is_packed(tiny_model_dir, tmp_path):
    # Qwen2-MoE has them all: attention with biases, a shared expert and its one-logit gate, a router, an untied head.
    loaded = load_model(tiny_model_dir("qwen2_moe"), _config("int8", tmp_path), CPU)
    model = loaded.model
    assert loaded.dense_format == "int8"
    block = model.model.layers[0].mlp
    for module in (block.gate, block.shared_expert_gate, model.model.embed_tokens, model.model.norm):
        assert not isinstance(module, PackedLinear)
    attn = model.model.layers[0].self_attn
    for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, block.shared_expert.down_proj, model.lm_head):
        assert isinstance(module, PackedLinear) and module.q.dtype == torch.int8
    assert attn.q_proj.bias is not None  # Qwen2's attention biases are kept, in the compute dtype


def test_int4_leaves_a_weight_its_product_cannot_take_unpacked(tiny_model_dir, tmp_path):
    # Qwen2-MoE's tiny shared expert: down_proj is [64, 48], and 48 is no multiple of the 32-weight group.
    loaded = load_model(tiny_model_dir("qwen2_moe"), _config("int4", tmp_path), CPU)
    shared = loaded.model.model.layers[0].mlp.shared_expert
    assert isinstance(shared.gate_proj, PackedLinear) and type(shared.down_proj) is nn.Linear


def test_packed_dense_weights_count_at_their_stored_size(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("olmoe")
    sizes, repacked = {}, 0
    for fmt, product in (("bf16", "auto"), ("int8", "torch"), ("int4", "auto"), ("int8-openvino", "openvino")):
        dense = fmt.removesuffix("-openvino")
        config = _config("bf16", tmp_path, dense_format=dense, dense_int8_product=product)
        with Runtime.load(model_dir, config) as runtime:
            sizes[fmt] = runtime.info.resident_bytes
            repacked = runtime.info.dense_repacked_bytes
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    linears = [m.weight for n, m in plain.named_modules() if type(m) is nn.Linear]  # OLMoE's router is no nn.Linear
    dense = sum(w.numel() * 4 for w in linears)
    int8 = sum(w.numel() + 4 * w.shape[0] for w in linears)  # int8 codes and a float32 scale per row
    int4 = sum(
        w.numel() // 2 + (w.shape[1] // 64) * w.shape[0] * 2 * 4 for w in linears
    )  # codes, float32 (scale, zero)
    assert sizes["int8"] == sizes["bf16"] - dense + int8
    assert sizes["int4"] == sizes["bf16"] - dense + int4
    # OpenVINO's product holds its repacked copy of the int8 codes beside ours (openvino_products.py): counted in RAM.
    codes = sum(w.numel() for w in linears)
    assert repacked == codes and sizes["int8-openvino"] == sizes["int8"] + codes


def test_auto_follows_int8_and_int4_experts_on_a_cpu_only():
    for fmt in ("int8", "int4"):
        assert dense_formats.resolve("auto", CPU, fmt) == fmt
        assert dense_formats.resolve("auto", CUDA, fmt) == "bf16"
    for fmt in ("bf16", "nf4", "mxfp4"):
        assert dense_formats.resolve("auto", CPU, fmt) == "bf16"
    assert dense_formats.resolve("bf16", CPU, "int8") == "bf16"
    assert dense_formats.resolve("int4", CPU, "bf16") == "int4"


def test_auto_packs_the_dense_layers_of_a_cpu_load_with_int8_experts(tiny_model_dir, tmp_path):
    config = _config("int8", tmp_path, dense_format="auto")
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        assert runtime.info.dense_format == "int8"
        assert isinstance(runtime.engine.model.lm_head, PackedLinear)
    with Runtime.load(tiny_model_dir("mixtral"), _config("bf16", tmp_path, dense_format="auto")) as runtime:
        assert runtime.info.dense_format == "bf16" and type(runtime.engine.model.lm_head) is nn.Linear


def test_an_unknown_dense_format_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="Unknown dense format 'q3'") as caught:
        RuntimeConfig(dense_format="q3").validate()
    assert all(word in str(caught.value) for word in ("auto", "bf16", "int8", "int4"))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_packed_dense_format_on_a_gpu_is_refused_before_any_weight_is_read(fmt, tiny_model_dir, tmp_path):
    # torch.device("cuda") needs no GPU to exist: the refusal comes before anything is put on it.
    with pytest.raises(ValueError, match=f"Dense format {fmt} runs on a CPU device only") as caught:
        load_model(tiny_model_dir("mixtral"), _config(fmt, tmp_path), CUDA)
    assert "auto or bf16" in str(caught.value)


def test_a_weight_the_model_keeps_in_float32_is_left_as_it_is(tiny_model_dir, tmp_path):
    # None of the families keeps a linear layer in float32 today; the rule is transformers' (hf_internals.keep_in_fp32).
    loaded = load_model(tiny_model_dir("olmoe"), _config("int8", tmp_path, dense_format="bf16"), CPU)
    model = loaded.model
    report = dense_formats.quantise(model, loaded.arch, loaded.moe_layers, "int8", lambda n: n == "lm_head.weight")
    assert type(model.lm_head) is nn.Linear and report.kept == {"lm_head": "kept in float32 by the model"}
    assert isinstance(model.model.layers[0].self_attn.q_proj, PackedLinear) and "lm_head" not in report.packed


class _CountingPacker:
    """expert_formats.pack, counting its calls (experts' and dense weights' alike: one packer for both)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        self._real = expert_formats.pack
        monkeypatch.setattr(expert_formats, "pack", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._real(*args, **kwargs)


def _dense_file(tmp_path, fmt: str):
    (path,) = tmp_path.glob(f"*-{fmt}-float32/{quant_cache.DENSE_FILE}")
    return path


def _packed_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{n}.{b}": t for n, m in model.named_modules() if isinstance(m, PackedLinear) for b, t in m.named_buffers()
    }


def _load_and_generate(model_dir, config) -> tuple[list[int], dict[str, torch.Tensor]]:
    with Runtime.load(model_dir, config) as runtime:
        return runtime.generate(PROMPT).token_ids, _packed_state(runtime.engine.model)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_second_load_reads_the_packed_dense_weights_and_packs_nothing(fmt, tiny_model_dir, tmp_path, monkeypatch):
    model_dir, config = tiny_model_dir("qwen2_moe"), _config(fmt, tmp_path, dense_format="auto")
    packer = _CountingPacker(monkeypatch)
    first, first_state = _load_and_generate(model_dir, config)
    assert packer.calls > 0 and _dense_file(tmp_path, fmt).is_file()
    packer.calls = 0
    second, second_state = _load_and_generate(model_dir, config)
    assert packer.calls == 0  # neither an expert (their copy) nor a dense weight (dense.safetensors) was packed
    assert second == first
    assert first_state.keys() == second_state.keys() and len(first_state) > 0
    assert all(torch.equal(first_state[k], second_state[k]) for k in first_state)  # int4's CPU layout included


def _contents(path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    file = SafetensorsFile(path)
    try:
        return file.metadata, {k: file.get(k) for k in file.keys()}
    finally:
        file.close()


def _cut_short(path):
    path.write_bytes(path.read_bytes()[:-100])


def _garbage(path):
    path.write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00{not json at all, but 32 bytes}" + b"\0" * 64)


def _bad_header(path):
    header = b'{"x": {"dtype": "I8", "shape": [1]}}'  # JSON, but no data_offsets
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def _another_model_s(path):
    file = SafetensorsFile(path)
    tensors = {k: file.get(k) for k in file.keys()}
    file.close()
    tensors.pop(sorted(tensors)[0])  # one module fewer: e.g. written by a version that packed another set
    save_file(tensors, str(path), metadata={"format": "pt", "dense_format": file.metadata["dense_format"]})


def _another_format_s(path):
    file = SafetensorsFile(path)
    tensors = {k: file.get(k) for k in file.keys()}
    file.close()
    save_file(tensors, str(path), metadata={"format": "pt", "dense_format": "int2"})


@pytest.mark.parametrize("damage", [_cut_short, _garbage, _bad_header, _another_model_s, _another_format_s])
def test_a_damaged_or_foreign_dense_file_is_packed_again_and_written_over(
    damage, tiny_model_dir, tmp_path, monkeypatch
):
    model_dir, config = tiny_model_dir("qwen2_moe"), _config("int8", tmp_path)
    first, first_state = _load_and_generate(model_dir, config)
    path = _dense_file(tmp_path, "int8")
    whole = _contents(path)
    damage(path)
    packer = _CountingPacker(monkeypatch)
    again, state = _load_and_generate(model_dir, config)
    assert packer.calls == len(first_state) // 2  # every dense weight (int8: q and scale each) packed again
    assert again == first and all(torch.equal(first_state[k], state[k]) for k in first_state)
    kept = _contents(path)  # written over with what the first load wrote (the header's order may differ)
    assert kept[0] == whole[0] and kept[1].keys() == whole[1].keys()
    assert all(torch.equal(kept[1][k], whole[1][k]) for k in kept[1])
    packer.calls = 0
    _load_and_generate(model_dir, config)
    assert packer.calls == 0


def test_a_dense_file_that_fails_while_read_is_packed_for_the_rest_and_removed(tiny_model_dir, tmp_path, monkeypatch):
    model_dir, config = tiny_model_dir("qwen2_moe"), _config("int8", tmp_path)
    first, first_state = _load_and_generate(model_dir, config)
    path = _dense_file(tmp_path, "int8")
    real_get, reads = SafetensorsFile.get, []

    def fails_on_the_third(self, key):
        if self.path == path:
            reads.append(key)
            if len(reads) == 3:  # after its header was checked: a disk error, a file shortened meanwhile
                raise DamagedFile(f"The model file {path.name} is damaged (it is shorter than its header says).")
        return real_get(self, key)

    monkeypatch.setattr(SafetensorsFile, "get", fails_on_the_third)
    packer = _CountingPacker(monkeypatch)
    again, state = _load_and_generate(model_dir, config)
    assert 0 < packer.calls < len(first_state) // 2  # the first module came from the file, the rest was packed
    assert again == first and all(torch.equal(first_state[k], state[k]) for k in first_state)
    assert not path.exists()  # the next load packs and writes it whole


def test_a_killed_write_leaves_no_dense_file_that_is_read(tiny_model_dir, tmp_path, monkeypatch):
    model_dir, config = tiny_model_dir("qwen2_moe"), _config("int4", tmp_path)
    real_save = quant_cache.save_file

    def killed_inside(tensors, path, metadata=None):
        if path.endswith(f"{quant_cache.DENSE_FILE}.partial"):
            Path(path).write_bytes(b"half the dense weights")  # what a kill mid-write leaves
            raise KeyboardInterrupt
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(quant_cache, "save_file", killed_inside)
    with pytest.raises(KeyboardInterrupt):
        Runtime.load(model_dir, config)
    monkeypatch.setattr(quant_cache, "save_file", real_save)
    (folder,) = tmp_path.iterdir()
    assert [p.name for p in folder.iterdir()] == [f"{quant_cache.DENSE_FILE}.partial"]
    packer = _CountingPacker(monkeypatch)
    tokens, _ = _load_and_generate(model_dir, config)
    assert packer.calls > 0  # the half file was not read: everything packed
    assert (folder / quant_cache.DENSE_FILE).is_file() and not list(folder.glob("*.partial"))
    clean, _ = _load_and_generate(model_dir, _config("int4", tmp_path / "clean"))
    assert tokens == clean


def test_a_dense_file_that_cannot_be_kept_costs_the_next_load_only(tiny_model_dir, tmp_path, monkeypatch):
    # bf16 experts, int8 dense weights: the dense file is the copy's only file.
    model_dir, config = tiny_model_dir("qwen2_moe"), _config("int8", tmp_path, expert_format="bf16")
    real_save = quant_cache.save_file

    def disk_full(tensors, path, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(quant_cache, "save_file", disk_full)
    failed, _ = _load_and_generate(model_dir, config)
    assert not list(tmp_path.rglob("*.safetensors*"))  # nothing kept, nothing half-written
    monkeypatch.setattr(quant_cache, "save_file", real_save)
    monkeypatch.setattr(hardware, "disk_free_bytes", lambda path: hardware.DISK_MARGIN_BYTES)  # the margin, no more
    short, _ = _load_and_generate(model_dir, config)
    assert list(tmp_path.iterdir()) == []  # not even a folder
    monkeypatch.undo()
    packer = _CountingPacker(monkeypatch)
    kept, _ = _load_and_generate(model_dir, config)
    assert packer.calls > 0 and _dense_file(tmp_path, "int8").is_file()
    assert failed == short == kept
