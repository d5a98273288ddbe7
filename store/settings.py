"""The user's settings between sessions: last model, cache size, prefetch distance, policy, store capacity, miss
handling (and the measured miss costs per model), the expert format (used at the next load; each model's own choice),
and sampling defaults, typed, with defaults taken from fmoe_local.config (never repeated here).

Scope: a key → JSON value table read into an `AppSettings` dataclass and written back one key at a time. It does
NOT apply settings to a running model (the app calls `Runtime.reconfigure`); `AppSettings.apply_to` only builds
the RuntimeConfig a load would use.

Validation: `SettingsStore.check` is the one check of every value the page takes (the Settings tab's Apply, the
chat's Generation values with each Send, Regenerate, Continue and Edit), whether typed or sent by a script to the
page's API: a value of the wrong type, NaN, infinity or out of the range the page offers is refused with a sentence
naming the setting. `load` runs the same check on what it reads, so a stored value that fails it (written by
another version, or before this check) is never used: the default stands in, and `refused` says which and why.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from fmoe_local.config import EXPERT_FORMATS, RuntimeConfig, Sampling
from store.db import StoreDb

log = logging.getLogger(__name__)

# The Generation values' ranges: the Chat tab's sliders offer these and the check refuses anything else, so a script
# calling the page's API gets what the page allows. A system prompt has a budget too: it is saved, read back with
# every reply and sent to every page that opens.
TEMPERATURE_RANGE = (0.0, 2.0)
TOP_P_RANGE = (0.05, 1.0)
MAX_NEW_TOKENS_RANGE = (1, 4096)
SYSTEM_PROMPT_CHARS = 100_000


@dataclass(frozen=True)
class AppSettings:
    last_model: str = ""  # folder or repo id of the model loaded last; "" = none yet
    cache_gb: float = RuntimeConfig.cache_gb
    prefetch_distance: int = RuntimeConfig.prefetch_distance
    policy: str = RuntimeConfig.policy
    store_capacity: int = RuntimeConfig.store_capacity
    miss_handling: str = RuntimeConfig.miss_handling
    # How the experts are stored (auto | bf16 | int8 | nf4): unlike the fields above it needs a reload, so a change
    # applies at the next load of a model.
    expert_format: str = RuntimeConfig.expert_format
    # What a miss costs on this machine, per model folder: {"/path/to/model": MissCosts.to_dict()} as JSON, measured
    # at the first load and reused by the next ones (Runtime.load checks they fit the model and the device).
    miss_costs: str = ""
    # The expert format the user chose for each model folder: {"/path/to/model": "int8"} as JSON. Load settings belong
    # to the model loaded (picking a model in the Models tab shows its own choice, not the last model's).
    model_formats: str = ""
    temperature: float = Sampling.temperature
    top_p: float = Sampling.top_p
    max_new_tokens: int = Sampling.max_new_tokens
    system_prompt: str = ""

    def apply_to(self, config: RuntimeConfig) -> RuntimeConfig:
        """`config` with these settings in it (sampling included)."""
        sampling = replace(
            config.sampling, temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens
        )
        return config.with_changes(
            cache_gb=self.cache_gb,
            prefetch_distance=self.prefetch_distance,
            policy=self.policy,
            store_capacity=self.store_capacity,
            miss_handling=self.miss_handling,
            expert_format=self.expert_format,
            sampling=sampling,
        )

    def validate(self) -> None:
        """Raise ValueError with a sentence a user can act on."""
        if not math.isfinite(self.cache_gb):  # NaN passes every comparison: refused before any
            raise ValueError(f"An expert cache of {self.cache_gb} GB is not possible. Set a positive number of GB.")
        low, high = TEMPERATURE_RANGE
        if not low <= self.temperature <= high:  # written so that NaN fails it
            raise ValueError(
                f"A temperature of {self.temperature:g} is not possible. Use a number from {low:g} to {high:g}: 0 for "
                "the most likely reply, ~0.7 for variety."
            )
        low, high = TOP_P_RANGE
        if not low <= self.top_p <= high:
            raise ValueError(f"A top-p of {self.top_p:g} is not possible. Use a number from {low:g} to {high:g}.")
        low, high = MAX_NEW_TOKENS_RANGE
        if not low <= self.max_new_tokens <= high:
            raise ValueError(
                f"Max new tokens of {_shown(self.max_new_tokens)} is not possible. Use a whole number from {low} to "
                f"{high:,}."
            )
        if len(self.system_prompt) > SYSTEM_PROMPT_CHARS:
            raise ValueError(
                f"The system prompt is {len(self.system_prompt):,} characters long; it can be at most "
                f"{SYSTEM_PROMPT_CHARS:,}. Shorten it."
            )
        # After the page's own sentences above (they name the sliders' ranges): the runtime's checks of the rest.
        self.apply_to(RuntimeConfig()).validate()


_TYPES: dict[str, type] = {f.name: type(f.default) for f in fields(AppSettings)}

# Each setting as a sentence names it, and what it takes: for the refusal of a value of the wrong type.
_NAMES = {
    "last_model": ("the last model", "a folder"),
    "cache_gb": ("the expert cache size", "a number of GB"),
    "prefetch_distance": ("the prefetch distance", "a whole number of layers"),
    "policy": ("the policy", "one of the policies listed"),
    "store_capacity": ("the store capacity", "a whole number of expert maps"),
    "miss_handling": ("the miss handling", "auto, copy or cpu"),
    "expert_format": ("the expert format", "auto, bf16, int8 or nf4"),
    "miss_costs": ("the measured miss costs", "JSON text"),
    "model_formats": ("each model's expert format", "JSON text"),
    "temperature": ("the temperature", f"a number from {TEMPERATURE_RANGE[0]:g} to {TEMPERATURE_RANGE[1]:g}"),
    "top_p": ("top-p", f"a number from {TOP_P_RANGE[0]:g} to {TOP_P_RANGE[1]:g}"),
    "max_new_tokens": (
        "max new tokens",
        f"a whole number from {MAX_NEW_TOKENS_RANGE[0]} to {MAX_NEW_TOKENS_RANGE[1]:,}",
    ),
    "system_prompt": ("the system prompt", "text"),
}


def _coerce(key: str, value: Any) -> Any:
    """`value` as the field's type; TypeError (a sentence) when it is not one, never a silent conversion."""
    kind = _TYPES[key]
    # bool is an int to Python; a checkbox value landing in a number field is a bug, not a 1.
    if isinstance(value, bool) or value is None:
        raise TypeError(_wrong_type(key, value))
    if kind is float and isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # an integer too large for a float
            raise TypeError(_wrong_type(key, value)) from None
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind):
        raise TypeError(_wrong_type(key, value))
    return value


