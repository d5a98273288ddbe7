"""Run test bodies on threads at once and hand back what they raised (an exception in a thread fails no test)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_in_threads(*targets: Callable[[], None]) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - returned to the test, which asserts there are none
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
