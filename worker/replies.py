"""The queue as one worker finds it (its :class:`~worker.context.QueueInfo`), and what it answers
SQS about a received message: delete it, back it off, give it back, or dead-letter it. Which of
these a failed receive gets is :mod:`worker.failures`'s to say.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import structlog

from worker.breaker import CircuitBreaker
from worker.context import QueueInfo
from worker.faults import Fault, classify
from worker.metrics import WorkerMetrics
from worker.settings import WorkerSettings
from worker.tries import SQS_MAX_DELAY_S, Receive
from worker.uncounted import Uncounted

log = structlog.get_logger("arbiter.worker")


async def open_queue(
    sqs: Any, settings: WorkerSettings, metrics: WorkerMetrics, stop: asyncio.Event
) -> QueueInfo | None:
    """:func:`describe_queue`, waiting behind the queue's circuit breaker while SQS cannot be
    reached (its probes, ``circuit_probe_s`` doubling to ``circuit_probe_max_s``): a worker
    started or restarted in an SQS outage waits instead of dying (else the pool restarts it until
    its crash-loop limit and exits 1 within a minute). None if ``stop`` is set first. An answer
    that is no outage (no such queue: a configuration error) is raised at once."""
    found: list[QueueInfo] = []
    fatal: list[BaseException] = []

    async def probe() -> None:
        try:
            found.append(await describe_queue(sqs, settings))
        except Exception as exc:
            if classify(exc) is Fault.WORK:
                fatal.append(exc)
                return
            raise

    breaker = CircuitBreaker(
        "queue",
        metrics,
        probe,
        settings.circuit_probe_s,
        settings.circuit_probe_max_s,
    )
    if not await breaker.wait(stop):
        return None
    if fatal:
        raise fatal[0]
    return found[-1]


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


class Replies:
    """What one worker answers SQS about the messages it received. A release SQS does not take
    leaves the message to come back once its visibility runs out: that receive is recorded as
    uncounted first (:mod:`worker.uncounted`), so a queue fault never spends a try."""

    def __init__(
        self,
        sqs: Any,
        queue: QueueInfo,
        metrics: WorkerMetrics,
        uncounted: Uncounted | None = None,
    ) -> None:
        self.sqs, self.queue, self.metrics, self.uncounted = sqs, queue, metrics, uncounted

    async def _uncounted(self, receive: Receive, why: str) -> None:
        if self.uncounted is not None:
            await self.uncounted.record(receive, why)

    async def delete(self, receive: Receive) -> None:
        """Delete the message; a delete SQS does not take needs no record: the message comes back
        to find its work done (an outcome, a summary), whatever its count says."""
        await asyncio.shield(
            self.sqs.delete_message(
                QueueUrl=self.queue.url, ReceiptHandle=receive.message["ReceiptHandle"]
            )
        )

    async def back_off(self, receive: Receive, seconds: int) -> None:
        """Make the message visible again after ``seconds`` (it returns after its visibility
        timeout anyway if SQS cannot be told)."""
        try:
            await asyncio.shield(
                self.sqs.change_message_visibility(
                    QueueUrl=self.queue.url,
                    ReceiptHandle=receive.message["ReceiptHandle"],
                    VisibilityTimeout=seconds,
                )
            )
        except Exception as exc:
            log.warning("visibility.change_failed", error=str(exc))

    async def release(self, receive: Receive, attributes: dict[str, Any], delay_s: int = 0) -> bool:
        """Give the message back, for another worker, after ``delay_s``: sent again as a new
        message with ``attributes`` (what the tries carry over, :meth:`worker.tries.Tries.carried`),
        then deleted, so the receive is not counted. If the copy cannot be sent, the receive is
        recorded as uncounted and the message made visible after the delay instead (or, if SQS
        cannot be told that either, after its visibility timeout); whether the copy went."""
        try:
            await asyncio.shield(
                self.sqs.send_message(
                    QueueUrl=self.queue.url,
                    MessageBody=receive.message["Body"],
                    DelaySeconds=min(SQS_MAX_DELAY_S, delay_s),
                    MessageAttributes=attributes,
                )
            )
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.warning("release.resend_failed", error=error)
            await self._uncounted(receive, f"its release was not sent: {error}")
            await self.back_off(receive, delay_s)
            return False
        with contextlib.suppress(Exception):  # a copy left over is a harmless duplicate
            await self.delete(receive)
        log.info("job.released", retry_in_s=delay_s)
        return True

    async def dead_letter(self, receive: Receive, reason: str) -> None:
        """To the DLQ at once when there is one (then deleted): a message no retry can fix, or
        one out of tries. Without a DLQ, a message no retry can fix is dropped (and logged)."""
        if self.queue.dlq_url:
            body = receive.message["Body"]
            await self.sqs.send_message(QueueUrl=self.queue.dlq_url, MessageBody=body)
            self.metrics.dlq_moves.labels(reason).inc()
        log.error("message.dead_lettered", reason=reason, dlq=bool(self.queue.dlq_url))
        await self.delete(receive)
