"""Loopback ports for the servers the tests start in another process.

A port the test picks and a child binds later is free only if nobody takes it in between. Binding
port 0 to find one hands out a port of the kernel's ephemeral range, the range every outgoing
connection takes its source port from: with thousands of connections to moto and the servers during
a run, a port found free there can be a client's a moment later (CI: ``arbiter runtime`` could not
listen on the port its stack was given). These come from below that range instead, from a slice of
their own for each pytest-xdist worker, and one process never hands the same port out twice.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

_LOCK = threading.Lock()
_GIVEN: set[int] = set()
_LOWEST = 10_000


def _ephemeral() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default


def _span() -> range:
    """Ports no outgoing connection takes: below the ephemeral range, or above it if that is small."""
    low, high = _ephemeral()
    if low - _LOWEST >= 4_000:
        return range(_LOWEST, low)
    return range(high + 1, 65_536)


def _slice() -> range:
    """This xdist worker's share of the span (the whole span outside xdist)."""
    span = _span()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if not worker.startswith("gw") or count < 2:
        return span
    index = int(worker[2:]) % count
    size = len(span) // count
    return range(span.start + index * size, span.start + (index + 1) * size)


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_block(size: int = 4) -> int:
    """A base port whose ``size`` ports are free now and were never handed out by this process."""
    ports = _slice()
    with _LOCK:
        for _ in range(500):
            base = random.randrange(ports.start, ports.stop - size)
            block = range(base, base + size)
            if any(port in _GIVEN for port in block):
                continue
            if all(_free(port) for port in block):
                _GIVEN.update(block)
                return base
    raise AssertionError(f"no block of {size} free ports in {ports}")


def free_port() -> int:
    """One free port, as :func:`free_block`."""
    return free_block(1)
