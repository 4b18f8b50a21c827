"""Backpressure: a bounded number of requests compute, a bounded number wait, the rest get a 503.

The model is one llama context per process, so an unbounded queue would only turn load into
timeouts. A request takes a slot (``max_in_flight``) or waits in a FIFO (``max_queue``, at most
``queue_timeout_s``); beyond that it is refused at once with ``ServerBusy`` (503 + Retry-After).

A client that goes away while waiting leaves the queue. A client that goes away while its work is
computing frees its slot when that work really ends (freeing it early would let the next request
pile up behind the model's lock), which is soon: the slot's ``cancel`` flag is set, and the engine
stops at its next decision or ``llama_decode`` boundary (``arbiter.engine.budget``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any, TypeVar

from arbiter.errors import ServerBusy

T = TypeVar("T")


class Slot:
    """A held in-flight slot; blocking work started through it keeps the slot until it ends.
    ``cancel`` is set when the holder leaves while that work still runs (its client went away):
    the work passes it to the engine (``Budget.cancel``), which stops at its next boundary."""

    def __init__(self) -> None:
        self.pending: list[asyncio.Future[Any]] = []
        self.cancel = threading.Event()

    def start(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run ``fn`` in a thread (``asyncio.to_thread``: log context carries over)."""
        future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        future.add_done_callback(_consume)
        self.pending.append(future)
        return future

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` in a thread and wait for it; a cancelled caller does not cancel the work."""
        return await asyncio.shield(self.start(fn, *args))


def _consume(future: asyncio.Future[Any]) -> None:
    # Mark the outcome retrieved: an abandoned (shielded) future must not log "never retrieved".
    if not future.cancelled():
        future.exception()


class Admission:
    """At most ``max_in_flight`` holders, at most ``max_queue`` waiters, FIFO."""

    def __init__(
        self,
        max_in_flight: int,
        max_queue: int,
        queue_timeout_s: float,
        retry_after_s: int = 1,
        on_reject: Callable[[str], None] | None = None,
        on_cancel: Callable[[str], None] | None = None,
    ) -> None:
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._on_reject = on_reject
        self._on_cancel = on_cancel

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    @asynccontextmanager
    async def slot(self, *, admitted: bool = False) -> AsyncIterator[Slot]:
        """Hold a slot for the block. ``admitted``: the request was already let in once (a JSON
        Lines stream takes a slot per chunk) and waits its turn even when the queue is full;
        refusing it mid-stream would drop lines already read. It still waits at most
        ``queue_timeout_s``."""
        await self._acquire(admitted)
        slot = Slot()
        try:
            yield slot
        finally:
            running = [f for f in slot.pending if not f.done()]
            if running:
                # Abandoned: told to stop, and freed when the last piece of work started under
                # this slot finishes.
                slot.cancel.set()
                self._cancelled("computing")
                remaining = len(running)

                def done(_: asyncio.Future[Any]) -> None:
                    nonlocal remaining
                    remaining -= 1
                    if remaining == 0:
                        self._release()

                for future in running:
                    future.add_done_callback(done)
            else:
                self._release()

    async def _acquire(self, admitted: bool = False) -> None:
        if self.in_flight < self.max_in_flight and not self._waiters:
            self.in_flight += 1
            return
        if self.queued >= self.max_queue and not admitted:
            self._reject("queue_full")
            raise ServerBusy(
                f"busy: {self.in_flight} requests computing and {self.queued} waiting (the "
                f"limits are ARBITER_MAX_IN_FLIGHT={self.max_in_flight} and "
                f"ARBITER_MAX_QUEUE={self.max_queue}); retry after {self.retry_after_s} s",
                retry_after=self.retry_after_s,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter
        except (asyncio.CancelledError, TimeoutError) as exc:
            if waiter.done() and not waiter.cancelled():
                self._release()  # the slot was handed over just as we gave up: pass it on
            else:
                self._discard(waiter)
            if isinstance(exc, TimeoutError):
                self._reject("queue_timeout")
                raise ServerBusy(
                    f"busy: no slot within {self.queue_timeout_s:g} s "
                    "(ARBITER_QUEUE_TIMEOUT_S); retry later",
                    retry_after=self.retry_after_s,
                ) from None
            self._cancelled("queued")
            raise

    def _discard(self, waiter: asyncio.Future[None]) -> None:
        with suppress(ValueError):
            self._waiters.remove(waiter)
        waiter.cancel()

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next in line
                return
        self.in_flight -= 1

    def _reject(self, reason: str) -> None:
        if self._on_reject is not None:
            self._on_reject(reason)

    def _cancelled(self, stage: str) -> None:
        if self._on_cancel is not None:
            self._on_cancel(stage)
