"""One received message, start to end: read it, keep its lease while its jobs run, then answer SQS.

A message is deleted only after every job it announces has its results and summary written (or is
found already done, superseded, or ignorable; a shard or merge message: its step done). A failed
receive is answered by :class:`~worker.failures.Failures` after its fault (:mod:`worker.faults`):
a failure of the work backs off and counts towards the message's tries (:mod:`worker.tries`), a
store or queue fault gives the message back without counting. A job no retry can fix (its input is
gone) and a body that is no job at all go to the dead-letter queue at their first receive.

While a job runs, its :class:`~worker.lease.Lease` keeps the message invisible, so a slow job is
never handed to a second worker. At SQS's 12-hour limit the job is stopped (a try). A lease lost to
the queue stops nothing: the receive is recorded as uncounted (:mod:`worker.uncounted`), the job
goes on and writes its outcome, and a message SQS gave to another worker meanwhile is left to that
worker's answer. A worker that dies stops renewing, and the message returns after the timeout.

The message is read once (:meth:`worker.tries.Receive.read`: its body parsed) and that one
:class:`~worker.tries.Receive` is what every step is handed. Its number is SQS's count less the
receives of its message that met a queue fault (:meth:`worker.uncounted.Uncounted.counted`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from worker.context import WorkerContext
from worker.dispatch import Dispatch
from worker.failures import Failed
from worker.jobs import JobFailed
from worker.lease import Lease, LeaseLost, stop_together
from worker.replies import Replies
from worker.tries import Receive
from worker.uncounted import Uncounted

log = structlog.get_logger("arbiter.worker")


def stops_work(keeper: asyncio.Task[LeaseLost]) -> bool:
    """Whether the lease's end stops the job: its heartbeat crashed, the 12-hour limit, or the
    message deleted under a healthy lease (a lease lost to an SQS outage never does)."""
    if keeper.cancelled():
        return False
    return keeper.exception() is not None or keeper.result().stops


def lease_gone(keeper: asyncio.Task[LeaseLost]) -> bool:
    """SQS says the message is no longer this worker's (deleted, or shown to another)."""
    return (
        keeper.done()
        and not keeper.cancelled()
        and keeper.exception() is None
        and keeper.result().gone
    )


def lease_error(keeper: asyncio.Task[LeaseLost]) -> BaseException:
    """A lease's end that stopped the job (:func:`stops_work`): the job's own fault, a try."""
    crashed = keeper.exception()
    if crashed is not None:
        return JobFailed(f"the heartbeat failed: {crashed!r}")
    return JobFailed(keeper.result().reason)


class Handler:
    """Handles received messages for one worker (see the module doc)."""

    def __init__(
        self,
        ctx: WorkerContext,
        dispatch: Dispatch,
        replies: Replies,
        uncounted: Uncounted,
        visibility_limit_s: float,
    ) -> None:
        self.ctx, self.settings, self.metrics = ctx, ctx.settings, ctx.metrics
        self.dispatch, self.replies, self.uncounted = dispatch, replies, uncounted
        self.failures = dispatch.failures
        self.tries = self.failures.tries
        self.visibility_limit_s = visibility_limit_s
        # Each message in hand's receive as counted (read again by a release at the drain).
        self.receives: dict[str, Receive] = {}

    def read(self, message: dict[str, Any]) -> Receive:
        """This receive of ``message``, its body parsed (once: every step is handed this)."""
        settings = self.settings
        return Receive.read(message, bucket=settings.bucket, input_prefix=settings.input_prefix)

    async def _receive(self, message: dict[str, Any]) -> Receive:
        read = self.read(message)
        self.receives[message["ReceiptHandle"]] = read  # counted next (a drain may come first)
        try:
            receive = await self.uncounted.counted(read, self.tries)
        except Exception as exc:  # S3 cannot say: SQS's count stands (it only counts more)
            log.warning("receive.uncounted_unread", error=f"{type(exc).__name__}: {exc}")
            receive = read
        self.receives[message["ReceiptHandle"]] = receive
        return receive

    async def handle(self, message: dict[str, Any], received_at: float) -> Failed | None:
        """Run every job the message announces, then answer SQS; the failure, if it failed."""
        receive = await self._receive(message)
        bound = structlog.contextvars.bound_contextvars(
            message_id=message.get("MessageId"), receive_count=receive.count
        )
        with bound:
            if receive.unreadable is not None:
                log.error("message.unreadable", reason=receive.unreadable)
                self.metrics.jobs.labels("unreadable").inc()
                await self.replies.dead_letter(receive, "unreadable")
                return None
            lease = Lease(
                self.ctx,
                receive,
                received_at,
                self.visibility_limit_s,
                lambda why: self.uncounted.record(receive, why),
            )
            keeper = asyncio.create_task(lease.keep())
            work = asyncio.create_task(self.dispatch.run_all(receive))
            try:
                await asyncio.wait({keeper, work}, return_when=asyncio.FIRST_COMPLETED)
                if not work.done() and not stops_work(keeper):
                    await asyncio.wait({work})  # a lease lost to the queue: the job goes on
            finally:  # the job stops the keeper (and a cancelled handle stops both)
                await stop_together(keeper, work)
                await lease.reported()
            if work.cancelled():
                self.metrics.jobs.labels("lease_lost").inc()
                error = lease_error(keeper)
                log.error("job.lease_lost", reason=str(error))
                if lease_gone(keeper):
                    return None  # deleted, or another worker's now: nothing to answer
                return await self.failures.answer(receive, error)
            if lease_gone(keeper):  # it went on after an outage; the message is another's now
                self.metrics.jobs.labels("lease_lost").inc()
                log.warning("job.lease_lost", reason=keeper.result().reason, answered=False)
                return None
            failure = work.exception()
            if failure is not None:
                return await self.failures.answer(receive, failure, lease.lost is not None)
            if work.result():
                await self.replies.dead_letter(receive, "permanent")
            else:
                await self.replies.delete(receive)
            await self.uncounted.clear(receive, lease.lost is not None)  # a job run whole too
            return None
