"""Prompts for the live benchmark: the shared prompt files (or any like them) → first user turns → a seeded sample.

Scope: reading .json (a list) and .jsonl files of the formats in data/prompts (alpaca seed tasks, dolly,
lmsys, sharegpt) and chat logs ("messages"/"conversations"), and sampling from them reproducibly. It does NOT
tokenise or truncate prompts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from fmoe_bench.repo_data import data_dir


def shared_data_dir() -> Path:
    """The repository's data/ (FMOE_SHARED_DATA overrides it), as the tests find it."""
    return data_dir()


def first_user_turn(row: object) -> str:
    """The first user text of one record of the shared prompt files (alpaca, dolly, lmsys, sharegpt) or chat logs."""
    if isinstance(row, str):
        return row
    if not isinstance(row, dict):
        return ""
    for key in ("conversations", "messages", "conversation"):
        for turn in row.get(key) or []:
            if isinstance(turn, dict) and turn.get("role", turn.get("from")) in ("user", "human"):
                return str(turn.get("content", turn.get("value", "")))
    if "instruction" in row:  # alpaca seed tasks: the instruction plus the first instance's input
        instances = row.get("instances") or [{}]
        extra = instances[0].get("input", "") if isinstance(instances[0], dict) else ""
        return f"{row['instruction']}\n\n{extra}".strip()
    return str(row.get("prompt", row.get("text", "")))


def read_prompts(path: Path) -> list[str]:
    """Every non-empty first user turn of a .json (a list) or .jsonl file, or of every such file in a folder."""
    if not path.exists():
        raise FileNotFoundError(f"No prompts file at {path}: pass --prompts FILE (a .json list or .jsonl of prompts).")
    if path.is_dir():
        return [p for f in sorted(path.glob("*.json*")) for p in read_prompts(f)]
    text = path.read_text(encoding="utf-8")
    rows = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
    return [t for t in (first_user_turn(r).strip() for r in rows) if t]


def sample_prompts(path: Path, n: int, seed: int = 0, max_chars: int = 1500) -> list[str]:
    """A fixed, seeded sample of `n` prompts of at most `max_chars` characters (long ones would only time prefill)."""
    pool = [p for p in read_prompts(path) if len(p) <= max_chars]
    if not pool:
        raise ValueError(f"{path} has no prompt of at most {max_chars} characters: raise --max-prompt-chars.")
    rng = random.Random(seed)
    return rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]
