"""Conversations and their messages: create, append, edit the last reply, rename, delete, list, search, export
as JSON (the Markdown export is a rendering: ui/export.py).

Replies keep alternatives: a regenerated reply is added to the message's versions (schema v4) and chosen; the
chosen version is the message's content, so what the model reads next is the one the user picked.

Scope: chat history in SQLite, returned as frozen dataclasses. It does NOT render anything (the UI does) and does
not know about models beyond the name and settings a conversation was held with. Per-reply stats are stored as
the JSON of `RequestStats.to_dict()` (or any dict) and come back as a dict.

Search: an FTS5 trigram index over message contents (schema v2) when SQLite has FTS5 and the query has at least
3 characters, else LIKE; both match substrings, case-insensitively, so results do not depend on which one ran.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from store.db import StoreDb

if TYPE_CHECKING:
    from store.chat_import import ImportedChat

ROLES = ("system", "user", "assistant")
EXPORT_FORMAT = "fmoe-local-chat"


class ChatNotFoundError(LookupError):
    def __init__(self, conversation_id: int) -> None:
        super().__init__(f"Conversation {conversation_id} no longer exists. Pick another one from the list.")
        self.conversation_id = conversation_id


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    created: float  # Unix seconds
    updated: float  # last message or rename
    model: str
    settings: dict[str, Any]
    # The chat's own generation settings (store.settings.GENERATION_KEYS → value), as saved; None: the saved
    # defaults. Read through SettingsStore.for_chat, which checks each value.
    generation: dict[str, Any] | None = None


@dataclass(frozen=True)
class Alternative:
    """One version of a reply."""

    content: str
    stats: dict[str, Any] | None


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    position: int  # 0-based order inside the conversation
    role: str
    content: str
    stats: dict[str, Any] | None
    created: float
    alternatives: tuple[Alternative, ...] = ()  # every version of a reply (empty: only this one), in order made
    chosen: int = 0  # which of them is shown and read by the model (its content and stats are this message's)


@dataclass(frozen=True)
class SearchHit:
    conversation: Conversation
    snippet: str  # where the text was found (a title or a piece of a message)


def _conversation(row: tuple) -> Conversation:
    cid, title, created, updated, model, settings_json, generation_json = row
    generation = _json_object(generation_json) if generation_json is not None else None
    return Conversation(cid, title, created, updated, model, json.loads(settings_json or "{}"), generation)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}  # unreadable (a damaged row): every value the default's
    return value if isinstance(value, dict) else {}


def _message(row: tuple) -> Message:
    mid, cid, position, role, content, stats_json, created, alternatives_json, chosen = row
    versions = tuple(Alternative(a["content"], a["stats"]) for a in json.loads(alternatives_json or "[]"))
    stats = json.loads(stats_json) if stats_json else None
    return Message(mid, cid, position, role, content, stats, created, versions, chosen)


def _alternatives_json(versions: list[Alternative]) -> str:
    return json.dumps([{"content": a.content, "stats": a.stats} for a in versions])


def _stats_dict(stats: Any) -> dict | None:
    return json.loads(_stats_json(stats)) if stats is not None else None


def _stats_json(stats: Any) -> str | None:
    if stats is None:
        return None
    if hasattr(stats, "to_dict"):
        stats = stats.to_dict()
    return json.dumps(stats)


_CONV_COLS = "id, title, created, updated, model, settings_json, generation_json"
_MSG_COLS = "id, conversation_id, position, role, content, stats_json, created, alternatives_json, chosen"


class ChatStore:
    def __init__(self, store_db: StoreDb) -> None:
        self._s = store_db

    # --- conversations ----------------------------------------------------------------------------------------

    def create(
        self, title: str = "New chat", model: str = "", settings: dict | None = None, generation: dict | None = None
    ) -> Conversation:
        now = time.time()
        row = {"title": title, "created": now, "updated": now, "model": model}
        row["settings_json"] = json.dumps(settings or {})
        row["generation_json"] = None if generation is None else json.dumps(generation, allow_nan=False)
        with self._s.writing():  # as every write: a refusal of the disk is a sentence (db.write_refused)
            cid = self._s.db["conversations"].insert(row).last_pk
        return self.get(cid)

    def get(self, conversation_id: int) -> Conversation:
        with self._s.lock:
            row = self._s.db.execute(
                f"SELECT {_CONV_COLS} FROM conversations WHERE id = ?", [conversation_id]
            ).fetchone()
        if row is None:
            raise ChatNotFoundError(conversation_id)
        return _conversation(row)

    def list(self, limit: int = 200, offset: int = 0) -> list[Conversation]:
        """Most recently updated first."""
        with self._s.lock:
            rows = self._s.db.execute(
                f"SELECT {_CONV_COLS} FROM conversations ORDER BY updated DESC, id DESC LIMIT ? OFFSET ?",
                [limit, offset],
            ).fetchall()
        return [_conversation(r) for r in rows]

    def rename(self, conversation_id: int, title: str) -> Conversation:
        self._update(conversation_id, {"title": title.strip() or "Untitled", "updated": time.time()})
        return self.get(conversation_id)

    def set_model(self, conversation_id: int, model: str, settings: dict | None = None) -> Conversation:
        """Record the model (and the settings) the conversation is now held with."""
        changes: dict[str, Any] = {"model": model}
        if settings is not None:
            changes["settings_json"] = json.dumps(settings)
        self._update(conversation_id, changes)
        return self.get(conversation_id)

    def set_generation(self, conversation_id: int, generation: dict[str, Any]) -> Conversation:
        """Keep `generation` (checked values: SettingsStore.check) as the chat's own settings. Not an update of the
        chat: the list's order (most recently updated first) stays."""
        self._update(conversation_id, {"generation_json": json.dumps(generation, allow_nan=False)})
        return self.get(conversation_id)

    def import_chats(self, chats: list[ImportedChat]) -> list[int]:
        """Add `chats` (store/chat_import.py: checked) as new chats, each under a new id, all in one transaction;
        their ids in order. No existing chat is changed."""
        now = time.time()
        ids = []
        with self._s.writing():
            for chat in chats:
                created = chat.created if chat.created is not None else now
                row = {"title": chat.title, "created": created, "updated": chat.updated or created, "model": chat.model}
                row["settings_json"] = "{}"
                gen = chat.generation
                row["generation_json"] = None if gen is None else json.dumps(gen, allow_nan=False)
                cid = self._s.db["conversations"].insert(row).last_pk
                rows = []
                for position, m in enumerate(chat.messages):
                    versions = [Alternative(content, stats) for content, stats in m.alternatives]
                    rows.append(
                        {
                            "conversation_id": cid, "position": position, "role": m.role, "content": m.content,
                            "stats_json": _stats_json(m.stats), "created": m.created if m.created is not None else created,
                            "alternatives_json": _alternatives_json(versions) if versions else None, "chosen": m.chosen,
                        }
                    )  # fmt: skip
                self._s.db["messages"].insert_all(rows)
                ids.append(cid)
        return ids

    def delete(self, conversation_id: int) -> None:
        with self._s.writing():
            self._s.db.execute("DELETE FROM messages WHERE conversation_id = ?", [conversation_id])
            if not self._s.db.execute("DELETE FROM conversations WHERE id = ?", [conversation_id]).rowcount:
                raise ChatNotFoundError(conversation_id)

    # --- messages ---------------------------------------------------------------------------------------------

    def messages(self, conversation_id: int) -> list[Message]:
        with self._s.lock:
            rows = self._s.db.execute(
                f"SELECT {_MSG_COLS} FROM messages WHERE conversation_id = ? ORDER BY position", [conversation_id]
            ).fetchall()
        return [_message(r) for r in rows]

    def append(
        self, conversation_id: int, role: str, content: str, stats: Any = None, after: int | None = None
    ) -> Message | None:
        """Add a message at the end; `stats` is a RequestStats, a dict, or None. With `after` (the position the
        last message had when a reply started; −1 for none), only if the conversation still ends there — else
        nothing is stored and None is returned: a reply whose question was edited away is not kept alone."""
        _check_role(role)
        now = time.time()
        with self._s.writing():
            position = self._s.db.execute(
                "SELECT coalesce(max(position) + 1, 0) FROM messages WHERE conversation_id = ?", [conversation_id]
            ).fetchone()[0]
            if after is not None and position != after + 1:
                return None
            self._touch(conversation_id, now)
            row = {"conversation_id": conversation_id, "position": position, "role": role, "content": content}
            row.update(stats_json=_stats_json(stats), created=now)
            mid = self._s.db["messages"].insert(row).last_pk
        return self._get_message(mid)

    def update_last(self, conversation_id: int, content: str, stats: Any = None) -> Message:
        """Replace the last message's content and stats (a regenerated or edited reply)."""
        now = time.time()
        with self._s.writing():
            self._touch(conversation_id, now)
            row = self._s.db.execute(
                "SELECT id FROM messages WHERE conversation_id = ? ORDER BY position DESC LIMIT 1", [conversation_id]
            ).fetchone()
            if row is None:
                raise ValueError("This conversation has no message to replace yet. Send a message first.")
            self._s.db["messages"].update(row[0], {"content": content, "stats_json": _stats_json(stats)})
        return self._get_message(row[0])

    def add_alternative(self, conversation_id: int, position: int, content: str, stats: Any = None) -> Message | None:
        """Keep `content` as another version of the reply at `position` and choose it (a regenerated reply); the
        earlier versions stay. Only while that reply is still the conversation's last message — else nothing is
        stored and None is returned (the conversation moved on while the reply was generating)."""
        with self._s.writing():
            last = self._last(conversation_id)
            if last is None or last.position != position or last.role != "assistant":
                return None
            versions = list(last.alternatives) or [Alternative(last.content, last.stats)]
            versions.append(Alternative(content, _stats_dict(stats)))
            self._touch(conversation_id, time.time())
            self._set_version(last.id, versions, len(versions) - 1)
        return self._get_message(last.id)

    def choose_alternative(self, conversation_id: int, position: int, index: int) -> Message:
        """Show version `index` of the reply at `position` (what the model reads from now on)."""
        with self._s.writing():
            row = self._s.db.execute(
                f"SELECT {_MSG_COLS} FROM messages WHERE conversation_id = ? AND position = ?",
                [conversation_id, position],
            ).fetchone()
            if row is None:
                raise ChatNotFoundError(conversation_id)
            m = _message(row)
            if not 0 <= index < len(m.alternatives):
                raise ValueError(f"This reply has {max(1, len(m.alternatives))} version(s); pick one of those.")
            self._set_version(m.id, list(m.alternatives), index)
        return self._get_message(m.id)

    def extend_last(self, conversation_id: int, position: int, more: str, stats: Any = None) -> Message | None:
        """Append `more` to the reply at `position` (a continued reply) and take `stats` as its stats. Only while
        it is still the last message (else None, nothing stored), as `append(after=)`."""
        with self._s.writing():
            last = self._last(conversation_id)
            if last is None or last.position != position or last.role != "assistant":
                return None
            self._touch(conversation_id, time.time())
            if last.alternatives:
                versions = list(last.alternatives)
                versions[last.chosen] = Alternative(last.content + more, _stats_dict(stats))
                self._set_version(last.id, versions, last.chosen)
            else:
                changes = {"content": last.content + more, "stats_json": _stats_json(stats)}
                self._s.db["messages"].update(last.id, changes)
        return self._get_message(last.id)

    def edit(self, conversation_id: int, position: int, content: str) -> Message:
        """The user's message at `position` becomes `content` and every message after it goes (an edited question
        is answered again). One transaction: a failure or a crash half-way keeps the conversation as it was."""
        now = time.time()
        with self._s.writing():
            self._touch(conversation_id, now)
            self._s.db.execute(
                "DELETE FROM messages WHERE conversation_id = ? AND position >= ?", [conversation_id, position]
            )
            row = {"conversation_id": conversation_id, "position": position, "role": "user", "content": content}
            row.update(stats_json=_stats_json(None), created=now)
            mid = self._s.db["messages"].insert(row).last_pk
        return self._get_message(mid)

    # --- search and export ------------------------------------------------------------------------------------

    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Conversations whose title or any message contains `text`, most recent first."""
        text = text.strip()
        if not text:
            return []
        like = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        snippets: dict[int, str] = {}
        with self._s.lock:
            db = self._s.db
            for cid, title in db.execute(
                "SELECT id, title FROM conversations WHERE title LIKE ? ESCAPE '\\'", [like]
            ).fetchall():
                snippets[cid] = title
            if len(text) >= 3 and db["messages_fts"].exists():
                phrase = '"' + text.replace('"', '""') + '"'
                found = db.execute(
                    "SELECT m.conversation_id, m.content FROM messages_fts f JOIN messages m ON m.id = f.rowid "
                    "WHERE messages_fts MATCH ? ORDER BY m.position",
                    [phrase],
                ).fetchall()
            else:
                found = db.execute(
                    "SELECT conversation_id, content FROM messages WHERE content LIKE ? ESCAPE '\\' ORDER BY position",
                    [like],
                ).fetchall()
            for cid, content in found:
                snippets.setdefault(cid, _snippet(content, text))
            if not snippets:
                return []
            marks = ",".join("?" * len(snippets))
            rows = db.execute(
                f"SELECT {_CONV_COLS} FROM conversations WHERE id IN ({marks}) ORDER BY updated DESC, id DESC LIMIT ?",
                [*snippets, limit],
            ).fetchall()
        return [SearchHit(_conversation(r), snippets[r[0]]) for r in rows]

    def export_json(self, conversation_id: int) -> str:
        conv = self.get(conversation_id)
        doc = {
            "format": EXPORT_FORMAT,
            "version": 1,
            "conversation": {**asdict(conv), "created_iso": _iso(conv.created), "updated_iso": _iso(conv.updated)},
            "messages": [{**asdict(m), "created_iso": _iso(m.created)} for m in self.messages(conversation_id)],
        }
        return json.dumps(doc, indent=2, ensure_ascii=False)

    def export_all_json(self) -> str:
        """Every conversation with its messages (alternatives included), read in one snapshot: a backup."""
        with self._s.writing():  # one transaction: a reply saved meanwhile is in it whole or not at all
            convs = [
                _conversation(r) for r in self._s.db.execute(f"SELECT {_CONV_COLS} FROM conversations ORDER BY id")
            ]
            rows = self._s.db.execute(f"SELECT {_MSG_COLS} FROM messages ORDER BY conversation_id, position").fetchall()
        by_conv: dict[int, list] = {}
        for m in map(_message, rows):
            by_conv.setdefault(m.conversation_id, []).append({**asdict(m), "created_iso": _iso(m.created)})
        doc = {
            "format": EXPORT_FORMAT + "s",
            "version": 1,
            "conversations": [
                {
                    "conversation": {**asdict(c), "created_iso": _iso(c.created), "updated_iso": _iso(c.updated)},
                    "messages": by_conv.get(c.id, []),
                }
                for c in convs
            ],
        }
        return json.dumps(doc, indent=2, ensure_ascii=False)

    # --- internals --------------------------------------------------------------------------------------------

    def _get_message(self, message_id: int) -> Message:
        with self._s.lock:
            row = self._s.db.execute(f"SELECT {_MSG_COLS} FROM messages WHERE id = ?", [message_id]).fetchone()
        return _message(row)

    def _last(self, conversation_id: int) -> Message | None:
        row = self._s.db.execute(
            f"SELECT {_MSG_COLS} FROM messages WHERE conversation_id = ? ORDER BY position DESC LIMIT 1",
            [conversation_id],
        ).fetchone()
        return None if row is None else _message(row)

    def _set_version(self, message_id: int, versions: list[Alternative], chosen: int) -> None:
        shown = versions[chosen]
        changes = {"content": shown.content, "stats_json": _stats_json(shown.stats), "chosen": chosen}
        self._s.db["messages"].update(message_id, changes | {"alternatives_json": _alternatives_json(versions)})

    def _touch(self, conversation_id: int, now: float) -> None:
        if not self._s.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", [now, conversation_id]).rowcount:
            raise ChatNotFoundError(conversation_id)

    def _update(self, conversation_id: int, changes: dict) -> None:
        with self._s.writing():
            sets = ", ".join(f"{k} = ?" for k in changes)
            if not self._s.db.execute(
                f"UPDATE conversations SET {sets} WHERE id = ?", [*changes.values(), conversation_id]
            ).rowcount:
                raise ChatNotFoundError(conversation_id)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"Unknown message role '{role}'. Use one of: {', '.join(ROLES)}.")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _snippet(content: str, text: str, width: int = 40) -> str:
    at = content.lower().find(text.lower())
    if at < 0:
        return content[: 2 * width]
    start, end = max(0, at - width), min(len(content), at + len(text) + width)
    return ("…" if start else "") + content[start:end] + ("…" if end < len(content) else "")