def _wrong_type(key: str, value: Any) -> str:
    name, takes = _NAMES[key]
    return f"Set {name} to {takes}: {_shown(value)} is not one."


def _shown(value: Any) -> str:
    """A value for a sentence: short, whatever was sent (a megabyte of text, an integer of a thousand digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return "a number that large"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}…"


class SettingsStore:
    def __init__(self, store_db: StoreDb) -> None:
        self._s = store_db

    def load(self) -> AppSettings:
        """Stored values over the defaults; a value that no longer fits its field falls back to the default."""
        return self._read()[0]

    def refused(self) -> dict[str, str]:
        """The stored values this version refuses (name → why): `load` uses the defaults for them instead."""
        return self._read()[1]

    def _read(self) -> tuple[AppSettings, dict[str, str]]:
        with self._s.lock:
            rows = self._s.db.execute("SELECT key, value_json FROM settings").fetchall()
        settings, refused = AppSettings(), {}
        for key, value_json in rows:
            if key not in _TYPES:
                continue  # written by a newer version, or retired
            try:
                # A value of the right type may still be one this version refuses (a policy renamed since, a
                # value a newer version allows, a NaN saved before the check refused it): it must not make every
                # later `set` (each Send) fail, nor reach a reply or a /v1 request as their default.
                candidate = replace(settings, **{key: _coerce(key, json.loads(value_json))})
                candidate.validate()
            except (TypeError, ValueError, ArithmeticError, RecursionError) as exc:
                log.warning("ignoring stored setting %s=%s", key, value_json)
                refused[key] = str(exc)
                continue
            settings = candidate
        return settings, refused

    def get(self, key: str) -> Any:
        _check_key(key)
        return getattr(self.load(), key)

    def check(self, **changes: Any) -> AppSettings:
        """The settings `changes` would make, checked and typed, without saving them; ValueError (a sentence
        naming the setting) for one that is refused. Every value the page takes goes through here first."""
        for key in changes:
            _check_key(key)
        try:
            coerced = {k: _coerce(k, v) for k, v in changes.items()}
        except TypeError as exc:
            raise ValueError(str(exc)) from exc
        updated = replace(self.load(), **coerced)
        updated.validate()
        return updated

    def set(self, **changes: Any) -> AppSettings:
        """Validate (`check`) and save `changes` (field names of AppSettings); returns the settings now in effect."""
        updated = self.check(**changes)
        # One transaction for all the keys of one Apply: a kill in the middle keeps all of them or none.
        with self._s.writing():
            # SQLite's upsert written out, not sqlite-utils': that one first probes ON CONFLICT support by creating a
            # table, which a full disk refuses, and then keeps using its old form for the connection's life (INSERT
            # OR IGNORE of the key alone, breaking value_json's NOT NULL, then UPDATE): a new key was dropped
            # without a word, even after space was freed.
            self._s.db.conn.executemany(
                "INSERT INTO settings (key, value_json) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value_json = excluded.value_json",
                [(k, json.dumps(getattr(updated, k), allow_nan=False)) for k in changes],
            )
        return updated

    def model_format(self, folder: str) -> str | None:
        """The expert format the user chose for this model folder the last time (None: never chosen)."""
        chosen = _json_dict(self.load().model_formats).get(_folder_key(folder))
        return chosen if chosen in EXPERT_FORMATS else None

    def format_choice(self, folder: str, fmt: str) -> dict[str, str]:
        """The changes for `set` that make `fmt` the format of the next load and this folder's own choice."""
        known = _json_dict(self.load().model_formats)
        known[_folder_key(folder)] = fmt
        return {"expert_format": fmt, "model_formats": json.dumps(known)}

    def reset_fields(self, names: list[str]) -> AppSettings:
        """Put `names` back to their defaults (one transaction); returns the settings now in effect."""
        for key in names:
            _check_key(key)
        with self._s.writing():
            self._s.db.execute(f"DELETE FROM settings WHERE key IN ({', '.join('?' * len(names))})", list(names))
        return self.load()

    def reset(self) -> AppSettings:
        with self._s.writing():
            self._s.db.execute("DELETE FROM settings")
        return AppSettings()


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}  # unreadable (another version wrote it): as if nothing were chosen
    return value if isinstance(value, dict) else {}


def _folder_key(folder: str) -> str:
    return str(Path(folder).expanduser().resolve())


def _check_key(key: str) -> None:
    if key not in _TYPES:
        raise ValueError(f"Unknown setting '{key}'. Known settings: {', '.join(_TYPES)}.")
