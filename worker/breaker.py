"""A circuit breaker per dependency: while the store (or the queue) is down, the worker stops taking
messages, so that no message is held, killed or failed by the outage.

A receive that fails on a store fault (:mod:`worker.faults`) *opens* the store's breaker; the
worker then receives nothing until a probe (one ``ListObjectsV2`` of a key the role may list)
succeeds, tried after a delay that doubles from ``base_s`` to ``max_s`` while probes fail. The
queue's breaker is opened by a failed ``ReceiveMessage``, and the next receive is its probe. A new
worker process probes the store before its first receive, so a process restarted in the middle of
an outage does not take a message only to give it back.

Each opening and each closing is one log line (``store.unavailable`` with the error,
``store.available`` with how long it was down) and a metric: ``arbiter_worker_circuit_open``
(1 while open) and ``arbiter_worker_circuit_opens_total``, by dependency.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog

from worker.faults import describe
from worker.metrics import WorkerMetrics

log = structlog.get_logger("arbiter.worker")

Probe = Callable[[], Awaitable[object]]


class CircuitBreaker:
    """The breaker of one dependency (``store`` or ``queue``) of one worker; see the module doc."""

    def __init__(
        self,
        dependency: str,
        metrics: WorkerMetrics,
        probe: Probe | None = None,
        base_s: float = 1.0,
        max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dependency, self.metrics, self.probe = dependency, metrics, probe
        self.base_s, self.max_s, self.clock = base_s, max_s, clock
        self.opened_at: float | None = None
        self.retry_at = 0.0
        self.failures = 0  # in a row, since a message last succeeded
        self._unknown = probe is not None  # a breaker with a probe probes before its first use
        self.metrics.circuit_open.labels(dependency).set(0)

    @property
    def open(self) -> bool:
        return self.opened_at is not None

    def trip(self, error: str) -> None:
        """A call failed on this dependency's fault: stop until ``retry_at``."""
        now = self.clock()
        self._unknown = False
        self.failures += 1
        self.retry_at = now + min(self.max_s, self.base_s * 2 ** min(self.failures - 1, 30))
        if self.opened_at is None:
            self.opened_at = now
            self.metrics.circuit_open.labels(self.dependency).set(1)
            self.metrics.circuit_opens.labels(self.dependency).inc()
            log.error(f"{self.dependency}.unavailable", error=error, retry_in_s=self.base_s)

    def closed(self) -> None:
        """A call (or a probe) succeeded: receive again."""
        self._unknown = False
        if self.opened_at is not None:
            down = round(self.clock() - self.opened_at, 1)
            self.opened_at = None
            self.metrics.circuit_open.labels(self.dependency).set(0)
            log.warning(f"{self.dependency}.available", down_s=down, failures=self.failures)

    def succeeded(self) -> None:
        """A message was handled: the next outage's delays start from ``base_s`` again."""
        self.closed()
        self.failures = 0

    async def wait(self, stop: asyncio.Event) -> bool:
        """Return once the dependency may be used (probing it when there is a probe), or False
        if ``stop`` is set first."""
        while self.open or self._unknown:
            delay = self.retry_at - self.clock()
            if delay > 0 and not self._unknown:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
            if stop.is_set():
                return False
            if self.probe is None:
                return True  # the caller's next call is the probe
            if not await self._probe(stop):
                return False
        return True

    async def _probe(self, stop: asyncio.Event) -> bool:
        """One probe, raced with ``stop``; False if stopped first."""
        assert self.probe is not None
        probe = asyncio.ensure_future(self.probe())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({probe, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not probe.done():
                probe.cancel()
                with contextlib.suppress(BaseException):
                    await probe
        if not probe.done() or probe.cancelled():
            return False
        if (error := probe.exception()) is not None:
            self.trip(describe(error))
        else:
            self.closed()
        return True
