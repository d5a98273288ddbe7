"""Loaded by the app under test (PYTHONPATH): record and refuse every non-loopback connection and lookup.

Scope: test support only. Each attempt is appended to $FMOE_NET_LOG as one line and fails with OSError, as it
would on an offline machine, so the test sees both what was tried and that the app copes without it.
"""

import ipaddress
import os
import socket

_LOG = os.environ.get("FMOE_NET_LOG")
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "", None}


def _record(what: str) -> None:
    if _LOG:
        with open(_LOG, "a", encoding="utf-8") as f:
            f.write(what + "\n")


def _is_loopback(host) -> bool:
    if host in _LOCAL_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(str(host).split("%")[0])
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex
_getaddrinfo = socket.getaddrinfo


def _guarded(original):
    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            _record(f"connect {address[0]}:{address[1]}")
            raise OSError(101, "Network is unreachable (blocked by the test's network guard)")
        return original(self, address)

    return connect


def getaddrinfo(host, *args, **kwargs):
    if not _is_loopback(host if not isinstance(host, bytes) else host.decode()):
        _record(f"lookup {host}")
        raise socket.gaierror(socket.EAI_NONAME, "Name lookup blocked by the test's network guard")
    return _getaddrinfo(host, *args, **kwargs)


socket.socket.connect = _guarded(_connect)
socket.socket.connect_ex = _guarded(_connect_ex)
socket.getaddrinfo = getaddrinfo

if os.environ.get("FMOE_TEST_TOKEN_DELAY_S") or os.environ.get("FMOE_TEST_TOKEN_HOLD"):
    import slow_tokens  # noqa: F401 - patches token sampling on import
if os.environ.get("FMOE_TEST_REPLY"):
    import scripted_reply  # noqa: F401 - patches token choice on import
