"""Chat import: the JSON that the export writes (ChatStore.export_json, one chat; export_all_json, every chat) read
back as new chats.

Scope: checking a file's bytes and turning them into `ImportedChat`s; ChatStore.import_chats stores them. It does NOT
touch the database, and never names an existing chat: every imported chat is added under a new id, so an import can
add chats but not change or replace one.

A file is untrusted input (it may come from anyone): at most MAX_IMPORT_BYTES, UTF-8 JSON nested at most a few
levels, every field of the shape the export writes (pydantic, strict: no "3" for 3, no NaN), each text within the
limits the page keeps to, and no lone surrogate (SQLite cannot store one). A file that fails is refused whole, in
one sentence that says where and what to do; nothing of it is stored. Stats are display data: only numbers, short
texts and lists of numbers are kept, and the fields the chat's stats line formats must be numbers. The generation
settings are kept as they are written; each value is checked when the chat is answered (SettingsStore.for_chat).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from store.chats import EXPORT_FORMAT, ROLES
from store.settings import GENERATION_KEYS

MAX_IMPORT_BYTES = 5 * 1024 * 1024  # the page's upload limit (ui/server.py MAX_UPLOAD): a backup of many chats
MAX_CHATS = 10_000
MAX_MESSAGES = 100_000  # per chat
MAX_VERSIONS = 100  # per reply (Regenerate's alternatives)
TITLE_CHARS = 200  # ui/chat.py RENAME_CHARS: what the list can show
MODEL_CHARS = 4_096  # a model folder's path
MAX_DEPTH = 12  # the export nests 9 deep (document, chats, chat, messages, message, versions, version, stats, a list)
_NUMERIC_STATS = ("tokens", "tokens_per_s", "ttft_s", "hit_rate")  # ui/chat_view.stats_line formats them as numbers
_SURROGATE = re.compile("[\ud800-\udfff]")


class ImportRefused(ValueError):
    """The file cannot be imported; the message is a sentence saying why and what to do."""


Number = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class _Version(_Strict):
    content: str
    stats: dict[str, Any] | None = None


class _Message(_Strict):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str
    stats: dict[str, Any] | None = None
    created: Number | None = None
    alternatives: Annotated[list[_Version], Field(max_length=MAX_VERSIONS)] = []
    chosen: Annotated[int, Field(ge=0)] = 0


class _Conversation(_Strict):
    title: Annotated[str, Field(max_length=TITLE_CHARS)] = ""
    created: Number | None = None
    updated: Number | None = None
    model: Annotated[str, Field(max_length=MODEL_CHARS)] = ""
    generation: dict[str, Any] | None = None


class _Chat(_Strict):
    conversation: _Conversation
    messages: Annotated[list[_Message], Field(max_length=MAX_MESSAGES)]


class _One(_Strict):
    format: Literal[EXPORT_FORMAT]  # type: ignore[valid-type]
    version: Literal[1]
    conversation: _Conversation
    messages: Annotated[list[_Message], Field(max_length=MAX_MESSAGES)]


class _All(_Strict):
    format: Literal[EXPORT_FORMAT + "s"]  # type: ignore[valid-type]
    version: Literal[1]
    conversations: Annotated[list[_Chat], Field(max_length=MAX_CHATS)]


@dataclass(frozen=True)
class ImportedMessage:
    role: str
    content: str
    stats: dict[str, Any] | None
    created: float | None
    alternatives: tuple[tuple[str, dict[str, Any] | None], ...]  # (content, stats) of every version; () for one
    chosen: int


@dataclass(frozen=True)
class ImportedChat:
    title: str
    created: float | None
    updated: float | None
    model: str
    generation: dict[str, Any] | None
    messages: tuple[ImportedMessage, ...]


_WHAT_TO_DO = "Import a file that fmoe-local's “Export all chats (JSON)” wrote, as it was written."


def check_size(size: int) -> None:
    """ImportRefused for a file of `size` bytes that is too large to import (checked before it is read)."""
    if size > MAX_IMPORT_BYTES:
        raise ImportRefused(
            f"This file is {size / 1024**2:.1f} MB; an import can be at most {MAX_IMPORT_BYTES // 1024**2} MB. "
            "Export fewer chats, or split the file."
        )


def parse_export(raw: bytes) -> list[ImportedChat]:
    """The chats in an exported file's bytes; ImportRefused (a sentence) for anything else."""
    check_size(len(raw))
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ImportRefused(f"This file is not a chat export (it is not JSON text). {_WHAT_TO_DO}") from None
    if _depth(doc) > MAX_DEPTH:
        raise ImportRefused(f"This file is nested deeper than a chat export is. {_WHAT_TO_DO}")
    if not isinstance(doc, dict) or doc.get("format") not in (EXPORT_FORMAT, EXPORT_FORMAT + "s"):
        raise ImportRefused(f"This file is JSON, but not a chat export of fmoe-local. {_WHAT_TO_DO}")
    try:
        if doc["format"] == EXPORT_FORMAT:
            one = _One.model_validate(doc)
            chats = [_Chat(conversation=one.conversation, messages=one.messages)]
        else:
            chats = _All.model_validate(doc).conversations
    except ValidationError as exc:
        raise ImportRefused(f"This chat export cannot be read: {_where(exc)}. {_WHAT_TO_DO}") from None
    return [_chat(c, i) for i, c in enumerate(chats, 1)]


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a chat export holds")


