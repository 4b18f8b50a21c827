"""An aiohttp app served on 127.0.0.1 from a thread of its own, for synchronous clients (hypothesis
examples, schemathesis cases) that cannot share the test's event loop."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web


@contextmanager
def serve(
    app: web.Application, ready_path: str = "/ping", timeout_s: float = 120, port: int = 0
) -> Iterator[str]:
    """Serve ``app`` (on ``port``; 0: any free one) until the block ends; yields its base URL once
    ``ready_path`` answers 200."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, object] = {}

    async def start() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        holder["runner"] = runner
        holder["port"] = runner.addresses[0][1]
        started.set()

    thread = threading.Thread(target=loop.run_forever, name="live-server", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    base = f"http://127.0.0.1:{holder['port']}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(base + ready_path, timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield base
    finally:
        runner = holder["runner"]
        assert isinstance(runner, web.AppRunner)
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


async def ready(client: Any) -> None:
    """Wait until an aiohttp test client's app answers ``/ping`` with 200 (its model is loaded)."""
    for _ in range(500):
        if (await client.get("/ping")).status == 200:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never ready")
