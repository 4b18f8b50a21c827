"""What one received message's entries are run as, and what a failed receive becomes: the fan-out
runs each job, shard or merge (:class:`worker.fanout.FanOut`), with a log line and metrics around
it. A failure of the work itself (:mod:`worker.faults`) backs off, or, on the message's last try
(:mod:`worker.tries`), fails a shard for good; a store or queue fault gives the message back for
later without spending a try."""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from worker.events import Ignored, Ref, ShardRef
from worker.fanout import FanOut
from worker.faults import Fault, classify, describe
from worker.jobs import InputDenied, JobRejected, JobReport, write_rejection
from worker.metrics import WorkerMetrics
from worker.replies import Replies
from worker.tries import Receive, Tries

log = structlog.get_logger("arbiter.worker")


@dataclass(frozen=True)
class Failed:
    """A receive that failed: whose fault, and the error."""

    fault: Fault
    error: str


class Dispatch:
    """Runs the entries of received messages for one worker, and answers their failures."""

    def __init__(
        self, fanout: FanOut, replies: Replies, metrics: WorkerMetrics, tries: Tries
    ) -> None:
        self.fanout, self.replies, self.metrics, self.tries = fanout, replies, metrics, tries

    async def run_all(self, receive: Receive) -> list[str]:
        """Run the message's jobs in turn; the reasons of those rejected for good."""
        rejected = []
        for entry in receive.entries:
            if isinstance(entry, Ignored):
                log.info("job.ignored", reason=entry.reason)
                self.metrics.jobs.labels("ignored").inc()
                continue
            try:
                await self.run(entry, receive)
            except InputDenied as exc:
                if not self.tries.last(receive.count):
                    raise  # counts: backed off, read again (a grant may be on its way)
                tried = f"{exc} (refused on each of its {receive.count} tries)"
                rejected.append(await self._reject(entry, JobRejected(tried, exc.keys)))
            except JobRejected as exc:
                rejected.append(await self._reject(entry, exc))
        return rejected

    async def _reject(self, entry: Ref, exc: JobRejected) -> str:
        log.error("job.rejected", key=entry.key, reason=str(exc))
        await write_rejection(self.fanout.s3, self.fanout.bucket, entry, exc)
        self.metrics.jobs.labels("rejected").inc()
        return str(exc)

    async def run(self, ref: Ref, receive: Receive) -> JobReport:
        started = time.perf_counter()
        what = {"ShardRef": "shard", "MergeRef": "merge"}.get(type(ref).__name__, "job")
        with structlog.contextvars.bound_contextvars(bucket=ref.bucket, key=ref.key, etag=ref.etag):
            log.info(f"{what}.started")
            report = await self.fanout.run(ref, receive)
            seconds = time.perf_counter() - started
            if report.outcome != "shard":
                self.metrics.jobs.labels(report.outcome).inc()
            if report.outcome == "ok":
                self.metrics.job_seconds.observe(seconds)
            elif report.outcome == "merged" and report.summary:
                self.metrics.job_seconds.observe(report.summary["seconds"]["total"])
            summary = report.summary or {}
            log.info(
                f"{what}.finished",
                outcome=report.outcome,
                results=report.keys.results if report.keys else None,
                lines=summary.get("lines"),
                failed=summary.get("failed"),
                seconds=round(seconds, 3),
            )
            return report

    async def fail(self, receive: Receive, exc: BaseException) -> Failed:
        """A failed receive: a failure of the work counts (:meth:`_counted`); a store or queue
        fault gives the message back without spending a try (:meth:`_outage`), and so does an
        end-of-job race (:meth:`_busy`)."""
        failed = Failed(classify(exc), describe(exc))
        if failed.fault.counts:
            await self._counted(receive, failed.error)
        elif failed.fault is Fault.RACE:
            await self._busy(receive, failed)
        else:
            await self._outage(receive, failed)
        return failed

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
