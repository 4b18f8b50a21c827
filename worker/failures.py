"""What a failed receive becomes: the one place that decides it.

A failure of the work itself (:class:`worker.faults.Fault`) counts: the message backs off, and on a
shard message's last try (:mod:`worker.tries`) its shards are failed for good. A store or queue
fault, or an end-of-job race, gives the message back without spending a try. A job message past
its tries gets its last look, then the dead-letter queue; a shard message one past them is left
to the last try it may overlap. A job's input that its role may not read counts until its last
try, then is rejected with its record; an input gone or damaged is rejected at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from worker.events import Ref, ShardRef
from worker.fanout import FanOut
from worker.faults import Fault, classify, describe
from worker.jobs import InputDenied, JobRejected, LastTryMayRun, OutOfTries
from worker.metrics import WorkerMetrics
from worker.replies import Replies
from worker.settings import WorkerSettings
from worker.tries import Receive, Tries
from worker.uncounted import Uncounted

log = structlog.get_logger("arbiter.worker")


@dataclass(frozen=True)
class Failed:
    """A receive that failed: whose fault, and the error."""

    fault: Fault
    error: str


class Failures:
    """Answers the failed receives of one worker (see the module doc)."""

    def __init__(
        self,
        settings: WorkerSettings,
        fanout: FanOut,
        replies: Replies,
        uncounted: Uncounted,
        metrics: WorkerMetrics,
        tries: Tries,
    ) -> None:
        self.settings, self.fanout, self.replies = settings, fanout, replies
        self.uncounted, self.metrics, self.tries = uncounted, metrics, tries

    def rejection(self, exc: JobRejected | InputDenied, receive: Receive) -> JobRejected | None:
        """The rejection a job's failure becomes, or None while it still counts as a try (an
        input its role may not read, before its last try: a grant may be on its way)."""
        if isinstance(exc, JobRejected):
            return exc
        if not self.tries.last(receive.count):
            return None
        tried = f"{exc} (refused on each of its {receive.count} tries)"
        return JobRejected(tried, exc.keys)

    async def answer(
        self, receive: Receive, exc: BaseException, lease_lost: bool = False
    ) -> Failed | None:
        """Answer a receive whose work failed with ``exc``; the failure, if it was one (a job out
        of tries and a shard left to its last try are not: they are answered and done).
        ``lease_lost``: its lease was lost to the queue before."""
        if isinstance(exc, OutOfTries):
            await self._out_of_tries(receive, exc)
            await self.uncounted.clear(receive, lease_lost)
            return None
        if isinstance(exc, LastTryMayRun):
            # Left to the holder it may have: neither deleted (that would end its lease, and its
            # work with it) nor copied; back in two visibility timeouts unless it finishes.
            delay = 2 * self.settings.visibility_timeout_s
            log.warning("shard.last_look", reason=str(exc), retry_in_s=delay)
            await self.replies.back_off(receive, delay)
            return None
        failed = Failed(classify(exc), describe(exc))
        if lease_lost and failed.fault.counts:
            # Its lease was lost to the queue, but the work failed on its own: a try.
            await self.uncounted.forget(receive)
        if failed.fault.counts:
            await self._counted(receive, failed.error)
        elif failed.fault is Fault.RACE:
            await self._busy(receive, failed)
        else:
            await self._outage(receive, failed)
        return failed

    async def _out_of_tries(self, receive: Receive, error: Exception) -> None:
        """A job message past its tries, its job neither finished nor split: one last look after
        two visibility timeouts (a slow holder the message was shown again behind may yet finish
        or split it), then the dead-letter queue."""
        if receive.last_look:
            log.error("job.out_of_tries", tries=self.tries.limit, reason=str(error))
            await self.replies.dead_letter(receive, "max_receives")
            return
        delay = 2 * self.settings.visibility_timeout_s
        log.warning("job.last_look", tries=self.tries.limit, retry_in_s=delay)
        await self.replies.release(receive, self.tries.carried(receive, last_look=True), delay)

    async def _busy(self, receive: Receive, failed: Failed) -> None:
        """Another worker is doing this step now (:class:`worker.faults.Busy`): given back after
        a backoff that grows with each such receive; no try, no outage clock, no error line."""
        delay = self.tries.outage_delay(receive)
        log.info("message.busy", error=failed.error, retry_in_s=delay)
        await self.replies.release(receive, self.tries.carried(receive, busy=True), delay)

    async def _counted(self, receive: Receive, why: str) -> None:
        """Back off; on a shard's last try, fail the shard for good (its job goes on). A job
        message backs off on its last try too: the receive after it (past the tries, the redrive
        allows 3 more) repairs a split job, or gives the job its last look and then dead-letters
        it (``Handler``): moved by the worker, not left to the redrive, since the count includes
        failed receives carried over from before a release. A merge is never given up by the
        worker: it is a function of outcomes that exist, and the job cannot end without it; it
        backs off until it succeeds or SQS's redrive moves it (a job message re-sent then repairs
        the job)."""
        delay = self.tries.retry_delay(receive)
        refs = receive.refs
        last = self.tries.last(receive.count) and _shards(refs)
        self.metrics.jobs.labels("failed").inc()
        log.error("job.failed", error=why, retry_in_s=delay, last_try=last)
        if not last or not await self._give_up(refs, why):
            await self.replies.back_off(receive, delay)
            return
        await self.replies.delete(receive)

    async def _outage(self, receive: Receive, failed: Failed) -> None:
        """Give the message back, after the backoff of its outages, as a new message that carries
        its count (:meth:`worker.tries.Tries.carried`): SQS's redrive never sees an outage. Past
        ``ARBITER_MAX_OUTAGE_S`` of nothing but outages, the message is given up instead (a shard
        failed, a job or merge dead-lettered), before SQS's retention would drop it silently."""
        self.metrics.outage_retries.labels(failed.fault.value).inc()
        refs = receive.refs
        if self.tries.outage_over(receive):
            why = f"{failed.fault.value} unavailable for {self.tries.max_outage_s:g} s: {failed.error}"
            log.error("message.outage_too_long", fault=failed.fault.value, error=failed.error)
            if not _shards(refs):
                await self.replies.dead_letter(receive, "outage")
                return
            if await self._give_up(refs, why):
                await self.replies.delete(receive)
                return
        delay = self.tries.outage_delay(receive)
        log.warning(
            "message.outage",
            fault=failed.fault.value,
            error=failed.error,
            retry_in_s=delay,
            outages=receive.outages + 1,
        )
        await self.replies.release(receive, self.tries.carried(receive, outage=True), delay)

    async def _give_up(self, refs: list[Ref], why: str) -> bool:
        """Fail the message's shards for good; whether that was written (if not, the next
        receive, past the tries, fails them then)."""
        out = Receive(self.tries.limit + 1, reason=why)
        try:
            for ref in refs:
                await self.fanout.run(ref, out)
        except Exception as again:
            log.error("shard.give_up_failed", error=describe(again))
            return False
        return True


def _shards(refs: list[Ref]) -> bool:
    return bool(refs) and all(isinstance(e, ShardRef) for e in refs)
