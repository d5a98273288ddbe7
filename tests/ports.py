"""A loopback port that nothing listens on, chosen by the OS, for the tests that serve.

A fixed number per test clashed as soon as two test processes served at once (pytest-xdist's workers splitting a
module between them, or two checkouts' suites on one machine): both found the port free, one could not bind. The
OS hands out a fresh port from its ephemeral range instead. It does NOT test the app's own port choice (app.py's
free_port and --port: tests/test_app_cli.py)."""

from __future__ import annotations

import socket


def unused_port() -> int:
    """A port free on 127.0.0.1 now; the caller binds it at once (the OS does not hand it out again soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
