"""The queue as one worker sees it, and what it answers SQS about a received message: delete it,
back it off, give it back, or dead-letter it.

**Tries.** The worker allows a message ``ARBITER_MAX_RECEIVE_COUNT`` receives (its *tries*); the
queue's redrive policy allows :data:`~worker.policies.REDRIVE_MARGIN` more, so the worker always sees
the receive after a message's last try, even when that try died with its worker (SIGKILL, OOM, an
abort in llama.cpp, a stopped task): a shard is then failed without running so its job still
finishes; a job message gets one last look after a delay (a receive count can also grow because
SQS showed the message again while a slow holder still worked on it: that holder may yet finish)
and is dead-lettered if its job has neither a summary nor a manifest by then. Only a message that
outlives even the margin (every receive failing before the worker can answer it) is moved by SQS's
redrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

import structlog

from worker.metrics import WorkerMetrics
from worker.policies import worker_tries
from worker.settings import WorkerSettings

log = structlog.get_logger("arbiter.worker")

FAILED_RECEIVES = "ArbiterFailedReceives"  # message attribute: failed receives before a release
LAST_LOOK = "ArbiterLastLook"  # message attribute: a job out of tries, given one more look


def last_look(message: dict[str, Any]) -> bool:
    """Whether this is a job's last look (see the module doc)."""
    return LAST_LOOK in message.get("MessageAttributes", {})


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
    """The job queue: its URL, its redrive policy's ``maxReceiveCount`` and dead-letter queue."""

    url: str
    max_receive_count: int | None
    dlq_url: str | None

    def tries(self, settings: WorkerSettings) -> int:
        """The worker's own tries on this queue (see the module doc)."""
        return worker_tries(settings.max_receive_count, self.max_receive_count)


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
    """What one worker answers SQS about the messages it received."""

    def __init__(self, sqs: Any, queue: QueueInfo, metrics: WorkerMetrics) -> None:
        self.sqs, self.queue, self.metrics = sqs, queue, metrics

    async def delete(self, message: dict[str, Any]) -> None:
        await asyncio.shield(
            self.sqs.delete_message(QueueUrl=self.queue.url, ReceiptHandle=message["ReceiptHandle"])
        )

    async def back_off(self, message: dict[str, Any], seconds: int) -> None:
        """Make the message visible again after ``seconds`` (it returns after its visibility
        timeout anyway if SQS cannot be told)."""
        try:
            await asyncio.shield(
                self.sqs.change_message_visibility(
                    QueueUrl=self.queue.url,
                    ReceiptHandle=message["ReceiptHandle"],
                    VisibilityTimeout=seconds,
                )
            )
        except Exception as exc:
            log.warning("visibility.change_failed", error=str(exc))

    async def release(
        self, message: dict[str, Any], delay_s: int = 0, last_look: bool = False
    ) -> None:
        """Give the message back (a drain deadline passed: at once; a job out of tries: after
        ``delay_s``, marked for its last look), for another worker: sent again as a new message
        carrying its failed receives, then deleted, so the release is not counted as a receive
        that failed. If the copy cannot be sent, it is made visible instead (after the delay)."""
        failed = receive_count(message) - 1
        attributes = {FAILED_RECEIVES: {"DataType": "Number", "StringValue": str(failed)}}
        if last_look:
            attributes[LAST_LOOK] = {"DataType": "String", "StringValue": "1"}
        try:
            await asyncio.shield(
                self.sqs.send_message(
                    QueueUrl=self.queue.url,
                    MessageBody=message["Body"],
                    DelaySeconds=min(900, delay_s),
                    MessageAttributes=attributes,
                )
            )
        except Exception as exc:
            log.warning("release.resend_failed", error=f"{type(exc).__name__}: {exc}")
            await self.back_off(message, delay_s)
        else:
            with contextlib.suppress(Exception):  # a copy left over is a harmless duplicate
                await self.delete(message)
        log.info("job.released")

    async def dead_letter(self, message: dict[str, Any], reason: str) -> None:
        """To the DLQ at once when there is one (then deleted): a message no retry can fix, or
        one out of tries. Without a DLQ, a message no retry can fix is dropped (and logged)."""
        if self.queue.dlq_url:
            await self.sqs.send_message(QueueUrl=self.queue.dlq_url, MessageBody=message["Body"])
            self.metrics.dlq_moves.labels(reason).inc()
        log.error("message.dead_lettered", reason=reason, dlq=bool(self.queue.dlq_url))
        await self.delete(message)
