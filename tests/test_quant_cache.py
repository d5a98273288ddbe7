"""The quantise-on-load cache: built once, read on the next load, rebuilt for another format or a changed checkpoint,
resumed after an interrupted build, never read half-written."""

from __future__ import annotations

import os
import shutil
from functools import partial

import pytest
import torch
from safetensors import SafetensorError

from fmoe_local import dtype_verdicts, expert_formats, hardware, quant_cache
from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.loading import load_model
from fmoe_local.quant_cache import QuantCache
from fmoe_local.runtime import Runtime
from fmoe_local.safetensors_file import SafetensorsFile
from tests.test_runtime_quantized import NEW_TOKENS, PROMPT

REAL_SAVE = quant_cache.save_file


def _load(model_dir, root, fmt="nf4"):
    return load_model(model_dir, RuntimeConfig(expert_format=fmt, quant_cache_dir=str(root)), "cpu", None)


def _stored(host):
    return {(layer, e): host.read(layer, e) for layer in range(host.num_layers) for e in range(host.num_experts)}


def test_second_load_reads_the_cache_and_gets_the_same_experts(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("olmoe")
    first = _load(model_dir, tmp_path)
    cache = first.host.quant_cache
    assert cache.quantised_layers == first.host.num_layers and cache.missing_layers() == []
    built = _stored(first.host)
    first.host.close()
    second = _load(model_dir, tmp_path)
    assert second.host.quant_cache.quantised_layers == 0 and second.host.quant_cache.dir == cache.dir
    again = _stored(second.host)
    assert built.keys() == again.keys()
    assert all(torch.equal(built[k][n], again[k][n]) for k in built for n in built[k])
    second.host.close()


def test_another_format_or_a_changed_checkpoint_gets_its_own_copy(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("mixtral"), model_dir)
    nf4 = _load(model_dir, tmp_path / "q")
    int8 = _load(model_dir, tmp_path / "q", "int8")
    assert int8.host.quant_cache.dir != nf4.host.quant_cache.dir and int8.host.quant_cache.quantised_layers > 0
    weights = model_dir / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # rewritten in place
    changed = _load(model_dir, tmp_path / "q")
    assert changed.host.quant_cache.dir != nf4.host.quant_cache.dir
    assert changed.host.quant_cache.quantised_layers == changed.host.num_layers
    for loaded in (nf4, int8, changed):
        loaded.host.close()


def test_an_interrupted_build_resumes_and_never_reads_a_partial_file(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = tiny_model_dir("qwen2_moe")
    real_write = QuantCache._write

    def dies_on_layer_1(self, layer, tensors):
        if layer == 1:
            partial = self.layer_path(layer).with_name(self.layer_path(layer).name + ".partial")
            partial.write_bytes(b"half a layer")  # what a kill mid-write leaves
            raise KeyboardInterrupt
        real_write(self, layer, tensors)

    monkeypatch.setattr(QuantCache, "_write", dies_on_layer_1)
    with pytest.raises(KeyboardInterrupt):
        _load(model_dir, tmp_path)
    monkeypatch.setattr(QuantCache, "_write", real_write)
    (folder,) = tmp_path.iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["layer-0000.safetensors", "layer-0001.safetensors.partial"]
    seen = []
    resumed = load_model(
        model_dir, RuntimeConfig(expert_format="nf4", quant_cache_dir=str(tmp_path)), "cpu", None,
        lambda done, total: seen.append((done, total)),
    )  # fmt: skip
    cache = resumed.host.quant_cache
    experts, layers = resumed.host.num_experts, resumed.host.num_layers
    # It goes on from the kept layer 0, one expert at a time, to the whole copy: the user sees it continue.
    assert seen == [(done, layers * experts) for done in range(experts, layers * experts + 1)]
    assert cache.quantised_layers == resumed.host.num_layers - 1  # layer 0 was kept
    assert not list(folder.glob("*.partial"))
    clean = _load(model_dir, tmp_path / "clean")
    a, b = _stored(resumed.host), _stored(clean.host)
    assert all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])
    resumed.host.close()
    clean.host.close()


