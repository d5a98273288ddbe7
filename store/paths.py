"""Where fmoe-local keeps user data: the data folder, the database file and downloaded models.

Scope: path arithmetic only. It does NOT create folders or open files (db.py does that when the store opens).

Layout of a data folder::

    <data_dir>/fmoe-local.db        chats, settings and expert maps (SQLite)
    <data_dir>/fmoe-local.db.lock   held by the running app (see lock.py)
    <data_dir>/models/              downloaded checkpoints
"""

from __future__ import annotations

from pathlib import Path

from platformdirs import user_data_dir

APP_NAME = "fmoe-local"
DB_FILENAME = "fmoe-local.db"
MODELS_DIRNAME = "models"


def default_data_dir() -> Path:
    """The per-OS user data folder (e.g. ~/.local/share/fmoe-local, ~/Library/Application Support/fmoe-local)."""
    return Path(user_data_dir(APP_NAME, appauthor=False))


def resolve_data_dir(data_dir: str | Path | None = None) -> Path:
    """`--data-dir` when given, else the per-OS default."""
    return Path(data_dir).expanduser() if data_dir else default_data_dir()


def db_path(data_dir: str | Path | None = None) -> Path:
    return resolve_data_dir(data_dir) / DB_FILENAME


def models_dir(data_dir: str | Path | None = None) -> Path:
    return resolve_data_dir(data_dir) / MODELS_DIRNAME


def resolve_db_path(location: str | Path | None) -> Path:
    """Map what a user passed (`--store PATH` or `--data-dir DIR`) to the database file.

    An existing folder, or a path ending in a separator, means a data folder (the file inside it is
    `fmoe-local.db`); anything else is the database file itself. None means the default data folder.
    """
    if location is None:
        return db_path(None)
    text = str(location)
    path = Path(text).expanduser()
    if path.is_dir() or text.endswith(("/", "\\")):
        return path / DB_FILENAME
    return path
