"""What one received message's entries are run as, and what a failed receive becomes: the fan-out
runs each job, shard or merge (:class:`worker.fanout.FanOut`), with a log line and metrics around
it; a failure backs off, or, on the worker's last try, fails a shard for good or dead-letters a job
(:mod:`worker.replies` says why the worker, not the redrive, decides)."""

from __future__ import annotations

import time
from typing import Any

import structlog

from worker.events import Ignored, Ref, ShardRef
from worker.fanout import Delivery, FanOut
from worker.jobs import JobRejected, JobReport
from worker.metrics import WorkerMetrics
from worker.policies import ExponentialBackoff, goes_to_dlq
from worker.replies import Replies

log = structlog.get_logger("arbiter.worker")


class Dispatch:
    """Runs the entries of received messages for one worker, and answers their failures."""

    def __init__(
        self,
        fanout: FanOut,
        replies: Replies,
        metrics: WorkerMetrics,
        backoff: ExponentialBackoff,
        tries: int,
    ) -> None:
        self.fanout, self.replies, self.metrics = fanout, replies, metrics
        self.backoff, self.tries = backoff, tries

    async def run_all(self, entries: list[Ref | Ignored], delivery: Delivery) -> list[str]:
        """Run the message's jobs in turn; the reasons of those rejected for good."""
        rejected = []
        for entry in entries:
            if isinstance(entry, Ignored):
                log.info("job.ignored", reason=entry.reason)
                self.metrics.jobs.labels("ignored").inc()
                continue
            try:
                await self.run(entry, delivery)
            except JobRejected as exc:
                log.error("job.rejected", key=entry.key, reason=str(exc))
                self.metrics.jobs.labels("rejected").inc()
                rejected.append(str(exc))
        return rejected

    async def run(self, ref: Ref, delivery: Delivery) -> JobReport:
        started = time.perf_counter()
        what = {"ShardRef": "shard", "MergeRef": "merge"}.get(type(ref).__name__, "job")
        with structlog.contextvars.bound_contextvars(bucket=ref.bucket, key=ref.key, etag=ref.etag):
            log.info(f"{what}.started")
            report = await self.fanout.run(ref, delivery)
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

    async def fail(
        self,
        message: dict[str, Any],
        entries: list[Ref | Ignored],
        receive_count: int,
        exc: BaseException,
    ) -> None:
        """A failed receive: back off; on a shard's last try, fail the shard for good (its job
        goes on). A job message backs off on its last try too: the receive after it (past the
        tries, the redrive allows 3 more) repairs a split job, or gives the job its last look
        and then dead-letters it (``Consumer``): moved by the worker, not left to the redrive,
        since the count includes failed receives carried over from before a release. A merge is
        never given up by the worker: it is a function of outcomes that exist, and the job cannot
        end without it; it backs off until it succeeds or SQS's redrive moves it (a job message
        re-sent then repairs the job)."""
        delay = self.backoff.delay(receive_count)
        refs = [e for e in entries if not isinstance(e, Ignored)]
        shards = bool(refs) and all(isinstance(e, ShardRef) for e in refs)
        last = goes_to_dlq(receive_count, self.tries) and shards
        why = f"{type(exc).__name__}: {exc}"
        self.metrics.jobs.labels("failed").inc()
        log.error("job.failed", error=why, retry_in_s=delay, last_try=last)
        if not last:
            await self.replies.back_off(message, delay)
            return
        out = Delivery(message.get("MessageId"), self.tries + 1, reason=why)
        try:
            for ref in refs:
                await self.fanout.run(ref, out)
        except Exception as again:  # the next receive, past the tries, fails it then
            log.error("shard.give_up_failed", error=f"{type(again).__name__}: {again}")
            await self.replies.back_off(message, delay)
            return
        await self.replies.delete(message)
