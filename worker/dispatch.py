"""What one received message's entries are run as: the fan-out runs each job, shard or merge
(:class:`worker.fanout.FanOut`), with a log line and metrics around it; a job that is to be
rejected (:meth:`worker.failures.Failures.rejection`) gets its record. What a failed receive
becomes is :mod:`worker.failures`'s."""

from __future__ import annotations

import time

import structlog

from worker.events import Ignored, Ref
from worker.failures import Failures
from worker.fanout import FanOut
from worker.jobs import InputDenied, JobRejected, JobReport, write_rejection
from worker.metrics import WorkerMetrics
from worker.tries import Receive

log = structlog.get_logger("arbiter.worker")


class Dispatch:
    """Runs the entries of received messages for one worker."""

    def __init__(self, fanout: FanOut, failures: Failures, metrics: WorkerMetrics) -> None:
        self.fanout, self.failures, self.metrics = fanout, failures, metrics

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
            except (InputDenied, JobRejected) as exc:
                rejection = self.failures.rejection(exc, receive)
                if rejection is None:
                    raise  # counts: backed off, read again
                rejected.append(await self._reject(entry, rejection))
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
