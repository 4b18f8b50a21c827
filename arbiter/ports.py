"""A listening port taken before anything slow starts, or refused in one line.

`arbiter serve`, the pool's metrics port and the runtime API each bind their socket first and
serve on it (aiohttp's ``SockSite``), so a busy port is one line, status 2, naming the variable
that moves it, before a model loads (25 s for the 1.5B) or a queue is touched, not a traceback
after.

A parent that claimed a part's port itself (``arbiter local`` holds every port of its stack from
before anything starts, so two stacks started together cannot both pass the check) hands the
listening socket down: ``ARBITER_LISTEN_FDS`` maps a port to an inherited descriptor, and
:func:`bind` adopts it instead of binding again.
"""

from __future__ import annotations

import errno
import os
import random
import socket
from collections.abc import Collection
from pathlib import Path

from arbiter.errors import ArbiterError

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_SPARE = 10_000
INHERITED = "ARBITER_LISTEN_FDS"  # "PORT=FD,...": sockets a parent bound and passed down


def bind(host: str, port: int, what: str, variable: str) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port), listening; ArbiterError if it cannot be.
    One a parent handed down for ``port`` is adopted (once) instead."""
    inherited = _adopt(port)
    if inherited is not None:
        return inherited
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


def handed_down(socks: Collection[socket.socket]) -> dict[str, str]:
    """The environment that has a child adopt ``socks`` (pass their descriptors too)."""
    return {INHERITED: ",".join(f"{s.getsockname()[1]}={s.fileno()}" for s in socks)}


def _adopt(port: int) -> socket.socket | None:
    """The listening socket inherited for ``port``, taken out of the environment so that nothing
    in this process (or a process it starts) adopts the same descriptor twice."""
    entries = [e.partition("=") for e in os.environ.get(INHERITED, "").split(",") if e]
    found = [fd for p, _, fd in entries if port and p == str(port)]
    if not found:
        return None
    rest = ",".join(f"{p}={fd}" for p, _, fd in entries if p != str(port))
    if rest:
        os.environ[INHERITED] = rest
    else:
        del os.environ[INHERITED]
    sock = socket.socket(fileno=int(found[0]))
    sock.setblocking(False)
    return sock


def why(exc: BaseException | None) -> str:
    """What a failed bind says, in a few words."""
    if isinstance(exc, OSError):
        return "in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
    return str(exc)


def spare_port(host: str, avoid: Collection[int] = ()) -> int:
    """A port free on ``host`` now, for a process that binds it later (``arbiter local`` hands its
    parts their ports): from outside the kernel's ephemeral range, where no outgoing connection
    takes its source port in the seconds before the part binds it. A port bind(0) finds free is
    one of those (CI: a stack's runtime API refused the port its stack had just found free); bind(0)
    is the fallback where that range leaves no room."""
    try:
        low, high = (int(n) for n in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32_768, 60_999  # Linux's default
    span = range(LOWEST_SPARE, low) if low - LOWEST_SPARE >= 4_000 else range(high + 1, 65_536)
    for _ in range(200 if len(span) > 100 else 0):
        port = random.randrange(span.start, span.stop)
        if port in avoid:
            continue
        try:
            bind(host, port, "a spare port", "").close()
        except ArbiterError:
            continue
        return port
    with bind(host, 0, "a spare port", "") as sock:
        return int(sock.getsockname()[1])
