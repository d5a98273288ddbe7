"""Settings: defaults come from RuntimeConfig, values are typed, validated and persist."""

from __future__ import annotations

import pytest

from fmoe_local.config import RuntimeConfig, Sampling
from store import AppSettings, open_store


def test_defaults_are_the_runtime_defaults(tmp_path):
    with open_store(tmp_path) as s:
        got = s.settings.load()
    rc = RuntimeConfig()
    assert (got.cache_gb, got.prefetch_distance, got.policy, got.store_capacity) == (
        rc.cache_gb,
        rc.prefetch_distance,
        rc.policy,
        rc.store_capacity,
    )
    assert (got.temperature, got.top_p, got.max_new_tokens) == (
        rc.sampling.temperature,
        rc.sampling.top_p,
        rc.sampling.max_new_tokens,
    )
    assert got.last_model == "" and got.system_prompt == ""


def test_set_persists_typed_values(tmp_path):
    with open_store(tmp_path) as s:
        s.settings.set(
            cache_gb=6, prefetch_distance=2, policy="lru", last_model="/models/mixtral", system_prompt="Be kind."
        )
    with open_store(tmp_path) as s:
        got = s.settings.load()
        assert s.settings.get("cache_gb") == 6.0 and isinstance(s.settings.get("cache_gb"), float)
    assert (got.prefetch_distance, got.policy, got.last_model, got.system_prompt) == (
        2,
        "lru",
        "/models/mixtral",
        "Be kind.",
    )
    assert got.store_capacity == RuntimeConfig().store_capacity  # untouched keys keep their defaults


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"policy": "magic"}, "Unknown policy"),
        ({"expert_format": "fp8"}, "Unknown expert format 'fp8'. Choose auto"),
        ({"prefetch_distance": 0}, "at least 1 layer"),
        ({"top_p": 1.5}, "A top-p of 1.5 is not possible"),
        ({"cache_gb": "lots"}, "Set the expert cache size to a number of GB: 'lots' is not one."),
        ({"expert_format": 4}, "Set the expert format to auto, bf16, int8, int4 or nf4: 4 is not one."),
        ({"max_new_tokens": True}, "Set max new tokens to a whole number from 1 to 4,096: True is not one."),
        ({"colour": "blue"}, "Unknown setting"),
        # NaN passed every "< 0" test and was saved; the sliders' ranges are the only ones a saved value may take
        ({"temperature": float("nan")}, "A temperature of nan is not possible. Use a number from 0 to 2"),
        ({"temperature": 10**400}, "Set the temperature to a number from 0 to 2: a number that large is not one."),
        ({"cache_gb": float("inf")}, "An expert cache of inf GB is not possible"),
        ({"cache_gb": float("nan")}, "An expert cache of nan GB is not possible"),
        ({"top_p": float("nan")}, "A top-p of nan is not possible"),
        ({"max_new_tokens": 4097}, "Max new tokens of 4097 is not possible"),
        ({"prefetch_distance": 2.5}, "Set the prefetch distance to a whole number of layers: 2.5 is not one."),
        ({"system_prompt": "x" * 100_001}, "it can be at most 100,000"),
    ],
)
def test_invalid_values_are_refused_with_a_sentence_and_not_saved(tmp_path, changes, message):
    with open_store(tmp_path) as s:
        with pytest.raises(ValueError, match=message):
            s.settings.set(**changes)
        assert s.settings.load() == AppSettings()


def test_a_stored_value_of_the_wrong_type_falls_back_to_the_default(tmp_path):
    with open_store(tmp_path) as s:
        s.db.db["settings"].upsert_all(
            [{"key": "cache_gb", "value_json": '"four"'}, {"key": "retired_key", "value_json": "1"}], pk="key"
        )
        s.settings.set(policy="lfu")
        got = s.settings.load()
    assert got.cache_gb == RuntimeConfig().cache_gb and got.policy == "lfu"


