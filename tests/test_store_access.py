"""A database this user cannot write (store/access.py): refused at open with the owner and the command that gives it
back, never opened to lose every reply; a lock file that cannot be opened is the one named."""

from __future__ import annotations

import sqlite3

import pytest

from store import StoreError, open_store


def _open_read_only(monkeypatch):
    """What SQLite does with a file this user cannot write (root's after one sudo run, chmod 444): it opens it
    read-only. Forced here with mode=ro, since root (who runs the tests) may write any file whatever its mode."""
    import store.db as db_module

    real_connect = db_module.connect

    def read_only(path):
        db = real_connect(path)
        db.conn.close()
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
        return type(db)(conn, execute_plugins=False)

    monkeypatch.setattr(db_module, "connect", read_only)


def test_a_database_that_cannot_be_written_is_refused_at_open_not_at_the_first_send(tmp_path, monkeypatch):
    """Before: a current file needs no write to open, so it opened, and every Send then failed with "attempt to
    write a readonly database": replies lost."""
    path = tmp_path / "fmoe-local.db"
    with open_store(tmp_path) as store:
        store.chats.create("keep me")
    before = path.read_bytes()
    _open_read_only(monkeypatch)
    with pytest.raises(StoreError) as info:
        open_store(tmp_path)
    said = str(info.value)
    assert f"The database {path} cannot be saved to" in said and "--data-dir" in said
    assert path.read_bytes() == before and not list(tmp_path.glob("*.corrupt-*"))
    monkeypatch.undo()
    with open_store(tmp_path) as store:  # the refusal released the instance lock
        assert [c.title for c in store.chats.list()] == ["keep me"]


def test_a_database_left_to_another_user_names_them_and_the_command(tmp_path, monkeypatch):
    pwd = pytest.importorskip("pwd")
    import store.access as access

    path = tmp_path / "fmoe-local.db"
    with open_store(tmp_path):
        pass
    owner = pwd.getpwuid(path.stat().st_uid).pw_name
    _open_read_only(monkeypatch)
    monkeypatch.setattr(access, "_current_uid", lambda: path.stat().st_uid + 1)  # we are someone else
    with pytest.raises(StoreError) as info:
        open_store(tmp_path)
    said = str(info.value)
    assert f"belong to {owner}, not to you" in said
    command = said.split("sudo chown $USER ")[1].split(" — ")[0].split()
    assert command[0] == str(path) and f"{path}.lock" in command  # every file of the store, in one command


def test_a_lock_file_that_cannot_be_opened_is_named_not_its_writable_folder(tmp_path, monkeypatch):
    """Before: "Cannot write in <folder>" when only the lock file (root's after a sudo run) could not be opened."""
    pwd = pytest.importorskip("pwd")
    import errno

    import store.access as access
    from store.lock import InstanceLock

    with open_store(tmp_path):
        pass
    lock = tmp_path / "fmoe-local.db.lock"
    uid = lock.stat().st_uid
    owner = pwd.getpwuid(uid).pw_name

    def denied(self):
        raise PermissionError(errno.EACCES, "Permission denied", str(self.path))

    monkeypatch.setattr(InstanceLock, "acquire", denied)
    monkeypatch.setattr(access, "_current_uid", lambda: uid + 1)
    with pytest.raises(StoreError) as info:
        open_store(tmp_path)
    said = str(info.value)
    assert f"Cannot open the lock file {lock} (Permission denied)" in said and "Cannot write in" not in said
    assert f"belong to {owner}" in said and str(lock) in said.split("sudo chown $USER")[1]
    monkeypatch.setattr(access, "_current_uid", lambda: uid)
    with pytest.raises(StoreError, match=rf"Cannot open the lock file .*chmod u\+w {lock}"):
        open_store(tmp_path)
    lock.unlink()  # no lock file: then it is the folder that cannot be written
    with pytest.raises(StoreError, match=rf"Cannot write in {tmp_path} \(Permission denied\)"):
        open_store(tmp_path)
