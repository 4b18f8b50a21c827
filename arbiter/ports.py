"""A listening port taken before anything slow starts, or refused in one line.

`arbiter serve` used to load its model (25 s for the 1.5B) and then die on a busy port with a
25-line traceback; the pool's metrics port and the runtime API did the same. Each now binds its
socket first and serves on it (aiohttp's ``SockSite``), so a busy port is one line, status 2,
naming the variable that moves it, before a model loads or a queue is touched.
"""

from __future__ import annotations

import errno
import socket

from arbiter.errors import ArbiterError


def bind(host: str, port: int, what: str, variable: str) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port), listening; ArbiterError if it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's own sites do
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ArbiterError(
            f"cannot listen on {host}:{port} for {what}: the port is {why(exc)}; set {variable}"
        ) from exc
    sock.setblocking(False)
    return sock


def why(exc: BaseException | None) -> str:
    """What a failed bind says, in a few words."""
    if isinstance(exc, OSError):
        return "in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
    return str(exc)
