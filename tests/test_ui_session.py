"""Session.load: a saved setting this model cannot use is reset to its default with a sentence, and the model loads
(the built-in one always does); a model that cannot load keeps the saved settings."""

from __future__ import annotations

import json
import shutil

import pytest

from fmoe_local.config import RuntimeConfig
from fmoe_local.demo import demo_model_dir
from fmoe_local.runtime import Runtime
from store import open_store
from store.settings import AppSettings
from ui.load_job import ModelLoadError
from ui.session import Session


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path)
    yield s
    s.close()


def test_a_saved_cache_smaller_than_one_expert_is_reset_and_the_demo_model_loads(store):
    # cache_gb: valid for the form, too small for any expert; the others are fine and must be kept
    store.settings.set(cache_gb=1e-6, prefetch_distance=2, temperature=0.2, top_p=0.5, max_new_tokens=77)
    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    try:
        said = session.load(demo_model_dir())
        assert session.runtime is not None and session.load_error == ""
        assert "saved cache_gb could not be used" in said and "must hold at least one expert" in said
        assert said.endswith("it was reset to the default.")
        saved = store.settings.load()
        assert saved.cache_gb == AppSettings().cache_gb
        # was: every saved setting that differed from the defaults was reset with it
        assert (saved.prefetch_distance, saved.temperature, saved.top_p, saved.max_new_tokens) == (2, 0.2, 0.5, 77)
        assert session.runtime.info.prefetch_distance == 2
        assert session.runtime.generate([{"role": "user", "content": "Hi"}]).reason in ("stop", "length", "context")
    finally:
        session.close()


def test_a_saved_map_store_too_big_for_the_ram_is_reset_and_the_model_loads(store):
    # was: every load failed "Unable to allocate 7.28 TiB", and the saved value was never reset
    store.settings.set(store_capacity=10**12, prefetch_distance=2)
    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    try:
        said = session.load(demo_model_dir())
        assert "Your saved store_capacity could not be used (1,000,000,000,000 expert maps do not fit" in said
        assert said.endswith("it was reset to the default.")
        saved = store.settings.load()
        assert (saved.store_capacity, saved.prefetch_distance) == (AppSettings().store_capacity, 2)
        assert session.runtime.info.store_capacity == AppSettings().store_capacity
    finally:
        session.close()


def test_an_unknown_saved_policy_is_reset(store):
    store.settings.set(policy="fmoe")
    with store.settings._s.lock:  # written by another version: a policy this one does not have
        store.settings._s.db.execute("UPDATE settings SET value_json = '\"belady2\"' WHERE key = 'policy'")
    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    try:
        said = session.load(demo_model_dir())
        assert "Saved settings that cannot be used are back to their defaults: Unknown policy 'belady2'" in said
        assert store.settings.load().policy == AppSettings().policy
    finally:
        session.close()


def test_settings_that_work_are_kept(store):
    store.settings.set(prefetch_distance=2)
    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    try:
        said = session.load(demo_model_dir())
        assert "reset" not in said and session.runtime.info.prefetch_distance == 2
    finally:
        session.close()


def test_a_checkpoint_that_cannot_load_keeps_the_saved_settings_and_is_read_once(
    ui_session, tiny_model_dir, tmp_path, monkeypatch
):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "acme--incomplete"  # a download cut short: a weight the model needs is missing
    shutil.copytree(tiny_model_dir("mixtral"), broken)
    weights = load_file(broken / "model.safetensors")
    del weights[next(k for k in weights if "norm" in k)]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    settings = ui_session.store.settings
    settings.set(temperature=0.2, top_p=0.5, max_new_tokens=77, policy="lru", prefetch_distance=2)
    before = settings.load()
    tries, real = [], Runtime.load.__func__
    monkeypatch.setattr(Runtime, "load", classmethod(lambda cls, *a, **kw: tries.append(a[0]) or real(cls, *a, **kw)))
    with pytest.raises(ModelLoadError, match="lacks 1 weights the model needs .*download the model again") as err:
        ui_session.load(broken)
    assert "saved settings" not in str(err.value)
    assert settings.load() == before and tries == [broken]  # no reset, and the checkpoint read once, not twice


