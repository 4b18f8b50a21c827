"""Whether the container may be given work: its ``GET /ping`` answers 200 within 2 s, SageMaker's
health check. On AWS traffic reaches an instance only once its ping passes; the async workers here
take a request from the backlog only then, and wait with a backoff while it does not (a model
loading, a container not started yet or restarting), so a request accepted meanwhile waits in the
queue instead of failing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from arbiter.logging import get_logger

log = get_logger("arbiter.runtime")
PING_TIMEOUT_S = 2.0  # SageMaker's /ping timeout
FRESH_S = 2.0  # a passed ping is believed this long before the next one is sent


class Readiness:
    """Shared by the workers: one ping at a time, remembered for ``FRESH_S``."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        container_url: str,
        *,
        first_delay_s: float = 0.1,
        most_delay_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.http = http
        self.url = container_url.rstrip("/") + "/ping"
        self.first_delay_s = first_delay_s
        self.most_delay_s = most_delay_s
        self.clock = clock
        self.passed_at: float | None = None
        self.lock = asyncio.Lock()
        self.waiting_since: float | None = None

    def lost(self) -> None:
        """A worker could not reach the container: ping again before the next request."""
        self.passed_at = None

    async def probe(self) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=PING_TIMEOUT_S)
            async with self.http.get(self.url, timeout=timeout) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def wait(self) -> None:
        """Return once the container is ready (at once while the last passed ping is fresh)."""
        async with self.lock:
            delay = self.first_delay_s
            while self.passed_at is None or self.clock() - self.passed_at > FRESH_S:
                if await self.probe():
                    self.passed_at = self.clock()
                    if self.waiting_since is not None:
                        waited = round(self.clock() - self.waiting_since, 1)
                        log.info("container_ready", url=self.url, waited_s=waited)
                        self.waiting_since = None
                    break
                if self.waiting_since is None:
                    self.waiting_since = self.clock()
                    log.info("container_not_ready", url=self.url, action="async requests wait")
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.most_delay_s)