def _depth(value: Any) -> int:
    """How deep `value` nests (iteratively: a deep file must not exhaust the stack here either)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level > MAX_DEPTH:
                return level
            todo.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _where(exc: ValidationError) -> str:
    first = exc.errors()[0]
    path = ".".join(str(part) for part in first["loc"])
    return f"{path or 'the file'}: {first['msg']}"


def _chat(chat: _Chat, number: int) -> ImportedChat:
    conv = chat.conversation
    where = f"chat {number} (“{conv.title[:40]}”)"
    messages = []
    for m in chat.messages:
        versions = tuple((v.content, _stats(v.stats)) for v in m.alternatives)
        if versions and m.chosen >= len(versions):
            raise ImportRefused(f"In {where}, a reply's chosen version does not exist. {_WHAT_TO_DO}")
        if not versions and m.chosen:
            raise ImportRefused(f"In {where}, a reply chooses a version it does not have. {_WHAT_TO_DO}")
        content, stats = (versions[m.chosen][0], versions[m.chosen][1]) if versions else (m.content, _stats(m.stats))
        messages.append(ImportedMessage(m.role, content, stats, m.created, versions, m.chosen))
    texts = [conv.title, conv.model, json.dumps(conv.generation)] + [m.content for m in messages]
    texts += [v for m in messages for v, _ in m.alternatives]
    if any(_SURROGATE.search(t) for t in texts):
        raise ImportRefused(
            f"{where.capitalize()} holds text that is not valid Unicode (half a character). {_WHAT_TO_DO}"
        )
    generation = None
    if conv.generation is not None:  # only what a chat holds; each value is checked when the chat is answered
        generation = {key: conv.generation[key] for key in GENERATION_KEYS if key in conv.generation}
    title = conv.title.strip() or "Imported chat"
    return ImportedChat(title, conv.created, conv.updated, conv.model, generation, tuple(messages))


def _stats(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the chat can show of a reply's stats: numbers, short texts and lists of numbers; a stats line's numbers
    only as numbers. Anything else is dropped (display data; the reply's text is what matters)."""
    if not stats:
        return None
    kept: dict[str, Any] = {}
    for key, value in stats.items():
        if len(key) > 64 or _SURROGATE.search(key):
            continue
        if _number(value):
            kept[key] = value
        elif key in _NUMERIC_STATS:
            continue
        elif value is None or isinstance(value, bool) or (isinstance(value, str) and len(value) <= 200):
            kept[key] = value if not isinstance(value, str) or not _SURROGATE.search(value) else None
        elif isinstance(value, list) and len(value) <= 4096 and all(_number(v) for v in value):
            kept[key] = value
    return kept or None


def _number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) < 2**63  # what SQLite and JSON readers take as a number
    return isinstance(value, float) and math.isfinite(value)
