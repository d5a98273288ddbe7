"""Where the store lives: per-OS default, --data-dir folders and --store files."""

from __future__ import annotations

from store import open_store
from store.paths import DB_FILENAME, default_data_dir, models_dir, resolve_db_path


def test_default_data_dir_is_the_per_os_user_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))  # platformdirs' Linux rule
    assert default_data_dir().name == "fmoe-local"
    assert resolve_db_path(None) == default_data_dir() / DB_FILENAME
    assert models_dir(None) == default_data_dir() / "models"


def test_folder_or_file(tmp_path):
    assert resolve_db_path(tmp_path) == tmp_path / DB_FILENAME  # an existing folder
    assert resolve_db_path(f"{tmp_path}/new-folder/") == tmp_path / "new-folder" / DB_FILENAME
    assert resolve_db_path(tmp_path / "maps.sqlite") == tmp_path / "maps.sqlite"


def test_store_file_path_creates_its_folder(tmp_path):
    with open_store(tmp_path / "a" / "b" / "run.db") as s:
        assert s.path == tmp_path / "a" / "b" / "run.db" and s.path.exists()
        assert s.models_dir == tmp_path / "a" / "b" / "models"
