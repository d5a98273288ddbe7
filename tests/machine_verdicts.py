"""This machine's dtype verdicts (fmoe_local.dtype_verdicts) for the apps the tests start in a process of their own.

An app's first start on a machine measures them: 5-12 s of probes under the suite's load (docs/bench.md, session 23),
which every later start of a user's app skips by reading them back from its settings. `keep(data_dir)` takes them
from the first stopped app of this test process; `seed(data_dir)` writes them into a data folder before a start, so
the starts after the first read them back as a user's do. The probes have tests of their own
(tests/test_dtype_verdicts.py, test_openvino_products.py, test_ui_session.py).
"""

from __future__ import annotations

from pathlib import Path

_SAVED: list[str] = []  # this test process's, once one app has saved them


def seed(data_dir: Path) -> None:
    """Before an app starts on `data_dir`: the verdicts kept, where it has none saved."""
    from store import open_store

    if _SAVED:
        data_dir.mkdir(parents=True, exist_ok=True)  # a path that does not exist would name a database file
        with open_store(data_dir) as store:
            if not store.settings.load().dtype_verdicts:
                store.settings.set(dtype_verdicts=_SAVED[0])


def keep(data_dir: Path) -> None:
    """After an app on `data_dir` stopped: its saved verdicts, if none are kept yet."""
    from store import StoreError, open_store

    if not _SAVED and data_dir.is_dir():
        try:
            with open_store(data_dir) as store:
                saved = store.settings.load().dtype_verdicts
        except StoreError:  # a test's own failure (an app that did not start, a damaged folder) must show, not this
            return
        if saved:
            _SAVED.append(saved)
