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

from fmoe_local.config import DENSE_FORMATS, EXPERT_FORMATS, RuntimeConfig, Sampling
from store.db import StoreDb

log = logging.getLogger(__name__)

# The Generation values' ranges: the Chat tab's sliders offer these and the check refuses anything else, so a script
# calling the page's API gets what the page allows. A system prompt has a budget too: it is saved, read back with
# every reply and sent to every page that opens.
TEMPERATURE_RANGE = (0.0, 2.0)
TOP_P_RANGE = (0.05, 1.0)
TOP_K_RANGE = (0, 200)  # 0: no limit
MAX_NEW_TOKENS_RANGE = (1, 4096)
REPETITION_PENALTY_RANGE = (1.0, 2.0)  # 1: off; below 1 would ask for repetition, which no chat wants
PENALTY_RANGE = (-2.0, 2.0)  # frequency and presence: OpenAI's range
# Tokens of a chat's history sent to the model (0: as many as the model reads). The loaded model's own maximum is
# checked when a reply is asked for (ui/chat_flow.py): it is not known here.
CONTEXT_LENGTH_RANGE = (0, 1_048_576)
SYSTEM_PROMPT_CHARS = 100_000
# What a chat holds of its own (store/chats.py, `generation`): the Chat tab's Generation panel. The fields of the
# same names here are the defaults a new chat starts from ("Save as default").
GENERATION_KEYS = (
    "system_prompt", "temperature", "top_p", "top_k", "max_new_tokens", "repetition_penalty", "frequency_penalty",
    "presence_penalty", "context_length",
)  # fmt: skip


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
    # How the linear weights outside the experts are stored (auto | bf16 | int8 | int4, dense_formats.py): a reload
    # too, like the expert format.
    dense_format: str = RuntimeConfig.dense_format
    # What a miss costs on this machine, per model folder: {"/path/to/model": MissCosts.to_dict()} as JSON, measured
    # at the first load and reused by the next ones (Runtime.load checks they fit the model and the device).
    miss_costs: str = ""
    # What `dtype` auto decides with on this CPU (fmoe_local.dtype_verdicts: DtypeVerdicts.to_dict() as JSON, keyed by
    # the CPU, torch and the thread count), measured once and reused by later loads and the Models tab; the Models
    # tab's "Re-check this computer" measures it again.
    dtype_verdicts: str = ""
    # The expert format the user chose for each model folder: {"/path/to/model": "int8"} as JSON. Load settings belong
    # to the model loaded (picking a model in the Models tab shows its own choice, not the last model's).
    model_formats: str = ""
    temperature: float = Sampling.temperature
    top_p: float = Sampling.top_p
    top_k: int = Sampling.top_k
    max_new_tokens: int = Sampling.max_new_tokens
    repetition_penalty: float = Sampling.repetition_penalty
    frequency_penalty: float = Sampling.frequency_penalty
    presence_penalty: float = Sampling.presence_penalty
    system_prompt: str = ""
    context_length: int = 0  # a chat's history budget in tokens; 0: the model's whole context

    def sampling(self, base: Sampling | None = None) -> Sampling:
        """`base` (default: Sampling's defaults) with these generation values; temperature 0 is greedy."""
        return replace(
            base or Sampling(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            greedy=self.temperature == 0,
        )

    def generation(self) -> dict[str, Any]:
        """The values a chat keeps of its own (GENERATION_KEYS)."""
        return {key: getattr(self, key) for key in GENERATION_KEYS}

    def apply_to(self, config: RuntimeConfig) -> RuntimeConfig:
        """`config` with these settings in it (sampling included)."""
        sampling = replace(self.sampling(config.sampling), greedy=config.sampling.greedy)
        return config.with_changes(
            cache_gb=self.cache_gb,
            prefetch_distance=self.prefetch_distance,
            policy=self.policy,
            store_capacity=self.store_capacity,
            miss_handling=self.miss_handling,
            expert_format=self.expert_format,
            dense_format=self.dense_format,
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
        low, high = TOP_K_RANGE
        if not low <= self.top_k <= high:
            raise ValueError(
                f"A top-k of {_shown(self.top_k)} is not possible. Use a whole number from {low} (no limit) to {high}."
            )
        low, high = MAX_NEW_TOKENS_RANGE
        if not low <= self.max_new_tokens <= high:
            raise ValueError(
                f"Max new tokens of {_shown(self.max_new_tokens)} is not possible. Use a whole number from {low} to "
                f"{high:,}."
            )
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(
                f"A repetition penalty of {self.repetition_penalty:g} is not possible. Use a number from {low:g} (off) "
                f"to {high:g}."
            )
        low, high = PENALTY_RANGE
        for name, value in (("frequency", self.frequency_penalty), ("presence", self.presence_penalty)):
            if not low <= value <= high:
                raise ValueError(
                    f"A {name} penalty of {value:g} is not possible. Use a number from {low:g} to {high:g} (0 is off)."
                )
        low, high = CONTEXT_LENGTH_RANGE
        if not low <= self.context_length <= high:
            raise ValueError(
                f"A context length of {_shown(self.context_length)} tokens is not possible. Use a whole number up to "
                f"{high:,}, or 0 for as much as the model reads."
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
    "expert_format": ("the expert format", ", ".join(EXPERT_FORMATS[:-1]) + " or " + EXPERT_FORMATS[-1]),
    "dense_format": ("the dense format", ", ".join(DENSE_FORMATS[:-1]) + " or " + DENSE_FORMATS[-1]),
    "miss_costs": ("the measured miss costs", "JSON text"),
    "dtype_verdicts": ("the measured dtype verdicts", "JSON text"),
    "model_formats": ("each model's expert format", "JSON text"),
    "temperature": ("the temperature", f"a number from {TEMPERATURE_RANGE[0]:g} to {TEMPERATURE_RANGE[1]:g}"),
    "top_p": ("top-p", f"a number from {TOP_P_RANGE[0]:g} to {TOP_P_RANGE[1]:g}"),
    "top_k": ("top-k", f"a whole number from {TOP_K_RANGE[0]} to {TOP_K_RANGE[1]}"),
    "repetition_penalty": (
        "the repetition penalty",
        f"a number from {REPETITION_PENALTY_RANGE[0]:g} to {REPETITION_PENALTY_RANGE[1]:g}",
    ),
    "frequency_penalty": ("the frequency penalty", f"a number from {PENALTY_RANGE[0]:g} to {PENALTY_RANGE[1]:g}"),
    "presence_penalty": ("the presence penalty", f"a number from {PENALTY_RANGE[0]:g} to {PENALTY_RANGE[1]:g}"),
    "max_new_tokens": (
        "max new tokens",
        f"a whole number from {MAX_NEW_TOKENS_RANGE[0]} to {MAX_NEW_TOKENS_RANGE[1]:,}",
    ),
    "system_prompt": ("the system prompt", "text"),
    "context_length": ("the context length", f"a whole number of tokens up to {CONTEXT_LENGTH_RANGE[1]:,} (0: all)"),
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

    def for_chat(self, stored: dict[str, Any] | None) -> AppSettings:
        """The settings a chat is answered with: the saved defaults, with each of the chat's own values (a chat's
        `generation`) that this version takes. A value it refuses (written by another version, or by an import) is
        skipped and the default stands in, as `load` does with the settings table."""
        settings = self.load()
        for key, value in (stored or {}).items():
            if key not in GENERATION_KEYS:
                continue
            try:
                candidate = replace(settings, **{key: _coerce(key, value)})
                candidate.validate()
            except (TypeError, ValueError, ArithmeticError, RecursionError):
                log.warning("ignoring a chat's stored setting %s=%r", key, value)
                continue
            settings = candidate
        return settings

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