def test_the_temporary_file_safetensors_leaves_when_killed_mid_write_is_removed(tiny_model_dir, tmp_path):
    # save_file writes through `.tmpXXXXXX` in the target's folder and renames it; a kill -9 inside it leaves that
    # file, a layer's size, which no later build reads: every interrupted first load used to leak one for good.
    model_dir = tiny_model_dir("olmoe")
    _load(model_dir, tmp_path).host.close()
    (folder,) = tmp_path.iterdir()
    (folder / "layer-0001.safetensors").unlink()  # the layer being written when the app was killed
    (folder / ".tmpnssLpl").write_bytes(b"\0" * 4096)
    again = _load(model_dir, tmp_path)
    assert again.host.quant_cache.quantised_layers == 1
    assert sorted(p.name for p in folder.iterdir()) == [
        f"layer-{n:04d}.safetensors" for n in range(again.host.num_layers)
    ]
    again.host.close()


def test_runtime_load_reports_each_expert_of_the_first_load_and_nothing_on_the_next(tiny_model_dir, tmp_path):
    config = RuntimeConfig(device="cpu", expert_format="int8", quant_cache_dir=str(tmp_path), cache_experts=2)
    first, again = [], []
    with Runtime.load(tiny_model_dir("olmoe"), config, progress=lambda *p: first.append(p)) as runtime:
        total = runtime.info.num_layers * runtime.info.num_experts
    assert first[0] == (0, total) and first[-1] == (total, total) and len(first) == total + 1
    with Runtime.load(tiny_model_dir("olmoe"), config, progress=lambda *p: again.append(p)):
        pass
    assert again == []  # read from the copy: nothing to wait for


