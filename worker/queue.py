"""The queue loop of one worker process: receive one message at a time, hand it to its
:class:`~worker.handling.Handler`, and stop taking messages while the store or the queue is down.

Each dependency has a circuit breaker (:mod:`worker.breaker`): a receive that failed on a store
fault opens the store's, a failed ``ReceiveMessage`` the queue's, and nothing is received until the
dependency answers again, so an outage of any length holds no message and burns no try. A message
given back unfinished on purpose (the drain deadline of a deploy, an outage) is sent again as a new
message that carries its count of failed receives (:mod:`worker.tries`), so it is never counted as a
failure: a healthy long job survives any number of deploys and outages.

What a job, shard or merge message asks for is done by :class:`worker.fanout.FanOut`: small jobs
run whole, large ones are split into shards that any worker scores and any worker merges.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from worker.breaker import CircuitBreaker
from worker.context import QueueInfo, WorkerContext
from worker.dispatch import Dispatch
from worker.failures import Failures
from worker.fanout import FanOut
from worker.faults import Fault, describe
from worker.handling import Handler
from worker.jobs import thread_offload
from worker.metrics import WorkerMetrics
from worker.policies import SQS_MAX_VISIBILITY_S, DrainDeadline
from worker.replies import Replies, describe_queue, open_queue
from worker.tries import ATTRIBUTES, Receive
from worker.uncounted import Uncounted

log = structlog.get_logger("arbiter.worker")

__all__ = ["Consumer", "QueueInfo", "describe_queue", "open_queue", "receive_count"]


def receive_count(message: dict[str, Any]) -> int:
    """This receive's number among the message's tries (:class:`worker.tries.Receive`)."""
    return Receive.of(message).count


class Consumer:
    """Receives one message at a time and runs its jobs on ``engine``; see the module doc.

    Engine calls run on one thread of the consumer's own, so that a job cancelled mid-chunk never
    overlaps the next job's calls, and so that a process exiting after a release does not wait for
    that chunk (``asyncio.run`` joins only its default executor).
    """

    def __init__(
        self,
        ctx: WorkerContext,
        visibility_limit_s: float = SQS_MAX_VISIBILITY_S,
        in_hand: Callable[[bool], None] | None = None,
    ) -> None:
        settings, s3, sqs, queue = ctx.settings, ctx.s3, ctx.sqs, ctx.queue
        self.settings, self.s3, self.sqs, self.queue = settings, s3, sqs, queue
        self.engine = ctx.engine
        # Told True while a message is held, False after (the pool's task protection).
        self.in_hand = in_hand or (lambda holding: None)
        self.metrics: WorkerMetrics = ctx.metrics or WorkerMetrics(registry=None)
        self.drain = DrainDeadline(settings.drain_deadline_s)
        self._stop = asyncio.Event()
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="arbiter-engine")
        self.tries = queue.tries(settings)
        if self.tries.too_tight:
            log.warning(
                "queue.redrive_too_tight",
                redrive_max_receive_count=queue.max_receive_count,
                worker_tries=self.tries.limit,
                hint="set the queue's maxReceiveCount to ARBITER_MAX_RECEIVE_COUNT + 3, so the "
                "worker sees the receive after a message's last try",
            )
        # The context as its parts read it: the tries on this queue, the engine's own thread.
        ctx = dataclasses.replace(
            ctx, tries=self.tries, metrics=self.metrics, run=thread_offload(self._engine_thread)
        )
        self.uncounted = Uncounted(s3, settings)
        self.replies = Replies(sqs, queue, self.metrics, self.uncounted)
        self.fanout = FanOut(ctx)
        failures = Failures(
            settings, self.fanout, self.replies, self.uncounted, self.metrics, self.tries
        )
        self.dispatch = Dispatch(self.fanout, failures, self.metrics)
        self.handler = Handler(ctx, self.dispatch, self.replies, self.uncounted, visibility_limit_s)
        base, most = settings.circuit_probe_s, settings.circuit_probe_max_s
        self.store = CircuitBreaker("store", self.metrics, self._probe_store, base, most)
        self.queue_breaker = CircuitBreaker("queue", self.metrics, None, base, most)

    async def _probe_store(self) -> None:
        """One cheap request the worker's role may make: a listing of the shard prefix."""
        await self.s3.list_objects_v2(
            Bucket=self.settings.bucket, Prefix=self.settings.shard_prefix, MaxKeys=1
        )

    def stop(self) -> None:
        """Stop receiving; the job in hand may finish until the drain deadline."""
        self.drain.start()
        self._stop.set()

    async def run(self) -> None:
        """Receive and handle messages until :meth:`stop`, then drain."""
        log.info("worker.ready", queue=self.queue.url)
        self.metrics.ready.set(1)
        try:
            await self._loop()
        finally:
            # An engine call abandoned at the drain deadline may still be computing: not waited for.
            self._engine_thread.shutdown(wait=False, cancel_futures=True)
            self.metrics.ready.set(0)
        log.info("worker.stopped")

    async def _loop(self) -> None:
        while not self._stop.is_set():
            # Nothing is taken while the store or the queue is down (see the module doc).
            if not await self.store.wait(self._stop) or not await self.queue_breaker.wait(
                self._stop
            ):
                return
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
            except Exception as exc:  # SQS unreachable: wait for it, do not die
                self.queue_breaker.trip(describe(exc))
                continue
            self.queue_breaker.closed()
            for message in messages:
                self.in_hand(True)
                try:
                    task = asyncio.create_task(self.handle(message, received_at))
                    await self._drain_or_finish(task, message)
                finally:
                    self.in_hand(False)
                    self.handler.receives.pop(message["ReceiptHandle"], None)
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
            receive = self.handler.receives.get(message["ReceiptHandle"])
            receive = receive or self.handler.read(message)
            await self.replies.release(receive, self.tries.carried(receive))
            return
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the loop itself is cancelled, not only the job
        except Exception:  # acking failed: the message returns after its timeout; keep going
            log.exception("message.handling_failed")

    async def _receive(self) -> list[dict[str, Any]]:
        response = await self.sqs.receive_message(
            QueueUrl=self.queue.url,
            MaxNumberOfMessages=1,
            WaitTimeSeconds=self.settings.wait_time_s,
            VisibilityTimeout=self.settings.visibility_timeout_s,
            MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp"],
            MessageAttributeNames=ATTRIBUTES,
        )
        messages: list[dict[str, Any]] = response.get("Messages", [])
        now_ms = time.time() * 1000
        for message in messages:
            sent = message.get("Attributes", {}).get("SentTimestamp")
            if sent:
                self.metrics.receive_latency.observe(max(0.0, (now_ms - int(sent)) / 1000))
        return messages

    async def handle(self, message: dict[str, Any], received_at: float | None = None) -> None:
        """Handle one message (:class:`~worker.handling.Handler`); a store or queue fault opens
        that dependency's circuit breaker."""
        received_at = time.monotonic() if received_at is None else received_at
        failed = await self.handler.handle(message, received_at)
        if failed is None:
            self.store.succeeded()
            return
        # A failure of the work, or an end-of-job race, says nothing about S3 or SQS.
        breaker = {Fault.STORE: self.store, Fault.QUEUE: self.queue_breaker}.get(failed.fault)
        if breaker is not None:
            breaker.trip(failed.error)