def test_a_model_that_can_never_load_is_refused_while_the_working_one_stays_loaded(
    ui_session, tiny_model_dir, tmp_path
):
    dense = tmp_path / "meta-llama--Llama-3.2-1B"  # a dense model: no experts to offload
    dense.mkdir()
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 100}
    (dense / "config.json").write_text(json.dumps({**llama, "num_hidden_layers": 2, "num_attention_heads": 4}))
    gptq = tmp_path / "TheBloke--Mixtral-GPTQ"  # a quantization the app cannot read
    shutil.copytree(tiny_model_dir("mixtral"), gptq)
    config = json.loads((gptq / "config.json").read_text())
    (gptq / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    working = tiny_model_dir("mixtral")
    ui_session.load(working)
    runtime = ui_session.runtime
    for folder, why in ((dense, "is not a Mixture-of-Experts model"), (gptq, r"quantized \(gptq\), which fmoe")):
        with pytest.raises(ModelLoadError, match=why) as err:
            ui_session.load(folder)
        assert ui_session.runtime is runtime and ui_session.model_dir == working and ui_session.load_error == ""
        assert str(err.value).endswith(f"{working.name} is still loaded.")
    assert runtime.generate([{"role": "user", "content": "Hi"}]).reason in ("stop", "length", "context")
    ui_session.unload()
    with pytest.raises(ModelLoadError):
        ui_session.load(dense)
    assert "not a Mixture-of-Experts model" in ui_session.load_error  # the header's reason why none is loaded


def test_the_header_says_where_a_damaged_database_went(tmp_path):
    from ui import header
    from ui.render import code_literal

    (tmp_path / "fmoe-local.db").write_bytes(b"this is not a database" * 100)
    s = open_store(tmp_path)
    try:
        assert s.recovered_from is not None
        shown = header(Session(store=s, config=RuntimeConfig(device="cpu")))
        assert "database was damaged" in shown and code_literal(s.recovered_from) in shown  # the path, as text
    finally:
        s.close()


def test_the_demo_model_is_named_for_people_and_loads_say_so(store, tmp_path):
    from ui.session import DEMO_LABEL, model_id, model_label

    assert model_label(demo_model_dir(), "weights") == DEMO_LABEL
    assert model_label(tmp_path / "acme--tiny", "tiny") == "tiny"
    assert model_id(tmp_path / "acme--tiny", "tiny") == "tiny"
    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    assert session.model_id == ""  # nothing loaded
    try:
        assert session.load(demo_model_dir()).startswith(f"Loaded {DEMO_LABEL} on cpu")
        assert session.model_id == "demo"  # what /v1/models lists and new chats record, not "weights"
    finally:
        session.close()


def test_the_miss_costs_measured_at_the_first_load_are_saved_and_reused(store, monkeypatch):
    import json

    from fmoe_local import miss_cost

    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    try:
        session.load(demo_model_dir())
        measured = session.runtime.miss_costs
        saved = json.loads(store.settings.load().miss_costs)
        assert saved == {str(demo_model_dir()): measured.to_dict()}
        session.unload()

        def no_probe(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise AssertionError("the saved figures should have been used")

        monkeypatch.setattr(miss_cost, "probe", no_probe)
        session.load(demo_model_dir())
        assert session.runtime.miss_costs == measured
    finally:
        session.close()


def test_unreadable_saved_miss_costs_are_measured_again(store):
    store.settings.set(miss_costs='{"/x": 1')
    session = Session(store=store, config=RuntimeConfig(device="cpu"))
    try:
        session.load(demo_model_dir())
        assert str(demo_model_dir()) in store.settings.load().miss_costs
    finally:
        session.close()


def test_the_load_message_says_when_the_cache_was_cut_to_what_the_gpu_holds(ui_session, tiny_model_dir, monkeypatch):
    from fmoe_local import cache_budget

    monkeypatch.setattr(cache_budget, "device_room_bytes", lambda device: 1)  # a fake GPU without room for one
    with pytest.raises(ModelLoadError, match="less than one expert"):
        ui_session.load(tiny_model_dir("mixtral"))
    monkeypatch.setattr(cache_budget, "device_room_bytes", lambda device: 4 * 24 * 1024)  # four tiny experts
    said = ui_session.load(tiny_model_dir("mixtral"))
    assert said.endswith("so it holds 4 experts (Settings shows what fits).") and "cache 96 KB (4 experts)" in said
    assert "; 96 KB fit next to the model" in said  # before: "0.09 MB" beside "0.0 GB fit"


def test_what_fits_is_judged_with_the_app_s_own_model_counted_as_free(ui_session, tiny_model_dir, monkeypatch):
    from fmoe_local.catalog import GB
    from fmoe_local.hardware import Machine

    probes = []

    def probe(_, verdicts=None):  # noqa: ANN001 - hardware.probe(data_dir, verdicts)
        probes.append(1)
        return Machine("cpu", "", 0, 0, 16 * GB, 6 * GB, 200 * GB)  # what a probe sees with our model in RAM

    monkeypatch.setattr("ui.session.probe", probe)
    assert ui_session.machine().ram_available == 6 * GB and ui_session.footprint() == (0, 0)
    ui_session.load(tiny_model_dir("mixtral"))
    _, ram = ui_session.footprint()
    info = ui_session.runtime.info
    assert ram == info.resident_bytes + int(info.cache_gb * 1024**3) + info.host_ram_bytes > 0
    assert ui_session.machine().ram_available == 6 * GB + ram  # probed again after the load, ours added back
    assert len(probes) == 2
    ui_session.unload()
    assert ui_session.footprint() == (0, 0) and ui_session.machine().ram_available == 6 * GB and len(probes) == 3


def test_a_gpu_model_s_memory_is_given_back_to_the_verdicts():
    from fmoe_local.catalog import GB
    from fmoe_local.hardware import Machine

    card = Machine("cuda", "RTX 4060", 8 * GB, int(2.3 * GB), 32 * GB, 20 * GB, 500 * GB)  # OLMoE loaded: 2.3 free
    freed = card.with_freed(int(5.2 * GB), 2 * GB)
    assert (freed.vram_free, freed.ram_available) == (int(7.5 * GB), 22 * GB)
    assert card.with_freed(20 * GB, 40 * GB).vram_free == 8 * GB  # never more than the card has


def test_the_dtype_verdicts_are_measured_once_saved_and_measured_again_on_re_check_only(store, monkeypatch, request):
    import json

    from fmoe_local import bandwidth, dtype_verdicts, openvino_products

    calls: list[str] = []
    monkeypatch.setattr(bandwidth, "half_decode_ratio", lambda dtype: calls.append("half") or 0.9)
    monkeypatch.setattr(bandwidth, "products_decode_ratio", lambda fmt: calls.append(fmt) or 0.5)
    # OpenVINO's probe behind its process cache (int8_ratio), which a re-check must empty too; emptied before and
    # after, so that no other test reads this one's figures.
    monkeypatch.setattr(
        openvino_products, "measured_ratio", lambda dtype, threads, size: calls.append(f"openvino {size}") or 2.0
    )
    openvino_products.forget_measured()
    request.addfinalizer(openvino_products.forget_measured)
    monkeypatch.setattr("fmoe_local.hardware.unused_gpu_reason", lambda cuda: "")
    Session(store=store, config=RuntimeConfig(device="cpu")).machine()
    ov = not openvino_products.unavailable()
    measured = ["half", "int8", "int4"] + (["openvino small", "openvino large"] if ov else [])
    assert calls == measured
    saved = json.loads(store.settings.load().dtype_verdicts)
    assert saved["key"] == dtype_verdicts.machine_key() and saved["ratios"]["half bfloat16"] == 0.9
    again = Session(store=store, config=RuntimeConfig(device="cpu"))  # the app started again on this machine
    assert again.machine().cpu_keeps_bf16 and calls == measured  # read back, not measured
    again.machine(refresh=True)  # memory and disk now (a download's disk check): no probe runs again
    assert calls == measured
    again.machine(remeasure=True)  # the Models tab's "Re-check this computer"
    assert calls == measured * 2
    store.settings.set(dtype_verdicts='{"key": 1')  # unreadable: measured again and replaced
    Session(store=store, config=RuntimeConfig(device="cpu")).machine()
    # (OpenVINO's figures come from this process's cache: an app reading unreadable text is a new process.)
    assert calls == measured * 2 + measured[:3]
    assert json.loads(store.settings.load().dtype_verdicts)["key"] == saved["key"]


def test_the_page_s_machine_probe_and_every_load_share_one_set_of_verdicts(ui_session, tiny_model_dir, monkeypatch):
    """At a first start the page probes the machine while the start-up load resolves its dtype: with one object
    each probe runs once, one at a time (tests/test_dtype_verdicts.py: under its lock). A re-check empties that
    object in place: a load under way neither measures beside it nor saves its older figures over the new ones."""
    from fmoe_local.hardware import Machine

    seen = []
    monkeypatch.setattr(
        "ui.session.probe", lambda _, verdicts: seen.append(verdicts) or Machine("cpu", "", 0, 0, 1, 1, 1)
    )
    ui_session.machine()
    ui_session.load(tiny_model_dir("mixtral"))
    assert ui_session.runtime.dtype_verdicts is seen[0]
    seen[0].ratios["half bfloat16"] = 0.5
    ui_session.machine(remeasure=True)
    assert seen[-1] is seen[0] and seen[0].ratios == {}
    ui_session.load(tiny_model_dir("mixtral"))
    assert ui_session.runtime.dtype_verdicts is seen[0]