def test_a_damaged_layer_file_is_quantised_again(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("olmoe")
    _load(model_dir, tmp_path).host.close()
    (folder,) = tmp_path.iterdir()
    layer = folder / "layer-0001.safetensors"
    layer.write_bytes(layer.read_bytes()[:-100])  # cut short
    again = _load(model_dir, tmp_path)
    assert again.host.quant_cache.quantised_layers == 1
    again.host.close()


def test_a_cache_that_cannot_be_written_falls_back_to_quantising_in_memory(tiny_model_dir, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would go")
    config = RuntimeConfig(
        device="cpu",
        expert_format="nf4",
        quant_cache_dir=str(blocker),
        cache_experts=2,
        sampling=Sampling(greedy=True, max_new_tokens=4),
    )
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        assert runtime.engine.host.quant_cache is None and runtime.info.expert_format == "nf4"
        # Said with the load, not only in the log: every load will quantise again until the folder can be written.
        assert "could not be written to" in runtime.load_notice and "choose expert format bf16" in runtime.load_notice
        cached = RuntimeConfig(device="cpu", expert_format="nf4", quant_cache_dir=str(tmp_path / "q"))
        with Runtime.load(tiny_model_dir("mixtral"), cached.with_changes(cache_experts=2)) as reference:
            prompt = [{"role": "user", "content": "Hello there"}]
            assert runtime.generate(prompt).token_ids == reference.generate(prompt, config.sampling).token_ids


def _free_space(monkeypatch, free):
    """The free-space figure the copy sees: `free[0]` bytes, changed by a test as its disk fills."""
    monkeypatch.setattr(hardware, "disk_free_bytes", lambda path: free[0])


def _disk_full_on_layer(monkeypatch, layer, free, left):
    # What safetensors raises on a full disk (its own type, not an OSError), once layers before `layer` are written.
    def save_file(tensors, path, metadata=None):
        if path.endswith(f"layer-{layer:04d}.safetensors.partial"):
            free[0] = left
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        REAL_SAVE(tensors, path, metadata=metadata)

    monkeypatch.setattr(quant_cache, "save_file", save_file)


def test_a_copy_that_does_not_fit_is_not_started_and_the_load_says_what_to_free(tiny_model_dir, tmp_path, monkeypatch):
    _free_space(monkeypatch, [hardware.DISK_MARGIN_BYTES - 1000])  # less than the margin alone: nothing fits
    config = RuntimeConfig(device="cpu", expert_format="int8", quant_cache_dir=str(tmp_path / "q"), cache_experts=2)
    seen = []
    with Runtime.load(tiny_model_dir("mixtral"), config, progress=lambda *p: seen.append(p)) as runtime:
        assert runtime.engine.host.quant_cache is None and runtime.info.expert_format == "int8"
        notice = runtime.load_notice
    assert not (tmp_path / "q").exists() and seen == []  # nothing written, no copy counted
    assert "8-bit copy of the experts" in notice and "could not be kept" in notice
    assert f"free 0.1 GB on {hardware.volume_of(tmp_path)}" in notice and "choose expert format bf16" in notice


def test_a_disk_that_fills_up_mid_copy_falls_back_and_leaves_no_layer_behind(tiny_model_dir, tmp_path, monkeypatch):
    free = [10**13]
    _free_space(monkeypatch, free)
    _disk_full_on_layer(monkeypatch, 1, free, left=4096)
    config = RuntimeConfig(device="cpu", expert_format="nf4", quant_cache_dir=str(tmp_path), cache_experts=2)
    seen = []
    with Runtime.load(tiny_model_dir("qwen2_moe"), config, progress=lambda *p: seen.append(p)) as runtime:
        assert runtime.engine.host.quant_cache is None
        notice = runtime.load_notice
    # The finished layer 0 went too: a full disk is worse now than quantising it again later.
    assert list(tmp_path.iterdir()) == []
    assert "4-bit copy of the experts" in notice and "in memory" in notice and "choose expert format bf16" in notice
    assert seen[-1] == (0, 0)  # the count stops said, rather than frozen at layer 1


def test_a_copy_that_stops_fitting_keeps_its_whole_layers_when_the_disk_is_not_full(
    tiny_model_dir, tmp_path, monkeypatch
):
    free = [10**13]
    _free_space(monkeypatch, free)
    _disk_full_on_layer(monkeypatch, 1, free, left=hardware.DISK_MARGIN_BYTES)  # the margin left, not the rest
    model_dir = tiny_model_dir("qwen2_moe")
    failed = _load(model_dir, tmp_path)
    assert failed.host.quant_cache is None and "left to write" in failed.host.notice
    failed.host.close()
    (folder,) = tmp_path.iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["layer-0000.safetensors"]  # no half-written file
    monkeypatch.setattr(quant_cache, "save_file", REAL_SAVE)
    free[0] = 10**13
    resumed = _load(model_dir, tmp_path)
    assert resumed.host.quant_cache.quantised_layers == resumed.host.num_layers - 1 and resumed.host.notice == ""
    resumed.host.close()


def test_default_root_is_in_the_user_data_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    if os.name == "posix" and not str(quant_cache.default_root()).startswith(str(tmp_path)):
        pytest.skip("this platform's data folder does not follow XDG_DATA_HOME")
    assert quant_cache.default_root() == tmp_path / "fmoe-local" / "quantized"


def test_delete_copies_keeps_the_loaded_model_s_own_and_touches_nothing_else(tiny_model_dir, tmp_path):
    loaded, other = tiny_model_dir("olmoe"), tiny_model_dir("mixtral")
    root = tmp_path / "quantized"
    for model in (loaded, other):
        _load(model, root, "nf4").host.close()
    _load(other, root, "int8").host.close()
    assert len(quant_cache.copies(root)) == 3
    (root / "notes.txt").write_text("not ours")  # a file, and a folder not named as a copy: never touched
    (root / "photos").mkdir()
    outside = tmp_path / "elsewhere" / f"{'0' * 24}-nf4-float32"
    outside.mkdir(parents=True)
    (root / outside.name).symlink_to(outside)  # named like a copy but a link: not followed, not removed
    before = quant_cache.copies_bytes(root)
    freed = quant_cache.remove_other_copies(root, loaded)
    [kept] = quant_cache.copies(root)
    assert kept.name.startswith(quant_cache.fingerprint(loaded)) and 0 < freed < before
    assert (root / "notes.txt").exists() and (root / "photos").is_dir() and outside.is_dir()
    assert quant_cache.remove_other_copies(root, None) > 0 and quant_cache.copies(root) == []  # none loaded: all go


def test_the_packed_dense_weights_are_counted_and_deleted_with_the_copies(tiny_model_dir, tmp_path):
    # What the Models tab shows and deletes (ui/model_formats.py, ui/models.py): int8 experts with their dense file,
    # and bf16 experts beside int8 dense weights, whose copy folder holds the dense file alone.
    model_dir, root = tiny_model_dir("mixtral"), tmp_path / "quantized"
    both = load_model(model_dir, RuntimeConfig(expert_format="int8", quant_cache_dir=str(root)), "cpu", None)
    both.host.close()
    config = RuntimeConfig(expert_format="bf16", dense_format="int4", quant_cache_dir=str(root))
    load_model(model_dir, config, "cpu", None).host.close()
    int8, int4 = (root / quant_cache.copy_dir(None, model_dir, f, torch.float32).name for f in ("int8", "int4"))
    assert quant_cache.copies(root) == [int4, int8]
    assert sorted(p.name for p in int4.iterdir()) == [quant_cache.DENSE_FILE]
    assert (int8 / quant_cache.DENSE_FILE).is_file()
    everything = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert quant_cache.copies_bytes(root) == everything
    assert quant_cache.remove_copies(root, model_dir) == everything and list(root.iterdir()) == []


# ---- int4 in torch's CPU layout, kept on disk per key (quant_cache.CpuLayout) ----------------------------------------
class _CountingConverter:
    """expert_formats.Int4Weight.from_portable (torch's CPU int4 layout), counting its calls: experts' and dense
    weights' alike."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        self._real = expert_formats.Int4Weight.from_portable
        monkeypatch.setattr(expert_formats.Int4Weight, "from_portable", staticmethod(self))

    def __call__(self, q):
        self.calls += 1
        return self._real(q)


def _int4_cpu(tmp_path) -> RuntimeConfig:
    return RuntimeConfig(
        device="cpu",
        dtype="float32",
        cache_experts=1,
        expert_format="int4",
        dense_format="int4",
        quant_cache_dir=str(tmp_path),
        sampling=Sampling(greedy=True, max_new_tokens=NEW_TOKENS),
    )


def _tokens_and_cache(model_dir, config) -> tuple[list[int], QuantCache]:
    with Runtime.load(model_dir, config) as runtime:
        return runtime.generate(PROMPT).token_ids, runtime.engine.host.quant_cache


def _layouts(folder) -> set[object]:
    """The int4_layout keys the folder's files name (None: portable codes)."""
    keys = set()
    for path in folder.glob("*.safetensors"):
        file = SafetensorsFile(path)
        keys.add(file.metadata.get(quant_cache.LAYOUT))
        file.close()
    return keys


def test_a_cpu_device_keeps_int4_in_its_cpu_layout_and_the_next_load_converts_nothing(
    tiny_model_dir, tmp_path, monkeypatch
):
    model_dir, config = tiny_model_dir("qwen2_moe"), _int4_cpu(tmp_path)
    converter = _CountingConverter(monkeypatch)
    first, cache = _tokens_and_cache(model_dir, config)
    assert converter.calls > 0 and cache.quantised_layers == cache.num_layers
    assert _layouts(cache.dir) == {dtype_verdicts.torch_cpu_key()}  # experts' layers and dense.safetensors
    converter.calls = 0
    second, cache = _tokens_and_cache(model_dir, config)
    assert converter.calls == 0 and cache.quantised_layers == cache.converted_layers == 0
    assert second == first


def test_a_copy_in_another_key_s_layout_is_never_read_and_is_made_again(tiny_model_dir, tmp_path, monkeypatch):
    model_dir, config = tiny_model_dir("qwen2_moe"), _int4_cpu(tmp_path)
    real_key = dtype_verdicts.torch_cpu_key()
    first, cache = _tokens_and_cache(model_dir, config)
    monkeypatch.setattr(dtype_verdicts, "torch_cpu_key", lambda: f"{real_key} (another torch)")
    converter = _CountingConverter(monkeypatch)
    other, cache = _tokens_and_cache(model_dir, config)
    # The layout cannot be converted back: every layer is quantised again, converted, and written over.
    assert converter.calls > 0 and cache.quantised_layers == cache.num_layers
    assert _layouts(cache.dir) == {f"{real_key} (another torch)"}
    assert other == first
    converter.calls = 0
    again, _ = _tokens_and_cache(model_dir, config)
    assert converter.calls == 0 and again == first


def test_a_damaged_int4_layer_of_a_cpu_copy_is_made_again(tiny_model_dir, tmp_path, monkeypatch):
    model_dir, config = tiny_model_dir("qwen2_moe"), _int4_cpu(tmp_path)
    first, cache = _tokens_and_cache(model_dir, config)
    layer = cache.layer_path(1)
    layer.write_bytes(layer.read_bytes()[:-100])  # cut short
    converter = _CountingConverter(monkeypatch)
    again, cache = _tokens_and_cache(model_dir, config)
    assert cache.quantised_layers == 1 and converter.calls > 0 and again == first
    converter.calls = 0
    assert _tokens_and_cache(model_dir, config)[0] == first and converter.calls == 0


_PARAMS = expert_formats.layout("int4", {"w": (64, 128)})


def _portable_expert(layer: int, expert: int) -> dict[str, torch.Tensor]:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(10 * layer + expert))
    return {f"w.{k}": v for k, v in expert_formats.pack(_PARAMS["w"], w, torch.float32).items()}


def _checkpoint_never_read(layer, expert):
    raise AssertionError("a layer the copy holds was quantised again")


def _copy(tmp_path, layout=None) -> QuantCache:
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    return QuantCache(tmp_path / "q", model_dir, "int4", torch.float32, 2, layout)


def _build_and_read(cache, fetch) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    cache.build(fetch, 3, 64 * 64 + 2 * 64 * 2 * 4)
    try:
        return {(la, e): cache.read(la, e, ["w.q", "w.sz"]) for la in range(2) for e in range(3)}
    finally:
        cache.close()


def test_a_portable_copy_is_converted_once_and_a_layout_copy_is_remade_portable_for_a_gpu(tmp_path):
    calls = []

    def convert(rows):
        calls.append(1)
        return expert_formats.to_cpu_layout(_PARAMS, rows)

    portable = _build_and_read(_copy(tmp_path), _portable_expert)  # as a GPU load writes it
    layout = quant_cache.CpuLayout("this cpu", convert)
    cache = _copy(tmp_path, layout)
    converted = _build_and_read(cache, _checkpoint_never_read)
    assert len(calls) == 6 and cache.converted_layers == 2 and cache.quantised_layers == 0
    for k, rows in converted.items():
        assert torch.equal(rows["w.q"], expert_formats.Int4Weight.from_portable(portable[k]["w.q"]))
        assert torch.equal(rows["w.sz"], portable[k]["w.sz"])
    again = _copy(tmp_path, layout)
    assert _build_and_read(again, _checkpoint_never_read).keys() == converted.keys() and len(calls) == 6
    # A load without the layout (a GPU) never reads it: the layers are quantised again into portable codes.
    gpu = _copy(tmp_path)
    assert gpu.missing_layers() == [0, 1]
    remade = _build_and_read(gpu, _portable_expert)
    assert gpu.quantised_layers == 2 and all(torch.equal(remade[k]["w.q"], portable[k]["w.q"]) for k in portable)


def test_a_portable_layer_that_cannot_be_written_over_is_converted_as_it_is_read(tmp_path, monkeypatch):
    portable = _build_and_read(_copy(tmp_path), _portable_expert)

    def refuse(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(quant_cache, "save_file", refuse)
    layout = quant_cache.CpuLayout("this cpu", partial(expert_formats.to_cpu_layout, _PARAMS))
    cache = _copy(tmp_path, layout)
    read = _build_and_read(cache, _checkpoint_never_read)  # no CopyNotKept: the portable copy is still read
    assert cache.converted_layers == cache.quantised_layers == 0 and _layouts(cache.dir) == {None}
    assert all(torch.equal(read[k]["w.q"], expert_formats.Int4Weight.from_portable(portable[k]["w.q"])) for k in read)
    monkeypatch.setattr(quant_cache, "save_file", REAL_SAVE)
    again = _copy(tmp_path, layout)
    _build_and_read(again, _checkpoint_never_read)
    assert again.converted_layers == 2 and _layouts(again.dir) == {"this cpu"}
