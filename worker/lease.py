"""Keeping a job's message invisible while the job runs, and noticing when that is no longer possible.

A heartbeat extends the message's visibility every ``heartbeat_interval_s``. The lease is lost, and
the job must stop, when SQS refuses an extension (the message was deleted, or its receipt handle is
stale because another worker received it), when renewals keep failing until the visibility runs
out, or when the next extension would cross SQS's 12-hour limit counted from the receive. In each
case SQS will show the message to another worker, so going on would process the job twice.

Only the 12-hour limit is the job's own fault (it is too large for one message): it counts as a try
and stops the job. A lease lost to an SQS outage is the queue's (:mod:`worker.faults`) and stops
nothing: renewals that keep failing until the visibility runs out are reported to ``on_lost``
(the receive is recorded as uncounted, :mod:`worker.uncounted`) and the job goes on to write its
outcome, through an extension SQS refuses once it answers again (the message was shown to another
worker meanwhile): the first outcome wins, as for any second delivery. Stopping the job instead
would stop every holder of a shard longer than the gaps of a flapping outage, and none would
finish. Renewals go on after a failure run, so a lease whose SQS came back in time is simply
kept. An extension refused while the lease was healthy (the message deleted by someone else) still
stops the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from botocore.exceptions import ClientError

from worker.context import WorkerContext
from worker.faults import Fault
from worker.metrics import WorkerMetrics
from worker.policies import SQS_MAX_VISIBILITY_S, lease_extension
from worker.tries import Receive

log = structlog.get_logger("arbiter.worker")


async def stop_together(keeper: asyncio.Task[Any], work: asyncio.Task[Any]) -> None:
    """Cancel a heartbeat and the work it guards, and wait for both to end: whichever ended first
    stops the other, and what either raised is read from the task afterwards, not here."""
    for task in (keeper, work):
        task.cancel()
    for task in (keeper, work):
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


# Answers that mean the message is no longer ours to extend (not throttling or a server error).
_REFUSED = {"ReceiptHandleIsInvalid", "InvalidParameterValue", "MessageNotInflight"}


@dataclass(frozen=True)
class LeaseLost:
    """Why a lease was lost, and whose fault that is."""

    reason: str
    fault: Fault
    gone: bool = False  # SQS says the message is no longer this worker's (deleted, received again)
    stops: bool = True  # the job stops (False: it goes on, the lease lost to an SQS outage)


class Lease:
    """The visibility of one received message; :meth:`keep` runs beside its job."""

    def __init__(
        self,
        ctx: WorkerContext,
        receive: Receive,
        received_at: float,
        limit_s: float = SQS_MAX_VISIBILITY_S,
        on_lost: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.sqs = ctx.sqs
        self.queue_url = ctx.queue.url
        self.receipt = receive.message["ReceiptHandle"]
        self.settings = settings = ctx.settings
        self.metrics: WorkerMetrics = ctx.metrics
        self.received_at = received_at
        self.limit_s = limit_s
        self.until = received_at + settings.visibility_timeout_s
        self.on_lost = on_lost
        self.lost: str | None = None  # why the lease was lost to the queue, once it was
        # on_lost's call, its own task: stopping the keeper must not cut it between its writes
        # (a record put, then not deleted although its job had ended, is left behind).
        self.reporting: asyncio.Future[None] | None = None

    async def _lost(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            log.warning("visibility.lost", reason=reason, action="the job goes on")
            if self.on_lost is not None:
                self.reporting = asyncio.ensure_future(self.on_lost(reason))
                await asyncio.shield(self.reporting)

    async def reported(self) -> None:
        """Wait for ``on_lost``'s call, if one began (whoever stops the keeper waits for it)."""
        if self.reporting is not None:
            with contextlib.suppress(Exception):
                await self.reporting

    async def keep(self) -> LeaseLost:
        """Renew until cancelled; returns only when the job must stop (the 12-hour limit) or the
        message is no longer this worker's to renew (``gone``), saying why."""
        interval = self.settings.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            seconds = lease_extension(
                now - self.received_at, self.settings.visibility_timeout_s, interval, self.limit_s
            )
            if seconds is None:
                return LeaseLost(
                    f"the job reached SQS's {self.limit_s / 3600:g} h visibility limit; split it "
                    "into smaller jobs",
                    Fault.WORK,
                )
            try:
                await self._renew(seconds)
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                if code in _REFUSED:
                    reason = f"SQS refused to extend the message's visibility ({code})"
                    lapsed = self.lost is not None or time.monotonic() >= self.until
                    if lapsed:  # SQS showed it to another worker once its visibility ran out
                        await self._lost(reason)
                    return LeaseLost(reason, Fault.QUEUE, gone=True, stops=not lapsed)
                error = str(exc)
            except Exception as exc:  # a network blip: the next beat may succeed
                error = f"{type(exc).__name__}: {exc}"
            else:
                self.until = now + seconds
                self.metrics.visibility_extensions.inc()
                log.debug("visibility.extended", seconds=seconds)
                continue
            log.warning("visibility.extend_failed", error=error)
            if time.monotonic() + interval >= self.until:
                await self._lost(
                    f"the message's visibility ran out while renewals failed ({error})"
                )

    async def _renew(self, seconds: int) -> None:
        """One extension. One that has not answered in half the visibility it had left (botocore
        still sending it again through an outage) reports the lease lost then, not when it gives
        up: by that time SQS may be back and the message with another worker, whose count must
        find this receive's record already written."""
        renewal = asyncio.ensure_future(
            self.sqs.change_message_visibility(
                QueueUrl=self.queue_url, ReceiptHandle=self.receipt, VisibilityTimeout=seconds
            )
        )
        try:
            deadline = (self.until - time.monotonic()) / 2
            done, _ = await asyncio.wait({renewal}, timeout=max(0.0, deadline))
            if not done:
                await self._lost("an extension did not answer before the visibility ran out")
            await renewal
        finally:
            if not renewal.done():
                renewal.cancel()
