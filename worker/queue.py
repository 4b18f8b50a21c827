"""The queue loop of one worker process: receive, heartbeat, ack or back off.

A message is deleted only after every job it announces has its results and summary written (or is
found already done, superseded, or ignorable). A failed job's message is made visible again after
a delay that grows with SQS's ``ApproximateReceiveCount``; once the redrive policy's
``maxReceiveCount`` is spent, SQS itself moves it to the dead-letter queue. While a job runs, a
heartbeat keeps extending the message's visibility, so a slow job is never handed to a second
worker; a worker that dies stops the heartbeat, and the message returns after the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from worker.events import Ignored, JobRef, UnreadableMessage, parse_message
from worker.jobs import JobReport, Scorer, run_job
from worker.metrics import WorkerMetrics
from worker.policies import DrainDeadline, ExponentialBackoff, goes_to_dlq
from worker.settings import WorkerSettings

log = structlog.get_logger("arbiter.worker")


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
    """Receives one message at a time and runs its jobs on ``engine``; see the module doc."""

    def __init__(
        self,
        settings: WorkerSettings,
        s3: Any,
        sqs: Any,
        engine: Scorer,
        queue: QueueInfo,
        metrics: WorkerMetrics | None = None,
        backoff: ExponentialBackoff | None = None,
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
        self.drain = DrainDeadline(settings.drain_deadline_s)
        self._stop = asyncio.Event()
        self._busy: asyncio.Task[None] | None = None
        self.on_job_start: Callable[[JobRef], None] | None = None

    def stop(self) -> None:
        """Stop receiving; the job in hand may finish until the drain deadline."""
        self.drain.start()
        self._stop.set()

    async def run(self) -> None:
        """Receive and handle messages until :meth:`stop`, then drain."""
        log.info("worker.ready", queue=self.queue.url)
        while not self._stop.is_set():
            receive = asyncio.create_task(self._receive())
            stopped = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait({receive, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if receive not in done:
                # A message caught by the cancelled long poll only comes back after its
                # visibility timeout; nothing is lost.
                receive.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await receive
                break
            stopped.cancel()
            try:
                messages = receive.result()
            except Exception as exc:  # SQS unreachable for a moment: retry, do not die
                log.error("queue.receive_failed", error=f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=1.0)
                continue
            for message in messages:
                self._busy = asyncio.create_task(self.handle(message))
                await self._drain_or_finish(self._busy, message)
                self._busy = None
                if self._stop.is_set():
                    break
        log.info("worker.stopped")

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
        )
        messages: list[dict[str, Any]] = response.get("Messages", [])
        now_ms = time.time() * 1000
        for message in messages:
            sent = message.get("Attributes", {}).get("SentTimestamp")
            if sent:
                self.metrics.receive_latency.observe(max(0.0, (now_ms - int(sent)) / 1000))
        return messages

    async def handle(self, message: dict[str, Any]) -> None:
        """Run every job the message announces, then delete it; on failure, back off."""
        receive_count = int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
        bound = structlog.contextvars.bound_contextvars(
            message_id=message.get("MessageId"), receive_count=receive_count
        )
        with bound:
            try:
                entries = parse_message(
                    message["Body"],
                    bucket=self.settings.bucket,
                    input_prefix=self.settings.input_prefix,
                )
            except UnreadableMessage as exc:
                await self._poison(message, str(exc))
                return
            heartbeat = asyncio.create_task(self._heartbeat(message))
            try:
                for entry in entries:
                    if isinstance(entry, Ignored):
                        log.info("job.ignored", reason=entry.reason)
                        self.metrics.jobs.labels("ignored").inc()
                        continue
                    await self._run(entry)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                heartbeat.cancel()
                await self._fail(message, receive_count, exc)
                return
            finally:
                heartbeat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeat
            await self._delete(message)

    async def _run(self, ref: JobRef) -> JobReport:
        started = time.perf_counter()
        with structlog.contextvars.bound_contextvars(bucket=ref.bucket, key=ref.key, etag=ref.etag):
            log.info("job.started")
            if self.on_job_start is not None:
                self.on_job_start(ref)
            report = await run_job(self.s3, self.engine, ref, self.settings, self.metrics)
            seconds = time.perf_counter() - started
            self.metrics.jobs.labels(report.outcome).inc()
            if report.outcome == "ok":
                self.metrics.job_seconds.observe(seconds)
            summary = report.summary or {}
            log.info(
                "job.finished",
                outcome=report.outcome,
                results=report.keys.results if report.keys else None,
                lines=summary.get("lines"),
                failed=summary.get("failed"),
                seconds=round(seconds, 3),
            )
            return report

    async def _heartbeat(self, message: dict[str, Any]) -> None:
        interval = self.settings.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sqs.change_message_visibility(
                    QueueUrl=self.queue.url,
                    ReceiptHandle=message["ReceiptHandle"],
                    VisibilityTimeout=self.settings.visibility_timeout_s,
                )
            except Exception as exc:  # the next beat may succeed; the job goes on
                log.warning("visibility.extend_failed", error=str(exc))
                continue
            self.metrics.visibility_extensions.inc()
            log.debug("visibility.extended", seconds=self.settings.visibility_timeout_s)

    async def _delete(self, message: dict[str, Any]) -> None:
        await asyncio.shield(
            self.sqs.delete_message(QueueUrl=self.queue.url, ReceiptHandle=message["ReceiptHandle"])
        )

    async def _fail(self, message: dict[str, Any], receive_count: int, exc: Exception) -> None:
        delay = self.backoff.delay(receive_count)
        to_dlq = goes_to_dlq(receive_count, self.queue.max_receive_count)
        self.metrics.jobs.labels("failed").inc()
        log.error(
            "job.failed",
            error=f"{type(exc).__name__}: {exc}",
            retry_in_s=delay,
            dead_letter=to_dlq,
        )
        if to_dlq:
            # SQS moves it on its next receive; make that happen now rather than after a backoff.
            self.metrics.dlq_moves.labels("max_receives").inc()
            delay = 0
        await self._set_visibility(message, delay)

    async def _release(self, message: dict[str, Any]) -> None:
        """Give the message back at once (drain deadline passed): another worker takes it."""
        await self._set_visibility(message, 0)
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

    async def _poison(self, message: dict[str, Any], reason: str) -> None:
        """A message no retry can fix: straight to the DLQ when there is one, then deleted."""
        log.error("message.unreadable", reason=reason, dead_letter=bool(self.queue.dlq_url))
        self.metrics.jobs.labels("unreadable").inc()
        if self.queue.dlq_url:
            await self.sqs.send_message(QueueUrl=self.queue.dlq_url, MessageBody=message["Body"])
            self.metrics.dlq_moves.labels("unreadable").inc()
        await self._delete(message)