def test_a_stored_value_this_version_refuses_falls_back_and_does_not_block_saving(tmp_path):
    # Right type, wrong value: a policy renamed by an upgrade, a miss handling a newer version added, a zero cache.
    stored = {"policy": '"lru-legacy"', "miss_handling": '"gpu-direct"', "cache_gb": "0", "temperature": "0.3"}
    with open_store(tmp_path) as s:
        s.db.db["settings"].upsert_all([{"key": k, "value_json": v} for k, v in stored.items()], pk="key")
        got = s.settings.load()
        defaults = AppSettings()
        assert (got.policy, got.miss_handling, got.cache_gb) == (
            defaults.policy,
            defaults.miss_handling,
            defaults.cache_gb,
        )
        assert got.temperature == 0.3  # the valid ones are kept
        assert set(s.settings.refused()) == {"policy", "miss_handling", "cache_gb"}  # for the load to say so
        assert "Unknown policy 'lru-legacy'" in s.settings.refused()["policy"]
        s.settings.set(max_new_tokens=64)  # before: every save (each Send) failed with "Unknown policy 'lru-legacy'"
        assert s.settings.load().max_new_tokens == 64


def test_apply_to_builds_the_runtime_config(tmp_path):
    with open_store(tmp_path) as s:
        settings = s.settings.set(cache_gb=1.5, store_capacity=64, temperature=0.2, max_new_tokens=32)
        assert s.settings.reset() == AppSettings()
    base = RuntimeConfig(device="cpu", sampling=Sampling(seed=7))
    config = settings.apply_to(base)
    config.validate()
    assert (config.device, config.cache_gb, config.store_capacity) == ("cpu", 1.5, 64)
    assert (config.sampling.temperature, config.sampling.max_new_tokens, config.sampling.seed) == (0.2, 32, 7)


def test_the_expert_format_is_kept_and_reaches_the_next_load(tmp_path):
    with open_store(tmp_path) as s:
        assert s.settings.load().expert_format == RuntimeConfig().expert_format == "auto"
        s.settings.set(expert_format="nf4")
    with open_store(tmp_path) as s:
        settings = s.settings.load()
    assert settings.expert_format == "nf4" and settings.apply_to(RuntimeConfig()).expert_format == "nf4"


CHILD = """
import sys
from store import open_store
store = open_store(sys.argv[1])
i = 0
while True:
    i += 1
    store.settings.set(store_capacity=i, max_new_tokens=i)  # one Apply: both keys or neither
    print(i, flush=True)
"""


def test_kill_9_during_settings_saves_keeps_every_committed_apply_whole(tmp_path):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=repo, stdout=subprocess.PIPE, text=True)
    try:
        committed = 0
        while committed < 200:
            line = child.stdout.readline()
            assert line, "the writer died before it was killed"
            committed = int(line)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(10)
    store = open_store(tmp_path)
    try:
        s = store.settings.load()
        assert s.store_capacity == s.max_new_tokens  # never half an Apply
        assert s.store_capacity >= committed  # nothing reported saved was lost
        assert store.recovered_from is None
    finally:
        store.close()


def test_each_model_folder_keeps_its_own_expert_format(tmp_path):
    with open_store(tmp_path / "data") as s:
        a, b = tmp_path / "a", tmp_path / "b"
        assert s.settings.model_format(str(a)) is None  # never chosen
        s.settings.set(**s.settings.format_choice(str(a), "int8"))
        s.settings.set(**s.settings.format_choice(str(b / ".." / "b"), "nf4"))  # the same folder, however spelt
        assert (s.settings.model_format(str(a)), s.settings.model_format(str(b))) == ("int8", "nf4")
        assert s.settings.load().expert_format == "nf4"  # the next load's, as before
        with pytest.raises(ValueError, match="Unknown expert format"):
            s.settings.set(**s.settings.format_choice(str(a), "fp8"))
        assert s.settings.model_format(str(a)) == "int8"  # refused: nothing saved
        s.settings.set(model_formats="not json")
        assert s.settings.model_format(str(a)) is None  # unreadable: as if never chosen
