"""The queue loop of one worker process: receive, keep the lease, ack, back off or dead-letter.

A message is deleted only after every job it announces has its results and summary written (or is
found already done, superseded, or ignorable). A failed job's message is made visible again after
a delay that grows with its count of failed receives; once the redrive policy's ``maxReceiveCount``
is spent, the worker moves it to the dead-letter queue. A job no retry can fix (its input is gone)
and a body that is no job at all go there at their first receive.

While a job runs, its :class:`~worker.lease.Lease` keeps the message invisible, so a slow job is
never handed to a second worker; when the lease cannot be kept (12-hour limit, extension refused),
the job is stopped. A worker that dies stops renewing, and the message returns after the timeout.

A message given back unfinished on purpose (the drain deadline of a deploy) is sent again as a new
message that carries its count of failed receives in a message attribute, so a release never
counts as a failure: a healthy long job survives any number of deploys. A shard message whose job
is being merged by another worker is given back the same way, with a delay (``Deferred``).

What a job or shard message asks for is done by :class:`worker.fanout.FanOut`: small jobs run
whole, large ones are split into shards that any worker scores and one merges.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from arbiter.scorer import Scorer
from worker.events import Ignored, JobRef, ShardRef, UnreadableMessage, parse_message
from worker.fanout import Delivery, FanOut
from worker.jobs import JobFailed, JobRejected, JobReport, thread_runner
from worker.lease import Lease, stop_together
from worker.merge import Deferred
from worker.metrics import WorkerMetrics
from worker.policies import SQS_MAX_VISIBILITY_S, DrainDeadline, ExponentialBackoff, goes_to_dlq
from worker.settings import WorkerSettings

log = structlog.get_logger("arbiter.worker")

FAILED_RECEIVES = "ArbiterFailedReceives"  # message attribute: failed receives before a release


def receive_count(message: dict[str, Any]) -> int:
    """This receive's number among the message's tries: SQS's ``ApproximateReceiveCount`` plus the
    failed receives it carried over from before a release."""
    count = int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
    carried = message.get("MessageAttributes", {}).get(FAILED_RECEIVES, {}).get("StringValue")
    with contextlib.suppress(TypeError, ValueError):
        count += max(0, int(carried))
    return count


@dataclass(frozen=True)
class QueueInfo:
    url: str
    max_receive_count: int | None
    dlq_url: str | None


async def describe_queue(sqs: Any, settings: WorkerSettings) -> QueueInfo:
    """The queue URL and its redrive policy (where failed jobs end up, and after how many tries)."""
    url = settings.queue_url or (await sqs.get_queue_url(QueueName=settings.queue_name))["QueueUrl"]
    attrs = await sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["RedrivePolicy"])
    policy = attrs.get("Attributes", {}).get("RedrivePolicy")
    if not policy:
        return QueueInfo(url, None, None)
    redrive = json.loads(policy)
    dlq_name = redrive["deadLetterTargetArn"].rsplit(":", 1)[-1]
    dlq_url = (await sqs.get_queue_url(QueueName=dlq_name))["QueueUrl"]
    return QueueInfo(url, int(redrive["maxReceiveCount"]), dlq_url)


class Consumer:
    """Receives one message at a time and runs its jobs on ``engine``; see the module doc.

    Engine calls run on one thread of the consumer's own, so that a job cancelled mid-chunk never
    overlaps the next job's calls, and so that a process exiting after a release does not wait for
    that chunk (``asyncio.run`` joins only its default executor).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        s3: Any,
        sqs: Any,
        engine: Scorer,
        queue: QueueInfo,
        metrics: WorkerMetrics | None = None,
        backoff: ExponentialBackoff | None = None,
        visibility_limit_s: float = SQS_MAX_VISIBILITY_S,
    ) -> None:
        self.settings = settings
        self.s3 = s3
        self.sqs = sqs
        self.engine = engine
        self.queue = queue
        self.metrics = metrics or WorkerMetrics(registry=None)
        self.backoff = backoff or ExponentialBackoff(
            settings.backoff_base_s, settings.backoff_max_s
        )
        self.visibility_limit_s = visibility_limit_s
        self.drain = DrainDeadline(settings.drain_deadline_s)
        self._stop = asyncio.Event()
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="arbiter-engine")
        self._run_engine = thread_runner(self._engine_thread)
        self.fanout = FanOut(
            settings,
            s3,
            sqs,
            engine,
            queue.url,
            queue.max_receive_count,
            queue.dlq_url,
            self.metrics,
            self._run_engine,
        )
        self.on_job_start: Callable[[JobRef], None] | None = None

    def stop(self) -> None:
        """Stop receiving; the job in hand may finish until the drain deadline."""
        self.drain.start()
        self._stop.set()

    async def run(self) -> None:
        """Receive and handle messages until :meth:`stop`, then drain."""
        log.info("worker.ready", queue=self.queue.url)
        try:
            await self._loop()
        finally:
            # An engine call abandoned at the drain deadline may still be computing: not waited for.
            self._engine_thread.shutdown(wait=False, cancel_futures=True)
        log.info("worker.stopped")

    async def _loop(self) -> None:
        while not self._stop.is_set():
            received_at = time.monotonic()  # SQS's 12 h count starts at the receive request
            receive = asyncio.create_task(self._receive())
            stopped = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait({receive, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if receive not in done:
                # A message caught by the cancelled long poll only comes back after its
                # visibility timeout; nothing is lost.
                receive.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await receive
                return
            stopped.cancel()
            try:
                messages = receive.result()
            except Exception as exc:  # SQS unreachable for a moment: retry, do not die
                log.error("queue.receive_failed", error=f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=1.0)
                continue
            for message in messages:
                task = asyncio.create_task(self.handle(message, received_at))
                await self._drain_or_finish(task, message)
                if self._stop.is_set():
                    return

    async def _drain_or_finish(self, task: asyncio.Task[None], message: dict[str, Any]) -> None:
        """Wait for the job; once draining, only until the deadline, then release its message."""
        if not self.drain.draining:
            stop_wait = asyncio.create_task(self._stop.wait())
            await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
        if not task.done():
            await asyncio.wait({task}, timeout=self.drain.remaining())
        if not task.done():
            log.warning("worker.drain_deadline", action="release")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self._release(message)
            return
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:  # acking failed: the message returns after its timeout; keep going
            log.exception("message.handling_failed")

    async def _receive(self) -> list[dict[str, Any]]:
        response = await self.sqs.receive_message(
            QueueUrl=self.queue.url,
            MaxNumberOfMessages=1,
            WaitTimeSeconds=self.settings.wait_time_s,
            VisibilityTimeout=self.settings.visibility_timeout_s,
            MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp"],
            MessageAttributeNames=[FAILED_RECEIVES],
        )
        messages: list[dict[str, Any]] = response.get("Messages", [])
        now_ms = time.time() * 1000
        for message in messages:
            sent = message.get("Attributes", {}).get("SentTimestamp")
            if sent:
                self.metrics.receive_latency.observe(max(0.0, (now_ms - int(sent)) / 1000))
        return messages

    async def handle(self, message: dict[str, Any], received_at: float | None = None) -> None:
        """Run every job the message announces, then delete it; on failure, back off."""
        received_at = time.monotonic() if received_at is None else received_at
        count = receive_count(message)
        bound = structlog.contextvars.bound_contextvars(
            message_id=message.get("MessageId"), receive_count=count
        )
        with bound:
            try:
                entries = parse_message(
                    message["Body"],
                    bucket=self.settings.bucket,
                    input_prefix=self.settings.input_prefix,
                )
            except UnreadableMessage as exc:
                log.error("message.unreadable", reason=str(exc))
                self.metrics.jobs.labels("unreadable").inc()
                await self._dead_letter(message, "unreadable")
                return
            lease = Lease(
                self.sqs,
                self.queue.url,
                message,
                self.settings,
                self.metrics,
                received_at,
                self.visibility_limit_s,
            )
            keeper = asyncio.create_task(lease.keep())
            delivery = Delivery(message.get("MessageId"), count)
            work = asyncio.create_task(self._run_all(entries, delivery))
            try:
                await asyncio.wait({keeper, work}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # whichever ends first stops the other (and a cancelled handle stops both)
                await stop_together(keeper, work)
            if work.cancelled():
                lost = keeper.exception()
                reason = keeper.result() if lost is None else f"the heartbeat failed: {lost!r}"
                log.error("job.lease_lost", reason=reason)
                await self._fail(message, count, JobFailed(reason))
            elif isinstance(error := work.exception(), Deferred):
                self.metrics.jobs.labels("deferred").inc()
                await self._release(message, delay_s=error.seconds, reason=str(error))
            elif error is not None:
                await self._fail(message, count, error)
            elif work.result():
                await self._dead_letter(message, "permanent")
            else:
                await self._delete(message)

    async def _run_all(
        self, entries: list[JobRef | ShardRef | Ignored], delivery: Delivery
    ) -> list[str]:
        """Run the message's jobs in turn; the reasons of those rejected for good."""
        rejected = []
        for entry in entries:
            if isinstance(entry, Ignored):
                log.info("job.ignored", reason=entry.reason)
                self.metrics.jobs.labels("ignored").inc()
                continue
            try:
                await self._run(entry, delivery)
            except JobRejected as exc:
                log.error("job.rejected", key=entry.key, reason=str(exc))
                self.metrics.jobs.labels("rejected").inc()
                rejected.append(str(exc))
        return rejected

    async def _run(self, ref: JobRef | ShardRef, delivery: Delivery) -> JobReport:
        started = time.perf_counter()
        what = "shard" if isinstance(ref, ShardRef) else "job"
        with structlog.contextvars.bound_contextvars(bucket=ref.bucket, key=ref.key, etag=ref.etag):
            log.info(f"{what}.started")
            if self.on_job_start is not None and isinstance(ref, JobRef):
                self.on_job_start(ref)
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

    async def _delete(self, message: dict[str, Any]) -> None:
        await asyncio.shield(
            self.sqs.delete_message(QueueUrl=self.queue.url, ReceiptHandle=message["ReceiptHandle"])
        )

    async def _fail(self, message: dict[str, Any], receive_count: int, exc: BaseException) -> None:
        delay = self.backoff.delay(receive_count)
        to_dlq = goes_to_dlq(receive_count, self.queue.max_receive_count)
        self.metrics.jobs.labels("failed").inc()
        log.error(
            "job.failed",
            error=f"{type(exc).__name__}: {exc}",
            retry_in_s=delay,
            dead_letter=to_dlq,
        )
        if to_dlq and self.queue.dlq_url:
            # Moved by the worker, not left to the redrive policy: the count includes failed
            # receives carried over from before a release, which SQS's own count does not.
            why = f"{type(exc).__name__}: {exc}"
            await self.fanout.give_up(message["Body"], why, receive_count)
            await self._dead_letter(message, "max_receives")
            return
        await self._set_visibility(message, delay)

    async def _release(
        self, message: dict[str, Any], delay_s: int = 0, reason: str | None = None
    ) -> None:
        """Give the message back (drain deadline passed: at once; a merge held elsewhere: after
        ``delay_s``) for another worker: sent again as a new message carrying its failed receives,
        then deleted, so the release is not counted as a receive that failed. If the copy cannot be
        sent, it is made visible instead (after the delay)."""
        failed = receive_count(message) - 1
        try:
            await asyncio.shield(
                self.sqs.send_message(
                    QueueUrl=self.queue.url,
                    MessageBody=message["Body"],
                    DelaySeconds=delay_s,
                    MessageAttributes={
                        FAILED_RECEIVES: {"DataType": "Number", "StringValue": str(failed)}
                    },
                )
            )
        except Exception as exc:
            log.warning("release.resend_failed", error=f"{type(exc).__name__}: {exc}")
            await self._set_visibility(message, delay_s)
        else:
            with contextlib.suppress(Exception):  # a copy left over is a harmless duplicate
                await self._delete(message)
        if delay_s:
            log.info("job.deferred", retry_in_s=delay_s, reason=reason)
        else:
            log.info("job.released")

    async def _set_visibility(self, message: dict[str, Any], seconds: int) -> None:
        try:
            await asyncio.shield(
                self.sqs.change_message_visibility(
                    QueueUrl=self.queue.url,
                    ReceiptHandle=message["ReceiptHandle"],
                    VisibilityTimeout=seconds,
                )
            )
        except Exception as exc:  # it still returns after its visibility timeout
            log.warning("visibility.change_failed", error=str(exc))

    async def _dead_letter(self, message: dict[str, Any], reason: str) -> None:
        """To the DLQ at once when there is one (then deleted): a message no retry can fix, or
        one out of tries. Without a DLQ, a message no retry can fix is dropped (and logged)."""
        if self.queue.dlq_url:
            await self.sqs.send_message(QueueUrl=self.queue.dlq_url, MessageBody=message["Body"])
            self.metrics.dlq_moves.labels(reason).inc()
        log.error("message.dead_lettered", reason=reason, dlq=bool(self.queue.dlq_url))
        await self._delete(message)
