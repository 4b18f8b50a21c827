"""What `arbiter local` watches while it runs: its parts answering, and any of them exiting.

"Up" means answering, not started: the container's ``/ping`` is 200 (its model loaded and read
checked), the runtime API answers ``/metrics``, and the worker pool's metrics count every
process ready (``arbiter_worker_ready``: engine loaded, queue found); a started process can take
minutes to answer. Meanwhile a line every ``every_s`` says what is still loading; the parts' own
logs say which step (weights, read check) they are in.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp

from worker.local_ports import Ports

PROGRESS_S = 10.0
Check = Callable[[aiohttp.ClientSession], Awaitable[str | None]]  # None: answering; else what


async def first_exit(children: dict[str, subprocess.Popen[bytes]]) -> tuple[str, int]:
    """The first child to exit, and its status (a part that dies stops the stack)."""
    while True:
        for name, child in children.items():
            code = child.poll()
            if code is not None:
                return name, code
        await asyncio.sleep(0.2)


def _checks(ports: Ports, container_url: str, processes: int) -> dict[str, Check]:
    checks: dict[str, Check] = {}
    if ports.container is not None:

        async def container(http: aiohttp.ClientSession) -> str | None:
            async with http.get(f"{container_url}/ping") as got:
                return None if got.status == 200 else "loading its model"

        checks[ports.container.name] = container
    if ports.runtime is not None:
        runtime_url = f"http://127.0.0.1:{ports.runtime.port}/metrics"

        async def runtime(http: aiohttp.ClientSession) -> str | None:
            async with http.get(runtime_url) as got:
                return None if got.status == 200 else f"answering {got.status}"

        checks[ports.runtime.name] = runtime
    if ports.metrics is not None:
        metrics_url = f"http://127.0.0.1:{ports.metrics.port}/metrics"

        async def pool(http: aiohttp.ClientSession) -> str | None:
            async with http.get(metrics_url) as got:
                ready = ready_processes(await got.text())
            return None if ready >= processes else f"{ready:.0f} of {processes} processes ready"

        checks["the worker pool (arbiter work)"] = pool
    return checks


def ready_processes(text: str) -> float:
    """``arbiter_worker_ready``'s value in a Prometheus text page (0 before any worker set it)."""
    for line in text.splitlines():
        if line.startswith("arbiter_worker_ready "):
            return float(line.split()[1])
    return 0.0


async def wait_up(
    ports: Ports, container_url: str, processes: int, every_s: float = PROGRESS_S
) -> float:
    """Seconds until every part answers; says what is still loading every ``every_s``."""
    started = time.monotonic()
    pending = _checks(ports, container_url, processes)
    state = dict.fromkeys(pending, "starting")
    said = started
    timeout = aiohttp.ClientTimeout(total=2)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while pending:
            for name, check in list(pending.items()):
                try:
                    why = await check(http)
                except (aiohttp.ClientError, TimeoutError):
                    why = state[name]  # not listening yet
                if why is None:
                    del pending[name]
                    waited = time.monotonic() - started
                    print(f"arbiter local: {name} answers ({waited:.0f} s)", flush=True)
                else:
                    state[name] = why
            now = time.monotonic()
            if pending and now - said >= every_s:
                said = now
                waiting = "; ".join(f"{name}: {state[name]}" for name in pending)
                print(f"arbiter local: waiting {now - started:.0f} s for {waiting}", flush=True)
            if pending:
                await asyncio.sleep(0.25)
    sys.stdout.flush()
    return time.monotonic() - started
