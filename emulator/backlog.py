"""The async backlog: an SQS queue on the stack's own endpoint (``arbiter local``'s moto server, as
the worker pool uses), not the front's memory.

Why SQS and not a journal on disk: the backlog then lives where the S3 objects it refers to live
(a journal that outlived the local S3 would point at inputs that are gone, and one in the front's
memory dies with it); a request taken by a front that is then killed, even with SIGKILL, becomes
visible again when its visibility timeout lapses, with no lease code of ours; and the same code
runs against a real queue. The 202 is sent only once ``SendMessage`` has the request.

A message is deleted only once the request's outcome is recorded (an object written, or at least
its notification sent); a front that stops first hands it back (visibility 0) for the next one.
So delivery is at least once: a front killed between its write and its delete has the request
answered again (the same object keys, a second notification).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from botocore.exceptions import ClientError

from arbiter.logging import get_logger
from emulator.async_request import AsyncRequest, salvage
from emulator.errors import ServiceUnavailable

log = get_logger("arbiter.runtime")
_EXISTS = {"QueueAlreadyExists", "QueueNameExists"}
_GONE = {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"}
RETENTION_S = 1_209_600  # SQS's longest (14 days): longer than any RequestTTLSeconds (6 h)


@dataclass
class Held:
    """A request a worker has taken (invisible to the others until released or lapsed)."""

    request: AsyncRequest
    receipt: str
    receives: int
    unreadable: str | None = None  # a message not wholly a request: why (answered as a failure)


class Backlog:
    """``put`` on accept, ``take`` by a worker, then ``done`` or ``release``."""

    def __init__(
        self,
        sqs: Any,
        url: str,
        visibility_s: int,
        max_backlog: int,
        name: str = "",
        attributes: dict[str, str] | None = None,
    ) -> None:
        self.sqs = sqs
        self.url = url
        self.name = name
        self.attributes = attributes or {}
        self.visibility_s = visibility_s
        self.max_backlog = max_backlog
        self.size = 0  # ApproximateNumberOfMessages(+NotVisible), refreshed by ``watch``
        self.put_since_count = 0

    @classmethod
    async def open(cls, sqs: Any, name: str, visibility_s: int, max_backlog: int) -> Backlog:
        """The queue, created if missing, or given these attributes if it has others."""
        attributes = {
            "VisibilityTimeout": str(visibility_s),
            "MessageRetentionPeriod": str(RETENTION_S),
        }
        backlog = cls(sqs, "", visibility_s, max_backlog, name, attributes)
        await backlog.reopen()
        await backlog.count()
        return backlog

    async def reopen(self) -> None:
        """Create the queue (again: a restarted S3/SQS server without its state has none, and
        every call failed until the front itself restarted)."""
        try:
            made = await self.sqs.create_queue(QueueName=self.name, Attributes=self.attributes)
            self.url = made["QueueUrl"]
        except ClientError as exc:
            # Made before with other attributes (ARBITER_RUNTIME_VISIBILITY_S changed since):
            # CreateQueue refuses, on AWS as in moto; the queue keeps its messages and takes ours.
            if exc.response.get("Error", {}).get("Code") not in _EXISTS:
                raise
            self.url = (await self.sqs.get_queue_url(QueueName=self.name))["QueueUrl"]
            await self.sqs.set_queue_attributes(QueueUrl=self.url, Attributes=self.attributes)
            log.info("async_backlog_reconfigured", queue=self.name, attributes=self.attributes)

    async def _again_if_gone(self, exc: Exception) -> bool:
        """True once the queue was made anew, if ``exc`` says it is gone."""
        code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
        if code not in _GONE or not self.name:
            return False
        log.warning("async_backlog_recreated", queue=self.name, why=code)
        await self.reopen()
        return True

    async def put(self, request: AsyncRequest) -> None:
        """Accept ``request`` durably; ServiceUnavailable when the queue is full or unreachable."""
        if self.size + self.put_since_count >= self.max_backlog:
            raise ServiceUnavailable(
                f"The async backlog holds {self.size + self.put_since_count} requests "
                "(ARBITER_RUNTIME_MAX_BACKLOG); try again later."
            )
        body = request.to_message()
        try:
            try:
                await self.sqs.send_message(QueueUrl=self.url, MessageBody=body)
            except Exception as exc:
                if not await self._again_if_gone(exc):
                    raise
                await self.sqs.send_message(QueueUrl=self.url, MessageBody=body)
        except Exception as exc:
            log.error("async_backlog_unreachable", error=repr(exc))
            raise ServiceUnavailable("The async backlog cannot be reached; try again.") from exc
        self.put_since_count += 1
        log.info("async_accepted", inference_id=request.inference_id)

    async def take(self, wait_s: int) -> Held | None:
        """One request, or None after ``wait_s`` of an empty queue. A message that is not a
        whole request but names its inference id and locations is returned ``unreadable``, to be
        answered with a failure, not deleted unanswered; one that names nothing to
        answer is logged and deleted."""
        try:
            got = await self.sqs.receive_message(
                QueueUrl=self.url,
                MaxNumberOfMessages=1,
                WaitTimeSeconds=wait_s,
                MessageSystemAttributeNames=["ApproximateReceiveCount"],
            )
        except Exception as exc:
            if await self._again_if_gone(exc):
                return None
            raise
        for message in got.get("Messages", []):
            receipt = message["ReceiptHandle"]
            receives = int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
            try:
                request = AsyncRequest.from_message(message["Body"])
            except (ValueError, KeyError, TypeError) as exc:
                named = salvage(message["Body"], time.time())
                log.error(
                    "async_backlog_bad_message",
                    body=message["Body"][:200],
                    error=repr(exc),
                    answered=named is not None,
                )
                if named is not None:
                    why = f"the request's backlog message could not be read ({exc!r})"
                    return Held(named, receipt, receives, unreadable=why)
                await self.sqs.delete_message(QueueUrl=self.url, ReceiptHandle=receipt)
                continue
            return Held(request, receipt, receives)
        return None

    async def done(self, held: Held) -> None:
        await self.sqs.delete_message(QueueUrl=self.url, ReceiptHandle=held.receipt)

    async def release(self, held: Held, delay_s: int = 0) -> None:
        """Back to the queue, visible again after ``delay_s``; if this call fails, the message's
        visibility timeout lapses anyway and it comes back then."""
        try:
            await self.sqs.change_message_visibility(
                QueueUrl=self.url, ReceiptHandle=held.receipt, VisibilityTimeout=delay_s
            )
        except Exception as exc:
            log.error(
                "async_release_failed",
                inference_id=held.request.inference_id,
                error=repr(exc),
                back_within_s=self.visibility_s,
            )

    @contextlib.asynccontextmanager
    async def holding(self, held: Held) -> AsyncIterator[None]:
        """Keep ``held`` invisible while the block runs (a heartbeat every third of the
        visibility timeout), as long as processing takes (up to 3,600 s)."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(self.visibility_s / 3)
                try:
                    await self.sqs.change_message_visibility(
                        QueueUrl=self.url,
                        ReceiptHandle=held.receipt,
                        VisibilityTimeout=self.visibility_s,
                    )
                except Exception as exc:  # the next beat tries again
                    log.warning("async_heartbeat_failed", error=repr(exc))

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def count(self) -> int:
        """Requests queued or being processed (SageMaker's ApproximateBacklogSize)."""
        got = await self.sqs.get_queue_attributes(
            QueueUrl=self.url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )
        attributes = got.get("Attributes", {})
        self.size = int(attributes.get("ApproximateNumberOfMessages", 0)) + int(
            attributes.get("ApproximateNumberOfMessagesNotVisible", 0)
        )
        self.put_since_count = 0
        return self.size

    async def watch(self, every_s: float = 1.0) -> None:
        """Refresh ``size`` until cancelled (the backlog metric and the full-queue check)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.count()
            except Exception as exc:
                log.warning("async_backlog_count_failed", error=repr(exc))
                with contextlib.suppress(Exception):
                    await self._again_if_gone(exc)


BACKLOG = web.AppKey("backlog", Backlog)
