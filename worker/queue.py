"""The queue loop of one worker process: receive, keep the lease, ack, back off or dead-letter.

A message is deleted only after every job it announces has its results and summary written (or is
found already done, superseded, or ignorable; a shard or merge message: its step done). A failed
message is made visible again after a delay that grows with its count of failed receives; once the
worker's own tries are spent (:mod:`worker.replies`), it moves a job or merge message to the
dead-letter queue and fails a shard for good (its job still finishes). A job no retry can fix (its
input is gone) and a body that is no job at all go there at their first receive.

While a job runs, its :class:`~worker.lease.Lease` keeps the message invisible, so a slow job is
never handed to a second worker; when the lease cannot be kept (12-hour limit, extension refused),
the job is stopped. A worker that dies stops renewing, and the message returns after the timeout.

A message given back unfinished on purpose (the drain deadline of a deploy) is sent again as a new
message that carries its count of failed receives in a message attribute, so a release never
counts as a failure: a healthy long job survives any number of deploys.

What a job, shard or merge message asks for is done by :class:`worker.fanout.FanOut`: small jobs
run whole, large ones are split into shards that any worker scores and any worker merges.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from arbiter.scorer import Scorer
from worker.dispatch import Dispatch
from worker.events import (
    UnreadableMessage,
    parse_message,
)
from worker.fanout import Delivery, FanOut
from worker.jobs import JobFailed, OutOfTries, thread_runner
from worker.lease import Lease, stop_together
from worker.metrics import WorkerMetrics
from worker.policies import SQS_MAX_VISIBILITY_S, DrainDeadline, ExponentialBackoff
from worker.replies import (
    FAILED_RECEIVES,
    LAST_LOOK,
    QueueInfo,
    Replies,
    describe_queue,
    last_look,
    receive_count,
)
from worker.settings import WorkerSettings

log = structlog.get_logger("arbiter.worker")

__all__ = ["Consumer", "QueueInfo", "describe_queue", "receive_count"]


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
        self.tries = queue.tries(settings)
        if self.tries < settings.max_receive_count:
            log.warning(
                "queue.redrive_too_tight",
                redrive_max_receive_count=queue.max_receive_count,
                worker_tries=self.tries,
                hint="set the queue's maxReceiveCount to ARBITER_MAX_RECEIVE_COUNT + 3, so the "
                "worker sees the receive after a message's last try",
            )
        self.replies = Replies(sqs, queue, self.metrics)
        self.fanout = FanOut(
            settings,
            s3,
            sqs,
            engine,
            queue.url,
            self.tries,
            queue.dlq_url,
            self.metrics,
            self._run_engine,
        )
        self.dispatch = Dispatch(self.fanout, self.replies, self.metrics, self.backoff, self.tries)

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
            try:
                done, _ = await asyncio.wait(
                    {receive, stopped}, return_when=asyncio.FIRST_COMPLETED
                )
            except asyncio.CancelledError:
                # The worker itself is cancelled: its long poll must not outlive it (it would
                # take a message no one handles, and fail on the closed client unheard).
                receive.cancel()
                stopped.cancel()
                raise
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
            await self.replies.release(message)
            return
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the loop itself is cancelled, not only the job
        except Exception:  # acking failed: the message returns after its timeout; keep going
            log.exception("message.handling_failed")

    async def _out_of_tries(self, message: dict[str, Any], error: OutOfTries) -> None:
        """A job message past its tries, its job neither finished nor split: one last look after
        two visibility timeouts (a slow holder the message was shown again behind may yet finish
        or split it), then the dead-letter queue."""
        if last_look(message):
            log.error("job.out_of_tries", tries=self.tries, reason=str(error))
            await self.replies.dead_letter(message, "max_receives")
            return
        delay = 2 * self.settings.visibility_timeout_s
        log.warning("job.last_look", tries=self.tries, retry_in_s=delay)
        await self.replies.release(message, delay_s=delay, last_look=True)

    async def _receive(self) -> list[dict[str, Any]]:
        response = await self.sqs.receive_message(
            QueueUrl=self.queue.url,
            MaxNumberOfMessages=1,
            WaitTimeSeconds=self.settings.wait_time_s,
            VisibilityTimeout=self.settings.visibility_timeout_s,
            MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp"],
            MessageAttributeNames=[FAILED_RECEIVES, LAST_LOOK],
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
                await self.replies.dead_letter(message, "unreadable")
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
            work = asyncio.create_task(self.dispatch.run_all(entries, delivery))
            try:
                await asyncio.wait({keeper, work}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # whichever ends first stops the other (and a cancelled handle stops both)
                await stop_together(keeper, work)
            if work.cancelled():
                lost = keeper.exception()
                reason = keeper.result() if lost is None else f"the heartbeat failed: {lost!r}"
                log.error("job.lease_lost", reason=reason)
                await self.dispatch.fail(message, entries, count, JobFailed(reason))
            elif isinstance(error := work.exception(), OutOfTries):
                await self._out_of_tries(message, error)
            elif error is not None:
                await self.dispatch.fail(message, entries, count, error)
            elif work.result():
                await self.replies.dead_letter(message, "permanent")
            else:
                await self.replies.delete(message)
